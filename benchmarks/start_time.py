# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""How long ./start.sh takes before the engine runs, and what one health check costs.

  uv run benchmarks/start_time.py [--repeat 5] [--rig DIR] [--quick]

Run in a checkout with a current build (./build.sh first), or name a built copy of the rig with --rig DIR.
--quick: --repeat 1 and 20 health checks a round (CI runs it so, on its built copy).
(a) `./start.sh` to the "engine started" line, the engine's own start excluded: build check, box
    check (skipped with --skip-box-check where there is no GPU), topology, command, spawn; median
    of N against `python -c 'import nox'` with the interpreter the wrapper runs nox with, in the
    same run (target <= 1.5 s). The engine is the real `.venv/bin/vllm`; it is stopped right after.
(b) the health check (a one-token chat completion) against a loopback server that answers at
    once, against the same request over a raw socket: the check's own overhead per poll.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402 - benchmarks/timing.py

from rig.facts.uv import find as find_uv  # noqa: E402
from rig.running.health import health  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_engine_start(rig: Path, env: dict, skip_box: bool) -> float:
    """Seconds from ./start.sh to its "engine started" line; the engine is stopped afterwards."""
    cmd = [str(rig / "start.sh")] + (["--skip-box-check"] if skip_box else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=rig, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    took = None
    for line in proc.stdout:
        seen.append(line)
        if "engine started: pid" in line:
            took = time.perf_counter() - t0
            break
    proc.terminate()
    proc.wait()
    subprocess.run([str(rig / "scripts/nox.sh"), "-s", "stop"], cwd=rig, env=env, capture_output=True, timeout=300)
    if took is None:
        raise SystemExit("./start.sh did not start the engine:\n" + "".join(seen)[-3000:])
    return took


class Instant(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "x"}}],
                       "usage": {"completion_tokens": 1}}).encode()

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


def raw_request(port: int) -> None:
    payload = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(req)
        while s.recv(65536):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rig", type=Path, default=ROOT, help="the built copy of the rig to start (default: this one)")
    ap.add_argument("--quick", action="store_true", help="--repeat 1, 20 health checks: the same code, in seconds")
    a = ap.parse_args()
    rig = a.rig.resolve()
    n = 200
    if a.quick:
        a.repeat, n = 1, 20
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-start-"))
    try:
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        (ckpt / "qsa_kv_scales.json").write_text("{}")
        env = {**os.environ, "CKPT": str(ckpt), "PORT": str(free_port()), "LOG": str(tmp / "vllm.log"),
               "RIG_STATE": str(rig / ".rig"), "CACHE_ROOT": str(tmp / "cache"), "STOP_TIMEOUT": "5"}
        try:
            import pynvml

            pynvml.nvmlInit()
            skip_box = False
        except Exception:
            skip_box = True
        py = subprocess.run([find_uv(rig), "python", "find", "--script", str(rig / "noxfile.py")],
                            capture_output=True, text=True, check=True).stdout.strip()
        base = median_time(lambda: subprocess.run([py, "-c", "import nox"], check=True), a.repeat)
        to_engine_start(rig, env, skip_box)  # warm the page cache once
        took = sorted(to_engine_start(rig, env, skip_box) for _ in range(a.repeat))[a.repeat // 2]
        print(f"(a) ./start.sh to the engine process started{' (box check skipped: no GPU)' if skip_box else ''}: "
              f"{took:.2f} s (median of {a.repeat}); python -c 'import nox' {base:.2f} s: "
              f"{took / base:.1f}x; target <= 1.5 s")

        port = free_port()
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Instant)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        rounds = 1 if a.quick else 3
        check = median_time(lambda: [health("127.0.0.1", port, "m") for _ in range(n)], rounds) / n
        raw = median_time(lambda: [raw_request(port) for _ in range(n)], rounds) / n
        srv.shutdown()
        print(f"(b) one health check against a server that answers at once: {check * 1000:.2f} ms; the same "
              f"request over a raw socket {raw * 1000:.2f} ms: {check / raw:.1f}x (the engine's own token excluded)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
