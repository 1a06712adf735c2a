# /// script
# requires-python = ">=3.11"
# dependencies = ["psutil>=5.9", "tomli-w>=1.0", "requests>=2.31", "nvidia-ml-py>=12"]
# ///
"""How long ./start.sh takes before the engine runs, and what one health check costs.

  uv run benchmarks/start_time.py [--repeat 5]

Run in a checkout with a current build (./build.sh first).
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

from rig import supervise  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_engine_start(env: dict, skip_box: bool) -> float:
    """Seconds from ./start.sh to its "engine started" line; the engine is stopped afterwards."""
    cmd = [str(ROOT / "start.sh")] + (["--skip-box-check"] if skip_box else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    took = None
    for line in proc.stdout:
        seen.append(line)
        if "engine started: pid" in line:
            took = time.perf_counter() - t0
            break
    proc.terminate()
    proc.wait()
    subprocess.run([str(ROOT / "scripts/nox.sh"), "-s", "stop"], cwd=ROOT, env=env, capture_output=True)
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
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-start-"))
    try:
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        (ckpt / "qsa_kv_scales.json").write_text("{}")
        env = {**os.environ, "CKPT": str(ckpt), "PORT": str(free_port()), "LOG": str(tmp / "vllm.log"),
               "RIG_STATE": str(ROOT / ".rig"), "CACHE_ROOT": str(tmp / "cache"), "STOP_TIMEOUT": "5"}
        try:
            import pynvml

            pynvml.nvmlInit()
            skip_box = False
        except Exception:
            skip_box = True
        uv = shutil.which("uv") or str(Path.home() / ".local/bin/uv")
        py = subprocess.run([uv, "python", "find", "--script", str(ROOT / "noxfile.py")], capture_output=True,
                            text=True, check=True).stdout.strip()
        base = median_time(lambda: subprocess.run([py, "-c", "import nox"], check=True), a.repeat)
        to_engine_start(env, skip_box)  # warm the page cache once
        took = sorted(to_engine_start(env, skip_box) for _ in range(a.repeat))[a.repeat // 2]
        print(f"(a) ./start.sh to the engine process started{' (box check skipped: no GPU)' if skip_box else ''}: "
              f"{took:.2f} s (median of {a.repeat}); python -c 'import nox' {base:.2f} s: "
              f"{took / base:.1f}x; target <= 1.5 s")

        port = free_port()
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Instant)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        n = 200
        check = median_time(lambda: [supervise.health("127.0.0.1", port, "m") for _ in range(n)], 3) / n
        raw = median_time(lambda: [raw_request(port) for _ in range(n)], 3) / n
        srv.shutdown()
        print(f"(b) one health check against a server that answers at once: {check * 1000:.2f} ms; the same "
              f"request over a raw socket {raw * 1000:.2f} ms: {check / raw:.1f}x (the engine's own token excluded)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
