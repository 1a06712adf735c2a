# /// script
# requires-python = ">=3.11"
# dependencies = ["requests>=2.31", "tomli-w>=1.0", "psutil>=5.9"]
# ///
"""Steps 3-5 (venv, runtime, toolchain) re-run on a current venv, against `uv pip list` on the same venv.

  uv run benchmarks/steps_3_5.py [--repeat 10]

Builds a real venv from scripts/runtime.lock in a temp folder (from the uv cache once it is warm),
then times the three steps' current-checks in-process (target <= 0.3 s together) and the
libcuda.so.1 stub generation, each next to its baseline measured in the same run.
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

from timing import median_time, timed  # noqa: E402,F401 - benchmarks/timing.py

from rig import config, cudastub, venvs  # noqa: E402
from rig.steps import pipeline  # noqa: E402
from rig.steps.runtime import RuntimeStep, read_lock  # noqa: E402
from rig.steps.toolchain import ToolchainStep  # noqa: E402
from rig.steps.venv import VenvStep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-35-"))
    try:
        env = {**os.environ, "VENV_DIR": str(tmp / ".venv"), "RIG_STATE": str(tmp / "state")}
        s = config.settings(env)
        steps = [VenvStep(), RuntimeStep(), ToolchainStep()]
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            pipeline.run(steps, s, pipeline.Options())
        first = time.perf_counter() - t0
        def checks() -> None:
            ctx = pipeline.context(s)  # read as a real run reads it: the record once, then every check
            for st in steps:
                assert st.check(ctx).current, st.name

        ctx = pipeline.context(s)
        uv = ctx.uv
        py = str(s.venv_dir / "bin" / "python")
        baseline = median_time(lambda: subprocess.run([uv, "pip", "list", "--python", py], check=True,
                                                      capture_output=True), a.repeat)
        rerun = median_time(checks, a.repeat)
        size = sum(f.stat().st_size for f in venvs.site_packages(s.venv_dir).rglob("*")
                   if f.is_file() and not f.is_symlink())
        pins = len(read_lock(s.runtime_lock).pins)
        print(f"venv from the lock: {pins} pins, {size / 1e9:.2f} GB in the venv, first build {first:.1f} s")
        print(f"steps 3-5 re-run on a current venv, in-process, median of {a.repeat}: {rerun:.3f} s"
              f"  | uv pip list: {baseline:.3f} s  | ratio {rerun / baseline:.2f}x  | target <= 0.3 s")
        cuda_h = Path(ctx.record.toolchain.cuda_home) / "include" / "cuda.h"
        out = tmp / "stub"
        gen = median_time(lambda: cudastub.build(cuda_h, out), 5)
        cc = median_time(lambda: subprocess.run(["cc", "-x", "c", "-shared", "-o", str(tmp / "empty.so"), "-"],
                                                input=b"int x;", check=True), 5)
        n = len(cudastub.entry_points(cuda_h))
        print(f"driver stub from {cuda_h.parent.parent.name}'s cuda.h: {n} entry points,"
              f" {(out / 'libcuda.so.1').stat().st_size / 1024:.0f} KB, median of 5: {gen:.3f} s"
              f"  | cc of an empty shared library: {cc:.3f} s  | ratio {gen / cc:.1f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
