"""The pip run that installs the patched tree editable into the venv, with its kernels.

One function for every caller: the ops step (either route), the install step's
reinstall, and the container's adoption of verified kernels (no extension built).
The compile is ``pip install -v`` with MAX_JOBS, TORCH_CUDA_ARCH_LIST=ARCH,
NVCC_THREADS and ccache as the compiler launcher; every compiler line is shown,
the whole output goes to ``build-<timestamp>.log``, and a status line appears
every STATUS_INTERVAL.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
from pathlib import Path

from rig.base import proc, venvs
from rig.base.console import say
from rig.base.errors import WorkFailed, problem
from rig.base.gitutil import Git
from rig.facts.config import Settings
from rig.facts.record import BuildRecord

# Lines of a compile that name the source file being compiled.
COMPILING = re.compile(r"(?:Building (?:CXX|C|CUDA) object \S+?|\s-c\s+)(\S+\.(?:cu|cpp|cc|c|cxx))(?:\.o)?\b")
ERROR_LINE = re.compile(r"(?:\berror\b[:\s]|: fatal error|CMake Error)", re.I)

def build_env(s: Settings, rec: BuildRecord, route: str, version: str, wheel: Path | None) -> dict[str, str]:
    """The environment of the pip run: version pinned, route switches, compile controls.

    ``route``: ``precompiled`` (the kernels of ``wheel``), ``compile``, or ``none`` (the kernels are in the
    tree already: no extension is built and nothing is copied over them).
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_USE_PRECOMPILED", "VLLM_PRECOMPILED_", "PIP_CONSTRAINT"))}
    path = [str(s.venv_dir / "bin")]
    tools = rec.tools
    for tool in (tools.cmake, tools.ninja, tools.ccache) if tools else ():
        if tool:
            path.append(str(Path(tool).parent))
    env.update({
        "PATH": os.pathsep.join(dict.fromkeys(path + env.get("PATH", "").split(os.pathsep))),
        "VIRTUAL_ENV": str(s.venv_dir),
        # setuptools-scm would invent 0.1.devN for a tree whose git tag it cannot use.
        "VLLM_VERSION_OVERRIDE": version, "SETUPTOOLS_SCM_PRETEND_VERSION": version,
        "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    if route == "precompiled":
        env.update({"VLLM_USE_PRECOMPILED": "1", "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel)})
        return env
    if route == "none":
        env["VLLM_TARGET_DEVICE"] = "empty"  # vLLM's setup.py then builds no extension...
        # ...but setuptools-rust still builds the Rust frontend wherever a rustc is on PATH: hide it
        env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep) if d and not
                                      os.access(os.path.join(d, "rustc"), os.X_OK))
        return env
    if s.device == "cpu":
        env.update({"VLLM_TARGET_DEVICE": "cpu", "MAX_JOBS": str(s.max_jobs)})
        return env
    env.update({
        "MAX_JOBS": str(s.max_jobs), "NVCC_THREADS": str(s.nvcc_threads), "TORCH_CUDA_ARCH_LIST": s.arch,
        "VLLM_DISABLE_SCCACHE": "1",  # setup.py prefers sccache; the rig's launcher is ccache
    })
    tc = rec.toolchain
    if tc and tc.cuda_home:
        env["CUDA_HOME"] = tc.cuda_home
    if tc and tc.cuda_stub:
        stub = Path(tc.cuda_stub).with_name("libcuda.so")
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} -DCUDA_cuda_driver_LIBRARY={stub}".strip()
    if s.ccache_dir:
        env["CCACHE_DIR"] = s.ccache_dir
    return env


def ccache_counts(ccache: str | None) -> tuple[int, int] | None:
    """(hits, misses) from ccache's statistics, or None without ccache."""
    if not ccache:
        return None
    r = subprocess.run([ccache, "--print-stats"], capture_output=True, text=True)
    stats = dict(line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line)
    num = lambda k: int(stats.get(k, "0") or 0)  # noqa: E731
    return num("direct_cache_hit") + num("preprocessed_cache_hit"), num("cache_miss")


def log_path(s: Settings) -> Path:
    s.build_log_dir.mkdir(parents=True, exist_ok=True)
    return s.build_log_dir / f"build-{dt.datetime.now():%Y%m%d-%H%M%S}.log"


def install(s: Settings, rec: BuildRecord, route: str, version: str, wheel: Path | None, what: str) -> Path:
    """``pip install -v -e`` of the tree for ``route``; the log path. Exit 1 with the first error on failure."""
    env = build_env(s, rec, route, version, wheel)
    cmd = [str(venvs.python(s.venv_dir)), "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
           "--no-cache-dir", "-e", str(s.vllm_dir)]
    ccache = (rec.tools.ccache if rec.tools else "") or None
    before = ccache_counts(ccache)
    log = log_path(s)
    say(f"{what}: {' '.join(cmd[2:])}")
    say(f"full output: {log}")
    if route == "compile":
        say(f"MAX_JOBS={env['MAX_JOBS']} NVCC_THREADS={env['NVCC_THREADS']} TORCH_CUDA_ARCH_LIST={s.arch} "
            f"ccache={'on' if ccache else 'off'}")

    def status(elapsed: float, tail: list[str]) -> str:
        last = next((m[1] for line in reversed(tail) if (m := COMPILING.search(line))), "none yet")
        last = last.removeprefix(f"{s.vllm_dir}/")
        counts = ccache_counts(ccache)
        cc = (f", ccache {counts[0] - before[0]} hit(s) / {counts[1] - before[1]} miss(es) so far"
              if counts and before else "")
        return f"[{what}] {int(elapsed) // 60}m{int(elapsed) % 60:02d}s, last compiled: {last}{cc}"

    try:
        with open(log, "w") as fh:
            fh.write(f"# {' '.join(cmd)}\n# route: {route}\n")
            code, tail = proc.watch(cmd, status=status, interval=s.status_interval, env=env, log=fh,
                                    cwd=s.vllm_dir)
    finally:
        restore_version_file(s.vllm_dir)
    if code != 0:
        text = log.read_text(errors="replace").splitlines()
        first = next((ln.strip() for ln in text if ERROR_LINE.search(ln) and not ln.startswith("#")), tail[-1:])
        raise WorkFailed(problem(f"the {what} (pip install -v)", "exit 0", f"exit {code}. First error: {first}. "
                                 f"Full log: {log}", "fix the error (a patch under csrc/ breaks the compile?) and "
                                 "run ./build.sh again"))
    after = ccache_counts(ccache)
    if after and before:
        say(f"ccache: {after[0] - before[0]} hit(s), {after[1] - before[1]} miss(es) in this run")
    return log


def restore_version_file(vllm_dir: Path) -> None:
    """setup.py rewrites the tracked ``vllm/_version.py``; put it back, whatever became of the run.

    Otherwise a failed or killed install leaves a change the tree step refuses as a local edit.
    """
    repo = Git(vllm_dir)
    if "vllm/_version.py" in repo.tracked_changes():
        repo.run("checkout", "--", "vllm/_version.py")
