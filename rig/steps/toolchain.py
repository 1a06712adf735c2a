"""Step 5, toolchain: the CUDA toolkit matching torch's CUDA major, and the driver stub.

The toolkit is ``CUDA_HOME`` when set, else the NVIDIA wheels in the venv
(``nvidia/cu13``), else the standard ``/usr/local/cuda``. Its major must be
torch's. Where no ``libcuda.so.1`` can be loaded (a build box, a container),
a link-time stub is written beside the toolkit in the venv (rig/cudastub.py).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rig import cudastub
from rig.config import Settings
from rig.console import say
from rig.cudastub import driver_loadable
from rig.errors import BadInput, problem
from rig.hashing import sha256_file
from rig.steps.pipeline import Context, Status, Step
from rig.steps.venv import site_packages

SYSTEM_CUDA = Path("/usr/local/cuda")
#: The recorded outputs that decide whether the step is current (the stub is checked on disk).
INPUTS = ("cuda_home", "nvcc", "nvcc_version", "torch_cuda", "driver", "cuda_h_sha256")


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


def torch_cuda(s: Settings) -> str | None:
    """The CUDA version torch in the venv was built for, read from torch/version.py (no import)."""
    try:
        text = (site_packages(s) / "torch" / "version.py").read_text()
    except FileNotFoundError:
        return None
    m = re.search(r"^cuda(?::[^=]*)?=\s*['\"](\d+\.\d+)['\"]", text, re.M)
    return m[1] if m else None


def candidates(s: Settings, major: int) -> list[tuple[Path, str]]:
    """Toolkit roots to try, in order, with how each was found."""
    out = []
    if s.cuda_home:
        return [(s.cuda_home, "CUDA_HOME")]
    out.append((site_packages(s) / "nvidia" / f"cu{major}", "the NVIDIA wheels in the venv"))
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


class ToolchainStep(Step):
    name = "toolchain"
    summary = "the CUDA toolchain (wheels or system) and the libcuda.so.1 link stub when no driver"
    needs = ("runtime",)
    facts = ("cuda_home", "nvcc_version", "cuda_stub")

    def _inputs(self, s: Settings) -> tuple[str, Toolkit, bool]:
        tc = torch_cuda(s)
        if tc is None:
            raise BadInput(problem(f"torch in {s.venv_dir}", "a CUDA build of torch (torch/version.py cuda = X.Y)",
                                   "no CUDA torch", "run ./build.sh --only runtime (the lock pins the CUDA build)"))
        return tc, find_toolkit(s, int(tc.split(".")[0])), driver_loadable()

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        tc, tk, driver = self._inputs(s)
        rec = ctx.outputs_of(self.name)
        if not rec:
            return Status(False, "not set up yet")
        now = self._outputs(s, tc, tk, driver, "", 0)
        if any(rec.get(k) != now[k] for k in INPUTS):
            return Status(False, "the toolkit, torch or the driver changed")
        if not driver and not Path(rec["cuda_stub"]).exists():
            return Status(False, f"the driver stub {rec['cuda_stub']} is gone")
        self._say(tk, tc, driver, rec.get("cuda_stub", ""))
        return Status(True, f"CUDA {tk.version} ({tk.how}) matches torch's CUDA {tc}", rec)

    def run(self, ctx: Context) -> dict:
        s = ctx.settings
        tc, tk, driver = self._inputs(s)
        stub, n = "", 0
        if in_venv(s, tk) and (links := dev_links(tk)):
            say(f"added {links} unversioned library link(s) (libcudart.so ...) to {tk.root / 'lib'} for CMake")
        if not driver:
            lib, n = cudastub.build(tk.cuda_h, stub_dir(s, tk))
            stub = str(lib)
            say(f"no libcuda.so.1 loadable: wrote the link-time stub {lib} ({n} entry points, "
                f"{lib.stat().st_size / 1024:.0f} KB, soname libcuda.so.1; on no loader path)")
        self._say(tk, tc, driver, stub)
        return self._outputs(s, tc, tk, driver, stub, n)

    def _say(self, tk: Toolkit, tc: str, driver: bool, stub: str) -> None:
        say(f"CUDA toolkit: {tk.root} ({tk.how}), nvcc {tk.version}; torch built for CUDA {tc}")
        say("NVIDIA driver: libcuda.so.1 loads" if driver else f"NVIDIA driver: none; link stub {stub}")

    def _outputs(self, s: Settings, tc: str, tk: Toolkit, driver: bool, stub: str, n: int) -> dict:
        return {"cuda_home": str(tk.root), "nvcc": str(tk.nvcc), "nvcc_version": tk.version, "torch_cuda": tc,
                "driver": driver, "cuda_h_sha256": sha256_file(tk.cuda_h) if tk.cuda_h.exists() else "",
                "cuda_stub": stub if not driver else "", "stub_entries": n if not driver else 0}
