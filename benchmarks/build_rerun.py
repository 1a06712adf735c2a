# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""./build.sh on the real tree: a no-op re-run, and a rebuild after a Python-only patch.

  uv run benchmarks/build_rerun.py [--repeat 5] [--rig DIR] [--quick]

Works in a fresh copy of this repository (its own vllm/, .venv/; downloads come from the caches), or with
--rig DIR in that copy of the rig, already built (no copy, no first build): there (b)'s patch is taken out
again at the end and the tree rebuilt as it was. --quick: --repeat 1 (CI runs it so, on its built copy).
(a) no-op ./build.sh on a current tree, median of N, against `python -c 'import nox'` with the
    interpreter the wrapper runs nox with (target <= 1.0 s and <= 3x the baseline);
(b) a Python-only patch added to the series: the rebuild (--accept, then ./build.sh) and the number
    of compiler invocations during it, counted by cc/c++/gcc/g++/nvcc shims first on PATH (target
    <= 60 s, 0 invocations).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402 - benchmarks/timing.py

from rig.facts.uv import find as find_uv  # noqa: E402

COMPILERS = ("cc", "c++", "gcc", "g++", "nvcc", "clang", "clang++")
CLEAN = ("VLLM_DIR", "PATCHES_DIR", "RIG_STATE", "VENV_DIR", "RUNTIME_LOCK", "BUILD_LOG_DIR", "FETCH", "OPS_ROUTE")


def sh(cmd: list[str], cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r


def fresh_copy(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def nox_python(rig: Path, env: dict) -> str:
    """The interpreter the wrapper (scripts/nox.sh) runs nox with: the baseline of every no-op figure."""
    return sh([find_uv(rig, env), "python", "find", "--script", str(rig / "noxfile.py")], rig, env).stdout.strip()


def shims(d: Path, log: Path) -> None:
    d.mkdir()
    for name in COMPILERS:
        real = shutil.which(name)
        if real:
            # A version probe (the tools step asks `cc --version`) compiles nothing: not counted.
            (d / name).write_text(f'#!/bin/sh\ncase "$*" in --version|-v|-dumpversion) ;; '
                                  f'*) echo "{name} $*" >> {log};; esac\nexec {real} "$@"\n')
            (d / name).chmod(0o755)


def python_only_patch(rig: Path, tmp: Path, env: dict) -> list[Path]:
    """A Python-only patch, made as a user makes one: a commit in a worktree, git format-patch into the series."""
    wt = tmp / "wt"
    sh(["git", "-C", str(rig / "vllm"), "worktree", "add", "-q", "--detach", str(wt), "HEAD"], rig, env)
    target = wt / "vllm/entrypoints/serve/exposure.py"
    target.write_text(target.read_text() + "\n# benchmark: a Python-only change\n")
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    sh(["git", *ident, "commit", "-qam", "bench: a Python-only change"], wt, env)
    before = set((rig / "patches").glob("*.patch"))
    sh(["git", "format-patch", "-q", "--zero-commit", "--start-number", "90", "-o", str(rig / "patches"),
        "HEAD~1"], wt, env)
    sh(["git", "-C", str(rig / "vllm"), "worktree", "remove", "--force", str(wt)], rig, env)
    return sorted(set((rig / "patches").glob("*.patch")) - before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rig", type=Path, help="a built copy of the rig to work in (no fresh copy, no first build)")
    ap.add_argument("--quick", action="store_true", help="--repeat 1: the same code, in the least time")
    a = ap.parse_args()
    if a.quick:
        a.repeat = 1
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-build-"))
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    rig = a.rig.resolve() if a.rig else tmp / "rig"
    series_toml = rig / "patches" / "series.toml"
    saved, added = (series_toml.read_bytes() if a.rig else None), []
    try:
        if not a.rig:
            fresh_copy(rig)
            t0 = time.perf_counter()
            sh([str(rig / "build.sh"), "--no-pack"], rig, env)
            print(f"first ./build.sh of the fresh copy (warm caches): {time.perf_counter() - t0:.1f} s")
        py = nox_python(rig, env)
        base = median_time(lambda: sh([py, "-c", "import nox"], rig, env), a.repeat)
        noop = median_time(lambda: sh([str(rig / "build.sh"), "--no-pack"], rig, env), a.repeat)
        print(f"(a) no-op ./build.sh, median of {a.repeat}: {noop:.2f} s  | python -c 'import nox': {base:.2f} s"
              f"  | ratio {noop / base:.1f}x  | targets <= 1.0 s, <= 3x")

        added = python_only_patch(rig, tmp, env)
        log = tmp / "compilers.log"
        log.touch()
        shims(tmp / "shims", log)
        env_b = {**env, "PATH": f"{tmp / 'shims'}{os.pathsep}{env['PATH']}"}
        t0 = time.perf_counter()
        sh([str(rig / "build.sh"), "--only", "tree", "--accept"], rig, env_b)
        r = sh([str(rig / "build.sh"), "--no-pack"], rig, env_b)
        rebuild = time.perf_counter() - t0
        calls = len(log.read_text().splitlines())
        ops = next((ln.strip() for ln in r.stdout.splitlines() if "products for OPS_OBJ" in ln), "?")
        print(f"(b) Python-only patch: rebuild {rebuild:.1f} s (accept + build)  | compiler invocations: {calls}"
              f"  | the no-op above: {noop:.2f} s  | ratio {rebuild / noop:.0f}x the no-op  | targets <= 60 s, "
              "0 invocations")
        print(f"    ops step: {ops}")
    finally:
        if saved is not None:  # --rig: the copy is someone else's; its series and tree go back as they were
            for p in added:
                p.unlink(missing_ok=True)
            series_toml.write_bytes(saved)
            if added:
                t0 = time.perf_counter()
                sh([str(rig / "build.sh")], rig, env)
                print(f"    {rig}: the patch taken out, rebuilt as it was in {time.perf_counter() - t0:.1f} s")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
