"""The one kernel target: what kernels this tree and venv need, made in one place (:func:`of_build`).

The pack step writes its facts into the manifest, ``nox -s verify`` and the
container's verify check a tarball against it and install into its tree, and
the container adopts kernels only for it. Standard library only: the container
build reads it before the rig's dependencies exist.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

from rig.base import venvs
from rig.base.errors import BadInput, problem
from rig.build.kernels.expected import Expected, list_header, list_path, read_expected
from rig.facts import products, series
from rig.facts.config import Settings
from rig.facts.record import BuildRecord, path

#: What to run when the record of steps 1-5 is missing.
FIRST = "./build.sh --only tools,tree,venv,runtime,toolchain"
#: The facts a manifest records and a target needs, in the manifest's order.
FACTS = ("device", "ops_obj", "arch", "python", "cuda", "torch")


@dataclass(frozen=True)
class KernelTarget:
    """The device, OPS_OBJ of the tree, the architectures wanted, the venv's CPython minor, torch's CUDA major
    (``none`` for the CPU kernels) and torch; the route of the kernels built here (None where the ops step has
    not run, as in the container: its adopt checks the route); this tree's kernels, the set a tarball must
    hold (None when none is known); and the tree they go into. The device comes first: a tarball for the
    other device is refused naming it."""

    device: str
    ops_obj: str
    arch: str
    python: str
    cuda: str
    torch: str
    route: str | None
    listed: Path | None  # where this tree's kernels are listed (see ``expected``)
    vllm_dir: Path

    @functools.cached_property
    def expected(self) -> Expected | None:
        """This tree's kernels, read when a check needs them: a no-op build's pack check never does (the list
        of a build's 2,000 files is most of a no-op's time)."""
        return read_expected(self.listed) if self.listed else None

    def facts(self) -> dict[str, str]:
        """What a manifest records of the target, as :data:`FACTS` names them."""
        return {k: getattr(self, k) for k in FACTS}

    def checks(self) -> dict[str, str | None]:
        """What verify compares with a manifest: the facts and the route (None: not compared)."""
        return {**self.facts(), "route": self.route}


def _missing(item: str) -> BadInput:
    return BadInput(problem(item, "recorded", "none", f"run {FIRST} first"))


def of_build(s: Settings, rec: BuildRecord) -> KernelTarget:
    """The target of this tree (the build record) and venv, for ``ARCH``."""
    if rec.tree is None or not rec.tree.ops_obj:
        raise _missing(f"{path(s.record_dir, s.device)}: the tree step's ops_obj")
    cpu = s.device == "cpu"
    if rec.toolchain is None or not (cpu or rec.toolchain.torch_cuda):  # a CPU build's torch may have no CUDA
        raise _missing(f"{path(s.record_dir, s.device)}: the toolchain step's torch_cuda")
    minor = venvs.minor(s.venv_dir)
    if minor is None:
        raise BadInput(problem(f"the venv {s.venv_dir}", "a venv with pyvenv.cfg", "none", f"run {FIRST} first"))
    torch = venvs.torch_version(s.venv_dir)  # "host 2.11.0+cu130" on the TORCH=host route
    if torch is None:
        raise BadInput(problem(f"torch in {s.venv_dir}", "installed", "none", f"run {FIRST} first"))
    listed = _expected(s, rec)
    return KernelTarget(device=s.device, ops_obj=rec.tree.ops_obj, arch=platform.machine() if cpu else s.arch,
                        python=f"{minor[0]}.{minor[1]}",
                        cuda="none" if cpu else rec.toolchain.torch_cuda.split(".")[0], torch=torch,
                        route=rec.ops.route if rec.ops else None,
                        listed=listed, vllm_dir=s.vllm_dir)


def _expected(s: Settings, rec: BuildRecord) -> Path | None:
    """Where this tree's kernels are listed: the ops step's record of a build here, when it is for this tree's
    OPS_OBJ; else the precompiled route's list beside the series, when it was made from the wheel series.toml
    pins for this device; else None."""
    own = products.read(s.vllm_dir)
    if rec.tree is not None and own is not None and isinstance(own.facts, dict) \
            and own.facts.get("ops_obj") == rec.tree.ops_obj:
        return s.vllm_dir / products.RECORD
    listed = list_path(s.patches_dir, s.device)
    try:
        pin, _ = series.load(s.patches_dir).wheel_pin(s.device)
    except BadInput:  # no series.toml to trust: no list either (verify then checks names only)
        return None
    return listed if pin and list_header(listed).get("wheel_sha256") == pin else None
