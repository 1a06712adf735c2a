# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""Two nodes of the demo on this box against one, on this repository's CPU build (run `DEVICE=cpu ./build.sh`
first). Each rank gets its own state folder and core, as tests/test_serve_real.py runs them.

  uv run benchmarks/nodes_start.py [--rig DIR] [--quick]

--rig DIR: the CPU-built copy of the rig to start (default: this checkout). --quick: no warm-up start (CI runs
it so, right after its own demo engines, so the files are warm anyway): three engine starts instead of four.

(a) `./start.sh --demo` to healthy with NODES=2 (the head and a headless worker started together), against
    the one-node `./start.sh --demo` in the same run (both warm: the one-node start runs first, once, unmeasured);
(b) `kill -9` of the worker's server to the head's registry reporting it, against the agent's beat interval
    (BEAT in rig/nodes/client.py: the floor of any report).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.nodes.client import BEAT, call  # noqa: E402
from rig.running.health import port_open  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nox(rig: Path, env: dict[str, str], *args: str) -> None:
    subprocess.run([str(rig / "scripts" / "nox.sh"), *args], cwd=rig, env=env, capture_output=True, timeout=300)


def start(rig: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([str(rig / "start.sh"), "--demo", "--no-build"], cwd=rig, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def one_node(rig: Path, tmp: Path, tag: str) -> float:
    env = {**os.environ, "PORT": str(free_port()), "LOG": str(tmp / f"one-{tag}.log"), "RIG_STATE": str(tmp / tag)}
    t0 = time.perf_counter()
    p = start(rig, env)
    try:
        out, _ = p.communicate(timeout=900)
        took = time.perf_counter() - t0
    finally:
        p.kill()
        nox(rig, env, "-s", "stop")
    if p.returncode:
        raise SystemExit(f"the one-node start failed:\n{out[-3000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rig", type=Path, default=ROOT, help="the CPU-built copy of the rig (default: this one)")
    ap.add_argument("--quick", action="store_true", help="no warm-up start: three engine starts instead of four")
    a = ap.parse_args()
    rig = a.rig.resolve()
    if not (rig / ".venv-cpu" / "bin" / "vllm").exists():
        raise SystemExit(f"no {rig / '.venv-cpu'}: run DEVICE=cpu ./build.sh in {rig} first")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.quick:
            one_node(rig, tmp, "warm-up")
        one = one_node(rig, tmp, "one")
        common = {**os.environ, "NODES": "2", "HEAD_ADDR": "127.0.0.1", "HEAD_PORT": str(free_port()),
                  "NODES_PORT": str(free_port()), "NODES_SECRET": secrets.token_hex(32)}
        head = {**common, "NODE_RANK": "0", "PORT": str(free_port()), "LOG": str(tmp / "head.log"),
                "RIG_STATE": str(tmp / "head"), "VLLM_CPU_OMP_THREADS_BIND": "0"}
        worker = {**common, "NODE_RANK": "1", "PORT": str(free_port()), "LOG": str(tmp / "worker.log"),
                  "RIG_STATE": str(tmp / "worker"), "VLLM_CPU_OMP_THREADS_BIND": "1"}
        t0 = time.perf_counter()
        h, w = start(rig, head), start(rig, worker)
        try:
            h_out, _ = h.communicate(timeout=900)
            two = time.perf_counter() - t0
            w.communicate(timeout=300)
            if h.returncode or not port_open("127.0.0.1", int(head["PORT"])):
                raise SystemExit(f"the two-node start failed:\n{h_out[-3000:]}")
            print(f"(a) two-node demo to healthy: {two:.1f} s; one node: {one:.1f} s; ratio {two / one:.2f}x")
            rec = tomllib.loads((tmp / "worker" / "engine.toml").read_text())
            url = tomllib.loads((tmp / "head" / "nodes.toml").read_text())["url"]
            server = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _headless(int(pid), rec))
            os.kill(server, signal.SIGKILL)
            t1 = time.perf_counter()
            while call(url, "/state", secret=head["NODES_SECRET"])[1]["members"]["1"]["engine"] != "gone":
                if time.perf_counter() - t1 > 60:
                    raise SystemExit("the head's registry did not report the killed worker in 60 s")
                time.sleep(0.02)
            seen = time.perf_counter() - t1
            print(f"(b) worker killed -> the head reports it: {seen:.2f} s; the beat interval: {BEAT:.2f} s; "
                  f"ratio {seen / BEAT:.2f}x")
        finally:
            h.kill()
            w.kill()
            nox(rig, head, "-s", "stop")
            nox(rig, worker, "-s", "stop")


def _headless(pid: int, rec: dict) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return os.getpgid(pid) == rec["pgid"] and b"--headless" in cmd and not any(b"logpump" in c for c in cmd)
    except (OSError, ProcessLookupError):
        return False


if __name__ == "__main__":
    main()
