# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""DEVICE=cpu beside the CUDA build, in a fresh copy of this repository (downloads come from the caches).

  uv run benchmarks/device_switch.py [--repeat 5] [--rig DIR] [--quick]

--rig DIR: work in that copy of the rig instead of a fresh one (CI passes its built copy): its builds are made
where missing, so (a) times re-runs where they are there, and says so. --quick: --repeat 1.

(a) the first `DEVICE=cpu ./build.sh` after the CUDA build, warm caches;
(b) a no-op `DEVICE=cpu ./build.sh`, median of N, against `python -c 'import nox'` with the interpreter
    the wrapper runs nox with (target: the same ratio as the CUDA no-op, measured here too);
(c) `DEVICE` switched back and forth (cuda, cpu, cuda, cpu): each run's time, and proof that nothing was
    downloaded, copied or rebuilt: the download cache, both kernel sets and both venvs' vllm install keep
    their files (same inode, size and mtime).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_rerun import CLEAN, fresh_copy, nox_python, sh  # noqa: E402 - benchmarks/build_rerun.py
from timing import median_time  # noqa: E402 - benchmarks/timing.py


def stamps(*folders: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of every file below ``folders``: a copy or a download changes one of them."""
    out = {}
    for d in folders:
        for p in d.rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                st = p.stat()
                out[str(p)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rig", type=Path, help="a copy of the rig to work in (no fresh copy; its builds are reused)")
    ap.add_argument("--quick", action="store_true", help="--repeat 1: the same code, in the least time")
    a = ap.parse_args()
    if a.quick:
        a.repeat = 1
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-device-"))
    try:
        rig = a.rig.resolve() if a.rig else tmp / "rig"
        if not a.rig:
            fresh_copy(rig)
        built = [d for d in ("vllm", "vllm-cpu") if (rig / d / ".build-products").exists()]
        env = {k: v for k, v in os.environ.items() if k not in CLEAN and k not in ("DEVICE", "ARTIFACTS_DIR")}
        cpu = {**env, "DEVICE": "cpu"}
        build = [str(rig / "build.sh")]
        t0 = time.perf_counter()
        sh(build, rig, env)
        cuda_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        sh(build, rig, cpu)
        cpu_first = time.perf_counter() - t0
        first = "the first " if not built else ""
        where = f"{rig} (--rig; {', '.join(built)} built before: re-runs)" if built else "the fresh copy"
        print(f"(a) {first}./build.sh (CUDA) of {where}: {cuda_first:.1f} s; then {first}DEVICE=cpu ./build.sh: "
              f"{cpu_first:.1f} s  | ratio {cpu_first / cuda_first:.2f}x the CUDA build")

        py = nox_python(rig, env)
        base = median_time(lambda: sh([py, "-c", "import nox"], rig, env), a.repeat)
        noop_cuda = median_time(lambda: sh(build, rig, env), a.repeat)
        noop_cpu = median_time(lambda: sh(build, rig, cpu), a.repeat)
        print(f"(b) no-op DEVICE=cpu ./build.sh, median of {a.repeat}: {noop_cpu:.2f} s ({noop_cpu / base:.1f}x)  | "
              f"no-op ./build.sh (CUDA): {noop_cuda:.2f} s ({noop_cuda / base:.1f}x)  | python -c 'import nox': "
              f"{base:.2f} s  | target: the CPU ratio at most the CUDA ratio (<= 3x)")

        watched = [Path(env.get("RIG_CACHE", Path.home() / ".cache" / "vllm-rig")) / "dist",
                   rig / "vllm" / "vllm", rig / "vllm-cpu" / "vllm",
                   rig / ".venv" / "lib", rig / ".venv-cpu" / "lib", rig / "artifacts", rig / "artifacts-cpu"]
        before = stamps(*watched)
        times = []
        for name, e in (("cuda", env), ("cpu", cpu), ("cuda", env), ("cpu", cpu)):
            t0 = time.perf_counter()
            r = sh(build, rig, e)
            times.append(f"{name} {time.perf_counter() - t0:.2f} s")
            ran = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("runs:")]
            assert not ran, f"DEVICE={name}: a step ran after the switch: {ran}"
        after = stamps(*watched)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        print(f"(c) DEVICE switched back and forth: {', '.join(times)}  | steps run: 0  | files downloaded, "
              f"copied or rewritten under the caches, kernels, venvs and artifacts: {len(changed)} of "
              f"{len(before)}" + (f" (e.g. {changed[0]})" if changed else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
