# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""./start.sh --demo on this repository's CPU build (run `DEVICE=cpu ./build.sh` first).

  uv run benchmarks/demo_start.py [--repeat 5] [--serve] [--rig DIR] [--quick]

--rig DIR: the copy of the rig to work on, CPU-built (default: this checkout). --quick: --repeat 1, 3 probes in
(d) and `bench.sh 32 8 "1 4"` in (e): the same code in the least time (CI runs `--serve --quick --rig` on its copy).

(a) making the demo model (rig/build/demo.py, with the CPU venv's transformers), against importing
    transformers and torch in the same venv (the floor of any checkpoint made there);
(b) the no-op `./start.sh --demo --dry-run` (build current, model made), median of N, against
    `python -c 'import nox'` with the interpreter the wrapper runs nox with;
(c) with --serve: `./start.sh --demo` to healthy, then `nox -s stop` (a free port, log in a temp folder),
    against a bare `vllm serve` of the same command polled with one-token requests;
(d) with --serve, on that engine: the health check's cost per probe (a one-token generation), against
    GET /v1/models (a probe that generates nothing), median of 20 each (3 with --quick);
(e) with --serve: the demo model's bench figures, `benchmarks/bench.sh 128 16 "1 4"` (llama-benchy 0.4.0):
    prefill and decode t/s at concurrency 1 and 4 (reported, not a target; `32 8` with --quick).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from build_rerun import nox_python, sh  # noqa: E402 - benchmarks/build_rerun.py
from timing import median_time, timed  # noqa: E402 - benchmarks/timing.py

from rig.build.demo import ensure as ensure_demo  # noqa: E402
from rig.facts.config import serve_settings, settings  # noqa: E402
from rig.facts.profiles import load as load_profile  # noqa: E402
from rig.plan.serve import BoxReport, plan  # noqa: E402
from rig.running.enginerec import clear_runtime, fresh_runtime, terminate  # noqa: E402
from rig.running.health import health  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bare_serve(rig: Path, env: dict[str, str]) -> float:
    """The same ``vllm serve`` command and environment the rig would run, started bare and polled every 0.5 s
    with the rig's one-token request until it answers; the seconds that took. The engine is then stopped."""
    s, v = settings(env, root=rig), serve_settings(env, root=rig)
    p = load_profile(s.profile, rig / "models")
    eng = plan(s, v, p, BoxReport(None, checked=False)).engine  # the rig's own plan: what ./start.sh runs
    fresh_runtime(s)  # the engine's runtime folder, which the rig's supervisor makes before each start
    t0 = time.perf_counter()
    proc = subprocess.Popen(eng.argv, env=eng.full_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd="/")
    try:
        while not health(s.host, s.port, v.names[0], timeout=5, extra=p.health)[0]:
            if proc.poll() is not None:
                raise SystemExit(f"bare vllm serve exited with {proc.returncode}")
            if time.perf_counter() - t0 > 900:
                raise SystemExit("bare vllm serve: not healthy after 900 s")
            time.sleep(0.5)
        return time.perf_counter() - t0
    finally:
        terminate(proc.pid, 20)
        clear_runtime(s)


def probe_cost(env: dict[str, str], n: int) -> None:
    """(d): the rig's health probe against the cheapest request the server answers, on the running engine."""
    import http.client
    import statistics

    port = int(env["PORT"])

    def models() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        conn.getresponse().read()
        conn.close()

    def probe() -> None:
        ok, detail = health("127.0.0.1", port, "demo", timeout=30)
        if not ok:
            raise SystemExit(f"the health probe failed: {detail}")

    times = {}
    for name, fn in (("models", models), ("probe", probe)):
        fn()  # warm
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples)
    print(f"(d) the health check (a one-token generation), median of {n}: {times['probe'] * 1e3:.1f} ms per probe  | "
          f"GET /v1/models: {times['models'] * 1e3:.1f} ms  | ratio {times['probe'] / times['models']:.1f}x")


