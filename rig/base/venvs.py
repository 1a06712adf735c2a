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


#: Written into the serving venv by the venv step with ``TORCH=host``: the host interpreter's site folders, one a line,
#: so the venv sees its torch even where that interpreter is itself a venv (``--system-site-packages`` reaches only
#: the base interpreter's folders).
HOST_PTH = "_rig_host_torch.pth"
#: The torch family ``TORCH=host`` takes from the host: the lock installs everything else into the venv.
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "triton"})


def torch_family(name: str) -> bool:
    """Whether a pin belongs to the torch family: torch and its companions, and the CUDA wheels (``nvidia-*``, the
    NVML bindings aside, which are no CUDA library) torch brings."""
    return name in TORCH_FAMILY or (name.startswith("nvidia-") and name != "nvidia-ml-py")


def site_packages(venv: Path) -> Path:
    """The venv's own site-packages, for the Python minor it was made with (3.13 unless ``TORCH=host``)."""
    m = minor(venv)
    return Path(venv) / "lib" / (f"python{m[0]}.{m[1]}" if m else f"python{WANT_TEXT}") / "site-packages"


def host_dirs(venv: Path) -> list[Path]:
    """The host interpreter's site folders the venv stands on (``TORCH=host``), from :data:`HOST_PTH`; [] else."""
    try:
        text = (site_packages(venv) / HOST_PTH).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [Path(line) for line in text.splitlines() if line.strip() and not line.startswith(("#", "import "))]


def _torch_dir(venv: Path) -> Path | None:
    """Where the venv's torch lives: its own site-packages, else the host's."""
    for d in (site_packages(venv), *host_dirs(venv)):
        if (d / "torch" / "version.py").exists():
            return d
    return None


HOST = "host "  # how torch_version() marks a torch the host provides


def torch_route(torch: str) -> str:
    """``host`` or ``pinned``: the route a recorded torch (:func:`torch_version`) came by."""
    return "host" if torch.startswith(HOST) else "pinned"


def torch_version(venv: Path) -> str | None:
    """torch as the build records it: ``2.13.0`` in the venv, ``host 2.11.0+cu130`` from the host (the CUDA
    version added where the host's version carries no local part), None without torch."""
    for d in (site_packages(venv), *host_dirs(venv)):
        infos = sorted(d.glob("torch-*.dist-info"))
        if not infos:
            continue
        version = infos[-1].name[len("torch-"):-len(".dist-info")]
        if d == site_packages(venv):
            return version
        cuda = torch_cuda(venv)
        return f"{HOST}{version}" + (f"+cu{cuda.replace('.', '')}" if "+" not in version and cuda else "")
    return None


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
    d = _torch_dir(venv)
    if d is None:
        return None
    text = (d / "torch" / "version.py").read_text()
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


def borrow_bytecode(src: Path, dst: Path) -> int:
    """Hard-link ``src``'s bytecode into ``dst`` for each module whose source file is the very same file in both
    (one inode: uv links both venvs' files from its cache); the number linked. A new build's import check then
    compiles only what changed, not the few thousand modules of torch and vLLM's dependencies again. Python
    still checks each bytecode file against its source before it uses it, and names the importing venv's file
    in its code objects; a rewrite replaces a file (a new inode), never the shared one. Where uv copied instead
    of linking, nothing is borrowed and the check compiles as before."""
    src_sp, dst_sp = site_packages(src), site_packages(dst)
    linked = 0
    for cache in src_sp.rglob("__pycache__"):
        rel = cache.parent.relative_to(src_sp)
        if not (dst_sp / rel).is_dir():
            continue
        for pyc in cache.glob("*.pyc"):
            name = pyc.name.split(".", 1)[0] + ".py"
            out = dst_sp / rel / "__pycache__" / pyc.name
            try:
                a, b = (src_sp / rel / name).stat(), (dst_sp / rel / name).stat()
                if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or out.exists():
                    continue
                out.parent.mkdir(exist_ok=True)
                os.link(pyc, out)
                linked += 1
            except OSError:  # a source file gone, another file system: that module is compiled as it would be
                continue
    return linked
