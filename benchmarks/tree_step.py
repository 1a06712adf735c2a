# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""The tree step on the real vLLM v0.30.0 sdist tree, against `git write-tree` of the same tree.

  uv run benchmarks/tree_step.py [--patches 100] [--repeat 10] [--quick]

(a) re-run on a correct tree, in-process (target <= 0.3 s);
(b) applying a series of N small patches (target <= 10 s for 100).
Each figure is printed next to `git write-tree` on the same tree, measured in the same run.
The sdist comes from the rig's cache (RIG_CACHE; FETCH=0: any run of the real build or tests puts it there).
--quick: 3 patches, --repeat 1 (CI runs it so).
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

from rig.base.gitutil import Git  # noqa: E402
from rig.build.steps.pipeline import Options, context  # noqa: E402
from rig.build.steps.pipeline import run as run_steps  # noqa: E402
from rig.build.steps.tree import TreeStep  # noqa: E402
from rig.facts.config import settings  # noqa: E402


def quiet(fn):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn()


def make_series(vllm: Path, out: Path, n: int) -> None:
    """N one-line patches, each on its own Python file, made with git format-patch."""
    wt = out.parent / "wt"
    g = Git(vllm)
    g.run("worktree", "add", "--quiet", "--detach", str(wt), "v0.30.0")
    w = Git(wt)
    files = sorted(p for p in w.out("ls-files", "vllm/model_executor/models").splitlines() if p.endswith(".py"))[:n]
    for i, rel in enumerate(files, 1):
        with open(wt / rel, "a") as fh:
            fh.write(f"# benchmark patch {i}\n")
        w.run("commit", "--quiet", "-am", f"bench: patch {i}")
    w.run("format-patch", "--quiet", "--zero-commit", "-o", str(out), "v0.30.0")
    g.run("worktree", "remove", "--force", str(wt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patches", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 patches, --repeat 1: the same code, in seconds")
    a = ap.parse_args()
    if a.quick:
        a.patches, a.repeat = min(a.patches, 3), 1
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-tree-"))
    try:
        patches = tmp / "patches"
        patches.mkdir()
        shutil.copy(ROOT / "patches" / "series.toml", patches / "series.toml")
        env = {**os.environ, "VLLM_SOURCE": "sdist", "VLLM_DIR": str(tmp / "vllm"),
               "PATCHES_DIR": str(patches), "RIG_STATE": str(tmp / "state"), "FETCH": "0"}
        s = settings(env)
        opts = Options(accept=True)
        quiet(lambda: run_steps([TreeStep()], s, opts))  # the bare base, accepted
        vllm = tmp / "vllm"

        def write_tree() -> None:
            subprocess.run(["git", "write-tree"], cwd=vllm, check=True, capture_output=True)

        base_wt = median_time(write_tree, a.repeat)
        # a fresh context each time: the record, series.toml and the patches are read as a real run reads them
        rerun = median_time(lambda: TreeStep().check(context(s)), a.repeat)
        assert TreeStep().check(context(s)).current
        files = int(Git(vllm).out("ls-files", "--", ".").count("\n")) + 1
        print(f"real v0.30.0 sdist tree: {files} files")
        print(f"(a) re-run on a correct tree, in-process, median of {a.repeat}: {rerun:.3f} s"
              f"  | git write-tree: {base_wt:.3f} s  | ratio {rerun / base_wt:.1f}x  | target <= 0.3 s")

        make_series(vllm, patches, a.patches)
        t0 = time.perf_counter()
        quiet(lambda: run_steps([TreeStep()], s, opts))
        apply = time.perf_counter() - t0
        n = Git(vllm).out("rev-list", "--count", "v0.30.0..HEAD")
        base_wt2 = median_time(write_tree, a.repeat)
        print(f"(b) apply a series of {n} patches (scratch worktree, git am, land): {apply:.2f} s"
              f"  | git write-tree: {base_wt2:.3f} s  | ratio {apply / base_wt2:.0f}x  | target <= 10 s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