def bench_figures(rig: Path, env: dict[str, str], results: Path, pp: int, tg: int) -> None:
    """(e): bench.sh against the demo engine; its table's prefill and decode t/s at concurrency 1 and 4."""
    r = sh([str(rig / "benchmarks" / "bench.sh"), str(pp), str(tg), "1 4", "0", "--runs", "1", "--skip-coherence",
            "--results-dir", str(results)], rig, {**env, "PROFILE": "demo"})
    folder = Path(next(ln for ln in r.stdout.splitlines() if ln.startswith("results: ")).removeprefix("results: "))

    def figure(cell: str) -> float | None:
        """A table cell's mean; None for llama-benchy's dash (it measures no rate when an answer arrives in too
        few chunks, which a fast box and the demo's short answers make happen now and then: its peak rate stands
        in, marked as such)."""
        head = cell.split()[0] if cell.split() else ""
        return float(head) if head[:1].isdigit() else None

    rows = {}
    for ln in (folder / "results.md").read_text().splitlines():
        cols = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cols) == 9 and cols[0].isdigit():
            gen, peak = figure(cols[5]), figure(cols[7])
            rows[int(cols[0])] = (figure(cols[3]), gen if gen is not None else peak, gen is None)

    def show(v: float | None, digits: int) -> str:
        return "—" if v is None else f"{v:.{digits}f}"

    line = "  | ".join(f"c={c}: prefill {show(pre, 0)} t/s, decode {show(dec, 1)} t/s{' (peak)' if peak else ''}"
                       for c, (pre, dec, peak) in sorted(rows.items()))
    d1, d4 = (rows.get(c, (None, None, False))[1] for c in (1, 4))
    ratio = f"{d4 / d1:.1f}x" if d1 and d4 else "— (a rate not measured)"
    print(f"(e) the demo model, bench.sh {pp} {tg} '1 4' (llama-benchy 0.4.0): {line}  | decode c=4 / c=1: "
          f"{ratio} (reported, not a target)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--serve", action="store_true", help="also start the engine and time it to healthy")
    ap.add_argument("--rig", type=Path, default=ROOT, help="the CPU-built copy of the rig (default: this one)")
    ap.add_argument("--quick", action="store_true", help="--repeat 1, fewer probes, a smaller bench: in the least "
                    "time")
    a = ap.parse_args()
    rig = a.rig.resolve()
    probes, (pp, tg) = 20, (128, 16)
    if a.quick:
        a.repeat, probes, (pp, tg) = 1, 3, (32, 8)
    py = rig / ".venv-cpu" / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no {py}: run DEVICE=cpu ./build.sh in {rig} first")
    with tempfile.TemporaryDirectory() as tmp:
        make = timed(lambda: ensure_demo(py, Path(tmp) / "demo", rig))
        floor = timed(lambda: subprocess.run([str(py), "-c", "import torch, transformers, tokenizers"], check=True))
        print(f"(a) making the demo model: {make:.1f} s  | importing torch + transformers there: {floor:.1f} s  "
              f"| ratio {make / floor:.1f}x")
        env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "PROFILE", "CKPT")}
        env.update(LOG=str(Path(tmp) / "vllm.log"), PORT=str(free_port()))
        # the model where ./start.sh --demo makes it (a dry run only says it is missing, and stops with exit 2)
        ensure_demo(py, settings({**env, "PROFILE": "demo", "DEVICE": "cpu"}, root=rig).ckpt, rig)
        sh([str(rig / "start.sh"), "--demo", "--dry-run"], rig, env)  # warm
        nox_py = nox_python(rig, env)
        base = median_time(lambda: sh([nox_py, "-c", "import nox"], rig, env), a.repeat)
        dry = median_time(lambda: sh([str(rig / "start.sh"), "--demo", "--dry-run"], rig, env), a.repeat)
        print(f"(b) no-op ./start.sh --demo --dry-run, median of {a.repeat}: {dry:.2f} s  | python -c 'import nox': "
              f"{base:.2f} s  | ratio {dry / base:.1f}x")
        if a.serve:
            t0 = time.perf_counter()
            try:
                sh([str(rig / "start.sh"), "--demo"], rig, env)
                up = time.perf_counter() - t0
                probe_cost(env, probes)
                bench_figures(rig, env, Path(tmp) / "results", pp, tg)
            finally:
                sh([str(rig / "scripts" / "nox.sh"), "-s", "stop"], rig, env)
            bare = bare_serve(rig, {**env, "PROFILE": "demo", "DEVICE": "cpu"})
            print(f"(c) ./start.sh --demo to healthy (build current, model made): {up:.0f} s  | bare vllm serve of "
                  f"the same command, polled with one-token requests: {bare:.0f} s  | ratio {up / bare:.2f}x  | "
                  "target <= 1.05x")


if __name__ == "__main__":
    main()
