"""Step 5, toolchain: the CUDA toolkit matching torch's CUDA major, and the driver stub.

The toolkit is ``CUDA_HOME`` when set, else the NVIDIA wheels in the venv
(``nvidia/cu13``), else the standard ``/usr/local/cuda``. Its major must be
torch's. Where no ``libcuda.so.1`` can be loaded (a build box, a container),
a link-time stub is written beside the toolkit in the venv (rig/build/cudastub.py).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rig.base import venvs
from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.base.hashing import sha256_file
from rig.build import cudastub
from rig.build.cudastub import driver_loadable
from rig.build.steps.base import Context, Status, Step
from rig.facts import record
from rig.facts.config import Settings

SYSTEM_CUDA = Path("/usr/local/cuda")
CPU_NOTHING = "DEVICE=cpu: nothing to do here (no CUDA toolkit, no driver stub: the CPU kernels need neither)"


@dataclass
class Toolkit:
    root: Path
    nvcc: Path
    version: str  # e.g. 13.0
    how: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def cuda_h(self) -> Path:
        return self.root / "include" / "cuda.h"


def nvcc_version(nvcc: Path) -> str | None:
    """``release X.Y`` from ``nvcc --version``, or None when it does not run."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m[1] if m else None


def candidates(s: Settings, major: int) -> list[tuple[Path, str]]:
    """Toolkit roots to try, in order, with how each was found."""
    out = []
    if s.cuda_home:
        return [(s.cuda_home, "CUDA_HOME")]
    out.append((venvs.site_packages(s.venv_dir) / "nvidia" / f"cu{major}", "the NVIDIA wheels in the venv"))
    out.append((SYSTEM_CUDA, "the standard location"))
    return out


def find_toolkit(s: Settings, major: int) -> Toolkit:
    """The first toolkit whose nvcc runs, checked against torch's CUDA major."""
    tried = []
    for root, how in candidates(s, major):
        nvcc = root / "bin" / "nvcc"
        ver = nvcc_version(nvcc) if nvcc.exists() else None
        if ver is None:
            tried.append(f"{root} ({how}): no working nvcc")
            continue
        tk = Toolkit(root, nvcc, ver, how)
        if tk.major != major:
            raise BadInput(problem(f"the CUDA toolkit {root} ({how})", f"CUDA {major}.x, torch's major",
                                   f"CUDA {ver}", f"point CUDA_HOME at a CUDA {major} toolkit, or unset it"))
        return tk
    raise BadInput(problem(f"a CUDA {major} toolkit", "nvcc in CUDA_HOME, the venv's NVIDIA wheels or "
                           f"{SYSTEM_CUDA}", "; ".join(tried),
                           "install the toolkit (the lock's nvidia-cuda-nvcc wheel) or set CUDA_HOME"))


def in_venv(s: Settings, tk: Toolkit) -> bool:
    return tk.root.resolve().is_relative_to(s.venv_dir.resolve())


def stub_dir(s: Settings, tk: Toolkit) -> Path:
    """A folder named ``stubs``: CMake >= 3.26 keeps such folders out of the RUNPATH it writes.

    Beside the toolkit when the toolkit lives in the venv (FindCUDAToolkit looks in
    ``lib/stubs`` by itself), else inside the venv (the ops step then names it to CMake).
    """
    return tk.root / "lib" / "stubs" if in_venv(s, tk) else s.venv_dir / "lib" / "cuda" / "stubs"


def dev_links(tk: Toolkit) -> int:
    """The wheels ship ``libcudart.so.13`` but not ``libcudart.so``; CMake looks for the latter."""
    made = 0
    lib = tk.root / "lib"
    for f in sorted(lib.glob("lib*.so.*")):
        link = lib / (f.name.split(".so.", 1)[0] + ".so")
        if not link.exists() and not link.is_symlink():
            link.symlink_to(f.name)
            made += 1
    return made


def stamp(path: Path) -> str:
    """A file by path, size and mtime: what the check compares instead of running the program again."""
    try:
        st = path.stat()
    except OSError:
        return "gone"
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def first_nvcc(s: Settings, major: int) -> Path | None:
    """The nvcc :func:`find_toolkit` would try first, found without running anything."""
    return next((root / "bin" / "nvcc" for root, _ in candidates(s, major) if (root / "bin" / "nvcc").exists()),
                None)


