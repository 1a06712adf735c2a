"""Step 3, venv: ``.venv/`` with CPython 3.13, through uv when it is there.

CPython 3.13 is looked for in this order: ``PYTHON`` / ``UV_PYTHON``, uv's own
discovery, ``python3.13`` on PATH, then pyenv's installed versions (uv does
not look there, and it cannot download Pythons on a closed network).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from rig.base import atomic, venvs
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.venvs import WANT, WANT_TEXT
from rig.build import bundle
from rig.build.steps.base import Context, Status, Step
from rig.facts import record
from rig.facts.config import Settings

INSTALL_HINT = ("install CPython 3.13 (pyenv install 3.13, or apt-get install python3.13) "
                "or point PYTHON at one")


# The interpreter a venv stands on, not the venv's own ``bin/python``: a venv is never a base for another.
PROBE = ("import sys; exe = sys.executable if sys.prefix == sys.base_prefix else "
         "getattr(sys, '_base_executable', sys.executable); print(*sys.version_info[:2], exe)")


def probe(python: str) -> tuple[tuple[int, int], str] | None:
    """(major, minor) and the base interpreter of ``python`` (itself unless it is a venv's), or None."""
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = r.stdout.split()
    if r.returncode != 0 or len(parts) != 3:
        return None
    return (int(parts[0]), int(parts[1])), parts[2]


def pyenv_pythons(root: str | None) -> list[Path]:
    """pyenv's installed 3.13 interpreters under ``root`` (PYENV_ROOT; None: ``pyenv root``, else ~/.pyenv),
    newest first."""
    if not root and shutil.which("pyenv"):
        r = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        root = r.stdout.strip() if r.returncode == 0 else None
    root = root or str(Path.home() / ".pyenv")
    found = []
    for d in Path(root, "versions").glob(f"{WANT_TEXT}*"):
        exe = d / "bin" / f"python{WANT_TEXT}"
        if re.fullmatch(r"3\.13(\.\d+)?", d.name) and exe.exists():
            found.append(exe)
    return sorted(found, key=lambda p: [int(x) for x in p.parent.parent.name.split(".")], reverse=True)


def _seed_from_bundle(s: Settings) -> list[str]:
    """uv's switches to seed pip from the offline bundle's wheels: a box with no network has no uv cache to take
    it from. A bundle written before it carried pip is named, with the fix, before the venv is touched."""
    w = bundle.wheels(s)
    if w is None:
        return []
    if not list(w.glob("pip-*.whl")):
        raise BadInput(problem(f"pip's wheel in {w} (OFFLINE={s.offline})", "one (uv seeds the venv with pip)",
                               "none: the bundle was written before it carried pip",
                               "write the bundle again: scripts/nox.sh -s pack -- --offline DIR"))
    return bundle.uv_args(s)


def _inside(path: str, folder: Path) -> bool:
    """Whether ``path`` lies in ``folder`` (links resolved on both sides)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def find_python(s: Settings, uv: str | None) -> tuple[str, str]:
    """A CPython 3.13 executable and how it was found; never one inside the venv about to be replaced."""
    exe, how = _find_python(s, uv)
    if _inside(exe, s.venv_dir):
        raise BadInput(problem(f"the Python for {s.venv_dir} (found by {how})", "an interpreter outside that venv",
                               exe, f"point PYTHON at a python{WANT_TEXT} that is not in {s.venv_dir}"))
    return exe, how


def _find_python(s: Settings, uv: str | None) -> tuple[str, str]:
    if s.python:
        exe = s.python if os.sep in s.python else (shutil.which(s.python) or s.python)
        got = probe(exe)
        if got is None and uv:
            r = subprocess.run([uv, "python", "find", s.python], capture_output=True, text=True)
            got = probe(r.stdout.strip()) if r.returncode == 0 else None
        if got is None or got[0] != WANT:
            found = "it does not run" if got is None else f"Python {got[0][0]}.{got[0][1]} ({got[1]})"
            raise BadInput(problem(f"PYTHON/UV_PYTHON={s.python}", f"a CPython {WANT_TEXT}", found,
                                   f"point PYTHON at a python{WANT_TEXT}, or unset it to search"))
        return got[1], f"PYTHON/UV_PYTHON={s.python}"
    if uv:
        r = subprocess.run([uv, "python", "find", "--system", "--no-python-downloads", WANT_TEXT],
                           capture_output=True, text=True)
        got = probe(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None
        if got and got[0] == WANT:
            return got[1], "uv python find"
    which = shutil.which(f"python{WANT_TEXT}")
    if which and (got := probe(which)) and got[0] == WANT:
        return got[1], f"python{WANT_TEXT} on PATH"
    for exe in pyenv_pythons(s.pyenv_root):
        got = probe(str(exe))
        if got and got[0] == WANT:
            return got[1], "pyenv's versions"
    raise BadInput(problem("CPython 3.13", "one of PYTHON/UV_PYTHON, uv's discovery, python3.13 on PATH, "
                           "pyenv's versions", "none", INSTALL_HINT))


#: What ``TORCH=host`` needs to know of ``PYTHON``, read without importing torch: its minor, the interpreter a venv
#: stands on, its site folders (a venv's own too) and its torch.
HOST_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json, site, sys\n"
    "base = sys.executable if sys.prefix == sys.base_prefix else getattr(sys, '_base_executable', sys.executable)\n"
    "spec = u.find_spec('torch')\n"
    "try:\n    v = m.version('torch')\nexcept m.PackageNotFoundError:\n    v = None\n"
    "print(json.dumps({'minor': list(sys.version_info[:2]), 'base': base, 'sites': site.getsitepackages(),\n"
    "                  'torch': v, 'where': spec.origin if spec else None}))\n"
)
#: The CPython minors vLLM v0.30.0 supports: ``TORCH=host`` takes the host's, whichever of these it is.
HOST_MINORS = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))


def host_python(s: Settings) -> dict:
    """``TORCH=host``: what :data:`HOST_PROBE` says of ``PYTHON``; refused without PYTHON, a supported minor, or
    torch."""
    if not s.python:
        raise BadInput(problem("PYTHON (TORCH=host)", "the interpreter whose torch the venv stands on", "unset",
                               "set PYTHON to that interpreter (for example PYTHON=/opt/torch/.venv/bin/python3), "
                               "or unset TORCH for the lock's torch"))
    exe = s.python if os.sep in s.python else (shutil.which(s.python) or s.python)
    try:
        r = subprocess.run([exe, "-c", HOST_PROBE], capture_output=True, text=True, timeout=60)
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        got = None
    if got is None:
        raise BadInput(problem(f"PYTHON={s.python} (TORCH=host)", "a Python interpreter that runs", "it does not run",
                               "point PYTHON at the interpreter whose torch to use"))
    minor = tuple(got["minor"])
    if minor not in HOST_MINORS:
        raise BadInput(problem(f"PYTHON={s.python} (TORCH=host)", "CPython " + ", ".join(
            f"{a}.{b}" for a, b in HOST_MINORS) + " (what vLLM 0.30.0 supports)", f"Python {minor[0]}.{minor[1]}",
            "point PYTHON at a supported interpreter with torch"))
    if not got["torch"] or not got["where"]:
        raise BadInput(problem(f"PYTHON={s.python} (TORCH=host)", "an interpreter with torch installed",
                               f"no torch in {', '.join(got['sites']) or 'its site folders'}",
                               "point PYTHON at the interpreter whose torch to use, or unset TORCH for the lock's"))
    got["exe"] = exe
    return got


def _pth(sites: list[str]) -> str:
    return "# The host interpreter's site folders (TORCH=host): written by the rig's venv step.\n" + \
        "".join(f"{d}\n" for d in sites)


def caches(s: Settings, uv: str | None) -> dict[str, str]:
    """The wheel caches of the current user, which the venv installs reuse."""
    out = {}
    if uv:
        r = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True)
        out["uv_cache"] = r.stdout.strip()
    out["pip_cache"] = s.pip_cache or str(Path.home() / ".cache" / "pip")
    return out


class VenvStep(Step):
    name = "venv"
    summary = "the serving venv: the lock's CPython, or the host's with TORCH=host (uv when present; UV=0 / UV=path)"
    facts = ("venv", "python")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        minor = venvs.minor(s.venv_dir)
        if not s.venv_dir.exists():
            return Status(False, f"{s.venv_dir} does not exist yet")
        if minor is None:
            return Status(False, f"{s.venv_dir} is broken (its interpreter or pyvenv.cfg is gone): replacing it")
        if s.torch == "host":
            host = host_python(s)
            want = (host["minor"][0], host["minor"][1])
            if minor != want:
                return Status(False, f"{s.venv_dir} has Python {minor[0]}.{minor[1]}, PYTHON is {want[0]}.{want[1]}: "
                                     "replacing it")
            pth = venvs.site_packages(s.venv_dir) / venvs.HOST_PTH
            if not pth.exists() or pth.read_text() != _pth(host["sites"]):
                return Status(False, f"{s.venv_dir} does not stand on PYTHON={s.python}'s torch: replacing it")
            return Status(True, f"{s.venv_dir} stands on torch {host['torch']} of {host['exe']}", self._outputs(ctx))
        if venvs.host_dirs(s.venv_dir):
            return Status(False, f"{s.venv_dir} stands on a host torch (TORCH=host), not the lock's: replacing it")
        if minor != WANT:
            return Status(False, f"{s.venv_dir} has Python {minor[0]}.{minor[1]}, not {WANT_TEXT}: replacing it")
        return Status(True, f"{s.venv_dir} has CPython {WANT_TEXT}", self._outputs(ctx))

    def describe(self, ctx: Context, outputs: record.Venv) -> list[str]:
        return [f"{k.replace('_', ' ')}: {v} (reused)" for k, v in caches(ctx.settings, ctx.uv).items()]

    def run(self, ctx: Context) -> record.Venv:
        s = ctx.settings
        host = host_python(s) if s.torch == "host" else None
        if host:
            python = host["base"]
            if _inside(python, s.venv_dir) or _inside(host["exe"], s.venv_dir):
                raise BadInput(problem(f"PYTHON={s.python} (TORCH=host)", f"an interpreter outside {s.venv_dir}",
                                       host["exe"], f"point PYTHON at the interpreter with torch, not {s.venv_dir}"))
            say(f"TORCH=host: torch {host['torch']} of {host['exe']} (Python {'.'.join(map(str, host['minor']))}); "
                f"the venv stands on it")
        else:
            python, how = find_python(s, ctx.uv)
            say(f"CPython {WANT_TEXT}: {python} (found by {how})")
        seed = _seed_from_bundle(s) if ctx.uv else []
        old = None
        if s.venv_dir.exists() or s.venv_dir.is_symlink():
            old = s.venv_dir.with_name(f"{s.venv_dir.name}.old-{int(time.time())}")
            os.replace(s.venv_dir, old)
        uv = ctx.uv
        try:
            if uv:
                say(f"creating {s.venv_dir} with {uv}")
                cmd = [uv, "venv", "--quiet", "--seed", *seed, "--python", python, str(s.venv_dir)]
            else:
                say(f"creating {s.venv_dir} with {python} -m venv ({'UV=0' if s.uv == '0' else 'no uv on PATH'})")
                cmd = [python, "-m", "venv", str(s.venv_dir)]
            if host:
                cmd.insert(-1, "--system-site-packages")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise WorkFailed(problem(" ".join(cmd), "exit 0", f"exit {r.returncode}: {r.stderr.strip()}",
                                         f"check the Python at {python}"))
            if host:
                atomic.write_text(venvs.site_packages(s.venv_dir) / venvs.HOST_PTH, _pth(host["sites"]))
        except BaseException:
            shutil.rmtree(s.venv_dir, ignore_errors=True)
            if old:
                os.replace(old, s.venv_dir)
            raise
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return self._outputs(ctx)

    def _outputs(self, ctx: Context) -> record.Venv:
        venv = ctx.settings.venv_dir
        return record.Venv(venv=str(venv), python=str(venvs.python(venv)), uv=ctx.uv or "")
