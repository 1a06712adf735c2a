"""Which uv the rig uses, resolved in this one place (once per run, by the pipeline's context).

``UV=/path`` names one (checked to be a uv), ``UV=0`` refuses uv (the steps then use
``python -m venv`` and pip), and unset means the uv on PATH, if any.
"""

from __future__ import annotations

import shutil
import subprocess

from rig.config import Settings
from rig.errors import BadInput, problem


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
