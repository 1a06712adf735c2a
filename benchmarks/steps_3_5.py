# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""Steps 3-5 (venv, runtime, toolchain) re-run on a current venv, against `uv pip list` on the same venv.

  uv run benchmarks/steps_3_5.py [--repeat 10] [--venv-dir DIR --state DIR] [--quick]

Builds a real venv from scripts/runtime.lock in a temp folder (from the uv cache once it is warm),
then times the three steps' current-checks in-process (target <= 0.3 s together) and the
libcuda.so.1 stub generation, each next to its baseline measured in the same run.
--venv-dir and --state: a venv and state folder where these steps ran before (CI passes its tests' own, so the
first build is a re-check); --quick: --repeat 1, one stub generation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402 - benchmarks/timing.py

from rig.base.venvs import site_packages  # noqa: E402
from rig.build.cudastub import build as build_stub  # noqa: E402
from rig.build.cudastub import entry_points  # noqa: E402
from rig.build.steps.pipeline import Options, context  # noqa: E402
from rig.build.steps.pipeline import run as run_steps  # noqa: E402
from rig.build.steps.runtime import RuntimeStep, read_lock  # noqa: E402
from rig.build.steps.toolchain import ToolchainStep  # noqa: E402
from rig.build.steps.venv import VenvStep  # noqa: E402
from rig.facts.config import settings  # noqa: E402
from rig.facts.uv import find as find_uv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--venv-dir", type=Path, help="a venv the steps made (default: a new one in a temp folder)")
    ap.add_argument("--state", type=Path, help="with --venv-dir: its state folder (RIG_STATE), where they recorded it")
    ap.add_argument("--quick", action="store_true", help="--repeat 1, one stub generation: the same code, in seconds")
    a = ap.parse_args()
    if (a.venv_dir is None) != (a.state is None):
        ap.error("--venv-dir and --state go together: the steps check a venv against the record in its state")
    stub_repeat = 5
    if a.quick:
        a.repeat, stub_repeat = 1, 1
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-35-"))
    try:
        env = {**os.environ, "VENV_DIR": str((a.venv_dir or tmp / ".venv").resolve()),
               "RIG_STATE": str((a.state or tmp / "state").resolve())}
        s = settings(env)
        steps = [VenvStep(), RuntimeStep(), ToolchainStep()]
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            run_steps(steps, s, Options())
        first = time.perf_counter() - t0
        def checks() -> None:
            ctx = context(s)  # read as a real run reads it: the record once, then every check
            for st in steps:
                assert st.check(ctx).current, st.name

        ctx = context(s)
        uv = ctx.uv or find_uv()  # the steps' own uv; with UV=0 (no uv for the steps), the wrappers' one
        py = str(s.venv_dir / "bin" / "python")
        baseline = median_time(lambda: subprocess.run([uv, "pip", "list", "--python", py], check=True,
                                                      capture_output=True), a.repeat)
        rerun = median_time(checks, a.repeat)
        size = sum(f.stat().st_size for f in site_packages(s.venv_dir).rglob("*")
                   if f.is_file() and not f.is_symlink())
        pins = len(read_lock(s.runtime_lock).pins)
        what = "re-check of the given venv" if a.venv_dir else "first build"
        print(f"venv from the lock: {pins} pins, {size / 1e9:.2f} GB in the venv, {what} {first:.1f} s")
        print(f"steps 3-5 re-run on a current venv, in-process, median of {a.repeat}: {rerun:.3f} s"
              f"  | uv pip list: {baseline:.3f} s  | ratio {rerun / baseline:.2f}x  | target <= 0.3 s")
        cuda_h = Path(ctx.record.toolchain.cuda_home) / "include" / "cuda.h"
        out = tmp / "stub"
        gen = median_time(lambda: build_stub(cuda_h, out), stub_repeat)
        cc = median_time(lambda: subprocess.run(["cc", "-x", "c", "-shared", "-o", str(tmp / "empty.so"), "-"],
                                                input=b"int x;", check=True), stub_repeat)
        n = len(entry_points(cuda_h))
        print(f"driver stub from {cuda_h.parent.parent.name}'s cuda.h: {n} entry points,"
              f" {(out / 'libcuda.so.1').stat().st_size / 1024:.0f} KB, median of {stub_repeat}: {gen:.3f} s"
              f"  | cc of an empty shared library: {cc:.3f} s  | ratio {gen / cc:.1f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
