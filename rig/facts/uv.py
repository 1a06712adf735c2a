"""Which uv the rig uses, resolved in this one place.

``resolve`` is the build's (once per run, by the pipeline's context): ``UV=/path`` names one (checked to be a
uv), ``UV=0`` refuses uv (the steps then use ``python -m venv`` and pip), and unset means the uv on PATH, if any.
``find`` is the wrappers' (``scripts/nox.sh``), for scripts that need a uv to run at all: the benchmarks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rig import REPO_ROOT
from rig.base.console import note
from rig.base.errors import BadInput, WorkFailed, problem
from rig.facts.config import Settings


def resolve(s: Settings) -> str | None:
    """The uv executable to use, or None (``UV=0``, or none on PATH)."""
    if s.uv == "0":
        return None
    if not s.uv:
        return shutil.which("uv")
    path = shutil.which(s.uv) or s.uv
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"does not run ({exc})"
    if not text.startswith("uv "):
        raise BadInput(problem(f"UV={s.uv}", "a uv executable (uv --version prints 'uv X.Y.Z')", repr(text),
                               "point UV at a uv, unset it to use the one on PATH, or set UV=0"))
    return path


def absent(s: Settings, why: str, command: str) -> BadInput:
    """The refusal of a ``command`` that needs uv and has none (``why``). With ``UV=0`` the fix is to unset it:
    the wrapper puts a uv on PATH but leaves ``UV=0`` as it is, so running it through the wrapper again would
    end the same way."""
    if s.uv == "0":
        return BadInput(problem("uv", f"on ({why})", "UV=0, which turns uv off",
                                f"unset UV (or point it at a uv), then {command} again"))
    return BadInput(problem("uv", f"on PATH ({why})", "not found",
                            f"run it as {command} (the wrapper brings the pinned uv), or point UV at a uv"))


def find(root: Path = REPO_ROOT, env: Mapping[str, str] | None = None) -> str:
    """The uv to run, found as ``scripts/nox.sh`` finds it (keep the two in step): ``UV`` unless empty or ``0``,
    then ``uv`` on PATH, then the rig's own ``<root>/.rig/uv/uv``; where none is there, the pinned one is fetched
    into that folder with ``python3 scripts/bootstrap_uv.py`` (the standard library alone), which prints its path.
    """
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    chosen = env.get("UV", "")
    if chosen not in ("", "0"):
        return shutil.which(chosen, path=path) or chosen
    on_path = shutil.which("uv", path=path)
    if on_path:
        return on_path
    own = Path(root) / ".rig" / "uv" / "uv"
    if os.access(own, os.X_OK) and own.is_file():
        return str(own)
    python = shutil.which("python3", path=path) or sys.executable
    try:
        r = subprocess.run([python, str(Path(root) / "scripts" / "bootstrap_uv.py"), str(own.parent)],
                           capture_output=True, text=True, env=dict(env), timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkFailed(problem(f"uv for {root}", f"the pinned uv fetched into {own.parent}", str(exc),
                                 "put uv on PATH or set UV=/path/to/uv")) from None
    found = r.stdout.strip().splitlines()
    if r.returncode != 0 or not found:
        message = r.stderr.strip().removeprefix("error: ") or f"scripts/bootstrap_uv.py exited {r.returncode}"
        raise (BadInput if r.returncode == 2 else WorkFailed)(message)
    if r.stderr.strip():
        note(r.stderr.rstrip())  # its one line: uv not found, fetching it (and where to)
    return found[-1]