class ToolchainStep(Step):
    name = "toolchain"
    summary = "the CUDA toolchain (wheels or system) and the libcuda.so.1 link stub when no driver"
    needs = ("runtime",)
    facts = ("cuda_home", "nvcc_version", "cuda_stub")

    def _torch_cuda(self, s: Settings) -> str:
        tc = venvs.torch_cuda(s.venv_dir)
        if tc is None:
            raise BadInput(problem(f"torch in {s.venv_dir}", "a CUDA build of torch (torch/version.py cuda = X.Y)",
                                   "no CUDA torch", "with TORCH=host, point PYTHON at an interpreter whose torch is a "
                                   "CUDA build (or unset TORCH: the lock pins one); else ./build.sh --only runtime "
                                   "installs the lock's again"))
        return tc

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        rec = ctx.record.toolchain
        if s.device == "cpu":
            if rec is None or rec.torch_cuda != (venvs.torch_cuda(s.venv_dir) or ""):
                return Status(False, "not looked at yet for DEVICE=cpu")
            return Status(True, CPU_NOTHING, rec)
        tc = self._torch_cuda(s)
        if rec is None:
            return Status(False, "not set up yet")
        nvcc = first_nvcc(s, int(tc.split(".")[0]))
        if rec.torch_cuda != tc or nvcc is None or str(nvcc) != rec.nvcc or stamp(nvcc) != rec.nvcc_stamp:
            return Status(False, "the toolkit or torch changed")
        if rec.driver != driver_loadable():
            return Status(False, "the NVIDIA driver came or went")
        cuda_h = Path(rec.cuda_home) / "include" / "cuda.h"
        if rec.cuda_h_sha256 != (sha256_file(cuda_h) if cuda_h.exists() else ""):
            return Status(False, f"{cuda_h} changed")
        if not rec.driver and not Path(rec.cuda_stub).exists():
            return Status(False, f"the driver stub {rec.cuda_stub} is gone")
        return Status(True, f"CUDA {rec.nvcc_version} matches torch's CUDA {tc}", rec)

    def describe(self, ctx: Context, outputs: record.Toolchain) -> list[str]:
        if ctx.settings.device == "cpu":
            return []
        return [f"CUDA toolkit: {outputs.cuda_home}, nvcc {outputs.nvcc_version}; torch built for CUDA "
                f"{outputs.torch_cuda}",
                "NVIDIA driver: libcuda.so.1 loads" if outputs.driver else
                f"NVIDIA driver: none; link stub {outputs.cuda_stub}"]

    def run(self, ctx: Context) -> record.Toolchain:
        s = ctx.settings
        if s.device == "cpu":
            say(CPU_NOTHING)
            return record.Toolchain(torch_cuda=venvs.torch_cuda(s.venv_dir) or "")
        tc = self._torch_cuda(s)
        tk, driver = find_toolkit(s, int(tc.split(".")[0])), driver_loadable()
        say(f"CUDA toolkit: {tk.root} ({tk.how})")
        stub, n = "", 0
        if in_venv(s, tk) and (links := dev_links(tk)):
            say(f"added {links} unversioned library link(s) (libcudart.so ...) to {tk.root / 'lib'} for CMake")
        if not driver:
            lib, n = cudastub.build(tk.cuda_h, stub_dir(s, tk))
            stub = str(lib)
            say(f"no libcuda.so.1 loadable: wrote the link-time stub {lib} ({n} entry points, "
                f"{lib.stat().st_size / 1024:.0f} KB, soname libcuda.so.1; on no loader path)")
        return record.Toolchain(
            cuda_home=str(tk.root), nvcc=str(tk.nvcc), nvcc_stamp=stamp(tk.nvcc), nvcc_version=tk.version,
            torch_cuda=tc, driver=driver, cuda_h_sha256=sha256_file(tk.cuda_h) if tk.cuda_h.exists() else "",
            cuda_stub=stub, stub_entries=n)
