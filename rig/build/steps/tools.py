"""Step 1, tools: report and check what the build needs.

git, cc and c++ are required (exit 2 with the install command when missing).
cmake >= 3.26 and ninja come from PyPI into ``.rig/tools/`` when the system's
are missing or too old (Debian 12 ships cmake 3.25). uv, ccache and cargo 1.95
are optional; the step says what their absence costs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rig.base import cpuinfo
from rig.base.console import say, warn
from rig.base.errors import BadInput, WorkFailed, problem
from rig.build.steps.base import Context, Status, Step
from rig.facts import record
from rig.facts.config import Settings

CMAKE_MIN = (3, 26)
RUST_CHANNEL = (1, 95)  # vLLM v0.30.0's rust-toolchain.toml
REQUIRED = {  # tool: install command on Debian/Ubuntu
    "git": "apt-get install -y git",
    "cc": "apt-get install -y build-essential",
    "c++": "apt-get install -y build-essential",
}


@dataclass
class Tool:
    name: str
    path: str | None
    version: tuple[int, ...] | None
    text: str  # the version as the tool prints it


def _probe(name: str, path: str | None, args: tuple[str, ...] = ("--version",)) -> Tool:
    if not path:
        return Tool(name, None, None, "not found")
    try:
        out = subprocess.run([path, *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Tool(name, None, None, f"does not run ({exc})")
    first = out.strip().splitlines()[0] if out.strip() else ""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", first)
    ver = tuple(int(x) for x in m.groups() if x is not None) if m else None
    return Tool(name, path, ver, first)


def tools_dir(s: Settings) -> Path:
    """Where cmake and ninja from PyPI live when the system's will not do."""
    return s.state_dir / "tools"


def detect(s: Settings, uv: str | None) -> dict[str, Tool]:
    """Find every tool, preferring ``.rig/tools/bin`` for cmake and ninja."""
    local = tools_dir(s) / "bin"
    found = {n: _probe(n, shutil.which(n)) for n in ("git", "cc", "c++")}
    for n in ("cmake", "ninja"):
        sys_tool = _probe(n, shutil.which(n))
        ok = sys_tool.version is not None and (n != "cmake" or sys_tool.version >= CMAKE_MIN)
        found[n] = sys_tool if ok or not (local / n).exists() else _probe(n, str(local / n))
    found["uv"] = _probe("uv", uv) if uv else Tool("uv", None, None, "refused (UV=0)" if s.uv else "not found")
    found["ccache"] = _probe("ccache", shutil.which("ccache"))
    found["cargo"] = _probe("cargo", shutil.which("cargo"))
    return found


def missing(found: dict[str, Tool]) -> list[str]:
    """Reasons the build cannot go on with these tools (cmake/ninja fixable by run)."""
    out = [n for n in REQUIRED if found[n].path is None]
    cm = found["cmake"]
    if cm.version is None or cm.version < CMAKE_MIN:
        out.append("cmake")
    if found["ninja"].version is None:
        out.append("ninja")
    return out


def ccache_dir(found: dict[str, Tool]) -> str | None:
    if not found["ccache"].path:
        return None
    r = subprocess.run([found["ccache"].path, "--get-config", "cache_dir"], capture_output=True, text=True)
    return r.stdout.strip() or None


def _stamp(path: str | None) -> str:
    if not path:
        return "-"
    try:
        st = os.stat(path)
    except OSError:
        return "gone"
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def fingerprint(s: Settings, uv: str | None) -> str:
    """Which files :func:`detect` would look at, by path, size and mtime, without running any of them.

    A re-run that finds the same files need not ask their versions again.
    """
    local = tools_dir(s) / "bin"
    stamps = [f"{n}={_stamp(shutil.which(n))}" for n in ("git", "cc", "c++", "ccache", "cargo", "cmake", "ninja")]
    stamps += [f"local-{n}={_stamp(str(local / n))}" for n in ("cmake", "ninja")]
    stamps += [f"uv={_stamp(uv)}", f"CCACHE_DIR={s.ccache_dir or ''}"]
    return "|".join(stamps)


def cpu_problem(flags: list[str]) -> str | None:
    """Why a CPU with ``flags`` cannot run vLLM's CPU kernels (they need AVX2 at least), or None."""
    if "avx2" in flags:
        return None
    return problem("the CPU (DEVICE=cpu)", "the avx2 flag in /proc/cpuinfo (vLLM's CPU kernels need AVX2 at "
                   "least; AVX512 is used where present)", f"{len(flags)} flags without avx2",
                   "build for the CPU on an x86-64 machine with AVX2, or use DEVICE=cuda")


