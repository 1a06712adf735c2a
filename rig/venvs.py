"""Facts about the serving venv, read from its files without starting its Python.

Standard library only: the container's ``fact``/``target`` commands read these
before the rig's dependencies are installed, and every step that asks "which
torch, which CPython" reads them the same way.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: The CPython minor the serving venv is built on (vLLM v0.30.0 supports 3.10-3.14; the series targets 3.13).
WANT = (3, 13)
WANT_TEXT = "3.13"


def python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def site_packages(venv: Path) -> Path:
    return Path(venv) / "lib" / f"python{WANT_TEXT}" / "site-packages"


def minor(venv: Path) -> tuple[int, int] | None:
    """The venv's Python minor from pyvenv.cfg (uv writes ``version_info``, ``python -m venv`` ``version``);
    None when the file or the interpreter is gone."""
    try:
        cfg = (Path(venv) / "pyvenv.cfg").read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    m = re.search(r"^(?:version|version_info)\s*=\s*(\d+)\.(\d+)", cfg, re.M)
    if not m or not os.path.exists(python(venv)):  # exists() follows the link: gone means broken
        return None
    return int(m[1]), int(m[2])


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(venv: Path) -> dict[str, str]:
    """name -> version of every distribution in the venv, read from its .dist-info folders."""
    sp = site_packages(venv)
    if not sp.is_dir():
        return {}
    out = {}
    for d in sp.glob("*.dist-info"):
        name, _, version = d.name[: -len(".dist-info")].partition("-")
        out[norm(name)] = version
    return out


def damaged(venv: Path) -> dict[str, str]:
    """name -> the first file its RECORD lists that is missing: what an install cut short leaves behind (the
    .dist-info folder is there, so the name counts as installed, but files of the package are not)."""
    import csv  # only a damaged-install check needs it; the container reads this module at every step

    sp = site_packages(venv)
    out: dict[str, str] = {}
    for d in sorted(sp.glob("*.dist-info")) if sp.is_dir() else []:
        name = norm(d.name[: -len(".dist-info")].partition("-")[0])
        try:
            rows = list(csv.reader((d / "RECORD").read_text().splitlines()))
        except OSError:
            out[name] = f"{d.name}/RECORD"
            continue
        for row in rows:
            if row and row[0] and not os.path.lexists(sp / row[0]):
                out[name] = row[0]
                break
    return out


def torch_cuda(venv: Path) -> str | None:
    """The CUDA version torch in the venv was built for, read from torch/version.py (no import)."""
    try:
        text = (site_packages(venv) / "torch" / "version.py").read_text()
    except FileNotFoundError:
        return None
    m = re.search(r"^cuda(?::[^=]*)?=\s*['\"](\d+\.\d+)['\"]", text, re.M)
    return m[1] if m else None


def installed_vllm(venv: Path, tree: Path) -> tuple[str | None, str]:
    """The installed vllm's version and what is wrong with it ('' when it is ``tree``'s editable install)."""
    sp = site_packages(venv)
    infos = sorted(sp.glob("vllm-*.dist-info")) if sp.is_dir() else []
    if not infos:
        return None, "vllm is not installed in the venv"
    info = infos[-1]
    version = info.name[len("vllm-"):-len(".dist-info")]
    try:
        direct = json.loads((info / "direct_url.json").read_text())
    except (FileNotFoundError, ValueError):
        return version, f"vllm {version} in the venv is not the rig's install (no direct_url.json)"
    url = direct.get("url", "")
    if not direct.get("dir_info", {}).get("editable"):
        return version, f"vllm {version} in the venv is a plain install from {url or 'an index'}, not this tree"
    if url != Path(tree).resolve().as_uri():
        return version, f"vllm in the venv is installed from {url}, not {Path(tree).resolve().as_uri()}"
    return version, ""
