# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""The rig on a GPU against the bare engine, in one run on the card (docs/gpu.md quotes it).

  python3 benchmarks/gpu_figures.py [--build] [--quick] [--out FILE]   (on the GPU box; TORCH/PYTHON/OFFLINE as
                                                                         the build has them)
--quick: one decode round instead of three.

Each figure is a ratio against a baseline of the same run:
(0) --build: ``./build.sh`` on this (fresh) checkout, then again: the first build's time against the no-op's.
    With OFFLINE set it installs from the bundle alone (the GPU box of docs/gpu.md has no network at all).
(a) ``./start.sh --demo`` to healthy with a warm compile cache, against bare ``vllm serve`` of the same command
    and environment (the rig's own plan) polled with one-token requests every 0.5 s: target <= 1.05x.
(b) the warm ``./start.sh`` against the cold one (an empty CACHE_ROOT): target <= 0.6x.
(c) decode tokens/s through the rig's engine against the bare one, at concurrency 1 and 4 (256 tokens a request,
    the median of 3 rounds): the rig adds nothing to the data path, so 1.00x within noise.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig import enginerec, serve  # noqa: E402
from rig.health import health  # noqa: E402

PROMPT = "Write a long story about the sea, the river and the town between them."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def card_free(limit: float = 90) -> None:
    """Wait until no compute process holds the card (the last engine's memory released)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        deadline = time.monotonic() + limit
        while pynvml.nvmlDeviceGetComputeRunningProcesses(h) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        pynvml.nvmlShutdown()


def timed_run(cmd: list[str], env: dict, log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "a") as fh:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    took = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {r.returncode}): see {log}")
    return took


def rig_start(env: dict, log: Path) -> float:
    return timed_run([str(ROOT / "start.sh"), "--demo"], env, log)


def rig_stop(env: dict, log: Path) -> None:
    timed_run([str(ROOT / "scripts" / "nox.sh"), "-s", "stop"], env, log)
    card_free()


def bare_start(env: dict, log: Path) -> tuple[subprocess.Popen, float]:
    """The rig's own engine command and environment, run as a bare ``vllm serve``; seconds to a one-token answer."""
    s, v, p = serve.inputs(env)
    plan = serve.plan(s, v, p, serve.check_box(s, v, p, check=False))
    enginerec.fresh_runtime(s)  # the engine's runtime folder, which the supervisor makes before each start
    fh = open(log, "a")  # noqa: SIM115 - the engine writes it until it is killed
    t0 = time.monotonic()
    proc = subprocess.Popen(plan.engine.argv, env=plan.engine.full_env(env), stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    while True:
        if proc.poll() is not None:
            sys.exit(f"bare vllm serve ended (exit {proc.returncode}): see {log}")
        ok, _ = health(s.host, s.port, v.names[0], v.api_key, timeout=10, extra=p.health)
        if ok:
            return proc, time.monotonic() - t0
        time.sleep(0.5)


def decode(env: dict, concurrency: int, tokens: int = 256, rounds: int = 3, model: str = "demo") -> float:
    """Generated tokens per second over ``concurrency`` parallel requests of ``tokens`` each (median of rounds)."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if env.get("VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {env['VLLM_API_KEY']}"

    def one() -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{env['PORT']}/v1/completions", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]

    one()  # a warm-up request
    rates = []
    for _ in range(rounds):
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(concurrency) as ex:
            done = sum(ex.map(lambda _: one(), range(concurrency)))
        rates.append(done / (time.monotonic() - t0))
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="time ./build.sh on this checkout first (figure 0)")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="one decode round instead of three")
    a = ap.parse_args()
    rounds = 1 if a.quick else 3
    work = Path(tempfile.mkdtemp(prefix="gpu-figures-"))
    log = work / "run.log"
    env = {**os.environ, "PROFILE": "demo-gpu", "DEVICE": "cuda", "CACHE_ROOT": str(work / "cache"),
           "LOG": str(work / "vllm.log"), "PORT": str(free_port()), "VLLM_API_KEY": "",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    figures: dict[str, float] = {}
    lines = []
    if a.build and (ROOT / "vllm").exists():  # a second build here is the no-op, not the figure (0) stands for
        lines.append(f"(0) not measured: {ROOT} is built already; --build times the first build of a fresh checkout")
    elif a.build:
        first = timed_run([str(ROOT / "build.sh")], env, log)
        again = timed_run([str(ROOT / "build.sh")], env, log)
        figures.update(build_s=first, noop_build_s=again)
        lines.append(f"(0) ./build.sh on a fresh checkout{' from the offline bundle' if env.get('OFFLINE') else ''}: "
                     f"{first:.1f} s; the no-op build after it {again:.2f} s ({first / again:.0f}x)")
    card_free()
    cold = rig_start(env, log)
    rig_dec = {c: decode(env, c, rounds=rounds) for c in (1, 4)}
    rig_stop(env, log)
    warm = rig_start(env, log)
    rig_stop(env, log)
    proc, bare = bare_start(env, log)
    try:
        bare_dec = {c: decode(env, c, rounds=rounds) for c in (1, 4)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        enginerec.clear_runtime(serve.inputs(env)[0])
    card_free()
    figures.update(rig_cold_s=cold, rig_warm_s=warm, bare_warm_s=bare,
                   **{f"rig_decode_c{c}": rig_dec[c] for c in rig_dec},
                   **{f"bare_decode_c{c}": bare_dec[c] for c in bare_dec})
    lines += [
        f"(a) start to healthy, warm cache: ./start.sh --demo {warm:.1f} s, bare vllm serve {bare:.1f} s: "
        f"{warm / bare:.2f}x (target <= 1.05x)",
        f"(b) ./start.sh warm {warm:.1f} s against cold {cold:.1f} s: {warm / cold:.2f}x (target <= 0.6x)",
        *(f"(c) decode at concurrency {c}: through the rig {rig_dec[c]:.0f} tok/s, bare {bare_dec[c]:.0f} tok/s: "
          f"{rig_dec[c] / bare_dec[c]:.2f}x (target 1.00x)" for c in (1, 4)),
    ]
    for line in lines:
        print(line)
    if a.out:
        a.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