def check_cpu(s: Settings) -> None:
    if s.device == "cpu" and (why := cpu_problem(cpuinfo.flags())):
        raise BadInput(why)


class ToolsStep(Step):
    name = "tools"
    summary = "cmake >= 3.26, ninja, cc/c++, git, uv, ccache, cargo 1.95 (optional)"
    facts = ("cmake", "ninja", "ccache_dir")

    def check(self, ctx: Context) -> Status:
        check_cpu(ctx.settings)
        rec = ctx.record.tools
        if rec is None:
            return Status(False, "not looked for yet")
        if rec.fingerprint != fingerprint(ctx.settings, ctx.uv):
            return Status(False, "the tools on PATH (or CCACHE_DIR, or UV) changed since the last run")
        return Status(True, "every tool found (the same files as last time)", rec)

    def describe(self, ctx: Context, outputs: record.Tools) -> list[str]:
        lines = [f"cmake {outputs.cmake_version.split()[-1]} ({outputs.cmake}), ninja {outputs.ninja}"]
        if outputs.ccache_dir:
            lines.append(f"ccache directory: {outputs.ccache_dir} (CCACHE_DIR moves it)")
        return lines

    def run(self, ctx: Context) -> record.Tools:
        s = ctx.settings
        check_cpu(s)
        found = detect(s, ctx.uv)
        for n, fix in REQUIRED.items():
            if found[n].path is None:
                raise BadInput(problem(f"the build tool {n}", "on PATH", found[n].text, fix))
        if "cmake" in missing(found) or "ninja" in missing(found):
            self._install_cmake_ninja(s, found)
            found = detect(s, ctx.uv)
            gone = missing(found)
            if gone:
                raise WorkFailed(problem(f"cmake and ninja from PyPI in {tools_dir(s)}", "both working",
                                         f"{', '.join(gone)} not", f"rm -rf {tools_dir(s)} and run again, or "
                                         "apt-get install -y cmake ninja-build"))
        return self._report(s, ctx.uv, found)

    def _install_cmake_ninja(self, s: Settings, found: dict[str, Tool]) -> None:
        cm = found["cmake"]
        say(f"system cmake: {cm.text}; cmake >= {'.'.join(map(str, CMAKE_MIN))} and ninja come from PyPI "
            f"into {tools_dir(s)}")
        d = tools_dir(s)
        uv = found["uv"].path
        try:
            if uv:
                subprocess.run([uv, "venv", "--quiet", "--allow-existing", "--python", sys.executable, str(d)],
                               check=True)
                subprocess.run([uv, "pip", "install", "--quiet", "--python", str(d / "bin" / "python"),
                                "cmake>=3.26", "ninja"], check=True)
            else:
                subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
                subprocess.run([str(d / "bin" / "pip"), "install", "--quiet", "cmake>=3.26", "ninja"], check=True)
        except subprocess.CalledProcessError as exc:
            raise WorkFailed(problem(f"the install of cmake and ninja from PyPI into {d}", "exit 0", f"{exc}",
                                     "check the network, or install them: pip install 'cmake>=3.26' ninja")
                             ) from None

    def _report(self, s: Settings, uv: str | None, found: dict[str, Tool]) -> record.Tools:
        for t in found.values():
            say(f"{t.name:7} {t.text:45.45} {t.path or ''}")
        cdir = ccache_dir(found)
        if not cdir:
            warn("ccache not found: every kernel compiles from scratch. Fix: apt-get install -y ccache")
        cargo = found["cargo"]
        rust = cargo.version is not None and cargo.version[:2] == RUST_CHANNEL
        if not rust:
            say(f"cargo {'.'.join(map(str, RUST_CHANNEL))} {'not found' if not cargo.path else 'not the version'}: "
                "the Rust frontend is skipped, the Python tool parsers are used")
        return record.Tools(
            fingerprint=fingerprint(s, uv), git=found["git"].path or "", cc=found["cc"].path or "",
            cxx=found["c++"].path or "", cmake=found["cmake"].path or "", cmake_version=found["cmake"].text,
            ninja=found["ninja"].path or "", uv=found["uv"].path or "", ccache=found["ccache"].path or "",
            ccache_dir=cdir or "", cargo=(cargo.path or "") if rust else "")
