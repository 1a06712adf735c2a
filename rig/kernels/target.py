"""The one kernel target: what kernels this tree and venv need.

``nox -s pack`` writes it into the manifest, ``nox -s verify`` and the container's
verify check a tarball against it, and the container adopts kernels only for it.
Standard library only: the container build reads it before the rig's dependencies exist.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from pathlib import Path

from rig import venvs
from rig.config import Settings
from rig.errors import BadInput, problem
from rig.record import BuildRecord, path

#: The key of series.toml's [upstream] that pins the wheel each device's precompiled kernels come from.
WHEEL_PIN = {"cuda": "wheel_sha256", "cpu": "cpu_wheel_sha256"}

#: What to run when the record of steps 1-5 is missing.
FIRST = "./build.sh --only tools,tree,venv,runtime,toolchain"


@dataclass(frozen=True)
class Target:
    """The device, OPS_OBJ of the tree, the architectures wanted, the venv's CPython minor, torch's CUDA major
    (``none`` for the CPU kernels), torch. The device comes first: a tarball for the other device is refused
    naming it."""

    device: str
    ops_obj: str
    arch: str
    python: str
    cuda: str
    torch: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def _missing(item: str) -> BadInput:
    return BadInput(problem(item, "recorded", "none", f"run {FIRST} first"))


def of_build(s: Settings, rec: BuildRecord) -> Target:
    """The target of this tree (the build record) and venv, for ``ARCH``."""
    if rec.tree is None or not rec.tree.ops_obj:
        raise _missing(f"{path(s.state_dir, s.device)}: the tree step's ops_obj")
    if rec.toolchain is None or not rec.toolchain.torch_cuda:
        raise _missing(f"{path(s.state_dir, s.device)}: the toolchain step's torch_cuda")
    minor = venvs.minor(s.venv_dir)
    if minor is None:
        raise BadInput(problem(f"the venv {s.venv_dir}", "a venv with pyvenv.cfg", "none", f"run {FIRST} first"))
    torch = venvs.installed(s.venv_dir).get("torch")
    if torch is None:
        raise BadInput(problem(f"torch in {s.venv_dir}", "installed", "none", f"run {FIRST} first"))
    cpu = s.device == "cpu"
    return Target(device=s.device, ops_obj=rec.tree.ops_obj, arch=platform.machine() if cpu else s.arch,
                  python=f"{minor[0]}.{minor[1]}", cuda="none" if cpu else rec.toolchain.torch_cuda.split(".")[0],
                  torch=torch)


def expected(s: Settings, rec: BuildRecord) -> Path | None:
    """What a kernels tarball for this tree must hold, as a file ``verify --expect`` reads.

    The ops step's record of a build here, when it is for this tree's OPS_OBJ; else the precompiled route's
    list beside the series, when it was made from the wheel series.toml pins for this device; else None.
    """
    import tomllib

    from rig import products, verify

    own = s.vllm_dir / products.RECORD
    if rec.tree is not None and own.is_file():
        try:
            if tomllib.loads(own.read_text())["facts"]["ops_obj"] == rec.tree.ops_obj:
                return own
        except (tomllib.TOMLDecodeError, KeyError, TypeError):
            pass
    listed = verify.list_path(s.patches_dir, s.device)
    try:
        pin = tomllib.loads((s.patches_dir / "series.toml").read_text())["upstream"].get(WHEEL_PIN[s.device])
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return None
    return listed if pin and verify.list_header(listed).get("wheel_sha256") == pin else None
