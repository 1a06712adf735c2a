"""A link-time stand-in for ``libcuda.so.1``; scripts/gen-cuda-stub.sh runs it (``python3 -m``: so a ``__main__``).

vLLM's kernels link ``CUDA::cuda_driver``, the NVIDIA driver library. A build
box or container with no driver has no ``libcuda.so.1``, and the CUDA wheels ship no stub for it, so
CMake stops. This module reads the toolkit's ``cuda.h``, collects every
``cu*`` entry point it declares, plus the versioned names (``_v2``, ``_ptds``,
``_ptsz`` ...) its macros map them to, and compiles a shared library with
soname ``libcuda.so.1`` that defines each one with an empty body.

It is a link-time object only: it lives in a folder no loader searches, so
at run time the extensions open the real driver. Standard library only, so
the container build can run it: ``python3 -m rig.build.cudastub --help``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import tempfile
from pathlib import Path

from rig.base.console import guard, plain
from rig.base.errors import BadInput, WorkFailed, problem
from rig.facts import config

DECL = re.compile(r"\bCUresult\s+CUDAAPI\b")
NAME_AFTER = re.compile(r"\s*(cu[A-Za-z0-9_]+)\s*\(")
DEFINE = re.compile(r"^\s*#\s*define\s+(cu[A-Z][A-Za-z0-9_]*)\b(.*)$")
TARGET = re.compile(r"^\s*(?:(__CUDA_API_PTDS|__CUDA_API_PTSZ)\s*\(\s*(cu[A-Za-z0-9_]+)\s*\)|(cu[A-Za-z0-9_]+))\s*$")
SUFFIX = {"__CUDA_API_PTDS": "_ptds", "__CUDA_API_PTSZ": "_ptsz"}


def _strip_comments(text: str) -> str:
    """Blank out comments but keep every newline, so line numbers stay true."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m[0])
    return re.sub(r"/\*.*?\*/|//[^\n]*", blank, text, flags=re.S)


def driver_loadable() -> bool:
    """Whether the real driver library, ``libcuda.so.1``, can be loaded here."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def entry_points(cuda_h: Path) -> list[str]:
    """Every driver entry point ``cuda.h`` declares or maps a name to, sorted."""
    text = _strip_comments(Path(cuda_h).read_text(errors="replace"))
    names: set[str] = set()
    for m in DECL.finditer(text):
        nm = NAME_AFTER.match(text, m.end())
        if not nm:
            line = text.count("\n", 0, m.start()) + 1
            src = text[m.start(): text.find("\n", m.end())].strip()
            raise BadInput(problem(f"{cuda_h}:{line}", "a declaration 'CUresult CUDAAPI cuName(...)'",
                                   repr(src[:80]), "use the cuda.h of a CUDA toolkit release (CUDA_HOME)"))
        names.add(nm[1])
    for n, line in enumerate(text.splitlines(), 1):
        dm = DEFINE.match(line)
        if not dm:
            continue
        tm = TARGET.match(dm[2])
        if not tm:
            raise BadInput(problem(f"{cuda_h}:{n}", "#define cuName cuName_vN, or __CUDA_API_PTDS/PTSZ(cuName)",
                                   repr(line.strip()[:80]), "use the cuda.h of a CUDA toolkit release (CUDA_HOME)"))
        if tm[3]:
            names.add(tm[3])
        else:
            names.add(tm[2])
            names.add(tm[2] + SUFFIX[tm[1]])
    if not names:
        raise BadInput(problem(f"{cuda_h}", "CUresult CUDAAPI declarations", "none",
                               "point CUDA_HOME at a CUDA toolkit; this file is not its cuda.h"))
    return sorted(names)


def c_source(names: list[str]) -> str:
    body = "".join(f'__attribute__((visibility("default"))) int {n}(void) {{ return 999; }}\n' for n in names)
    return ("/* Link-time stub of libcuda.so.1, made by the rig from cuda.h. Never loaded at run time:\n"
            " * every entry point returns CUDA_ERROR_UNKNOWN (999). */\n" + body)


def build(cuda_h: Path, out_dir: Path, cc: str = "cc") -> tuple[Path, int]:
    """Write ``out_dir/libcuda.so.1`` (and the ``libcuda.so`` link name); return it and the entry count."""
    names = entry_points(cuda_h)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "cuda_stub.c"
        src.write_text(c_source(names))
        lib = Path(tmp) / "libcuda.so.1"
        r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise WorkFailed(problem(f"{cc} building the driver stub", "a shared library libcuda.so.1",
                                     f"exit {r.returncode}: {r.stderr.strip()[-400:]}", "install a working C "
                                     "compiler (apt-get install -y build-essential), or point --cc (CC) at one"))
        os.replace(lib, out_dir / "libcuda.so.1")  # atomic: a half-written stub is never seen
    link = out_dir / "libcuda.so"
    tmp_link = out_dir / ".libcuda.so.tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to("libcuda.so.1")
    os.replace(tmp_link, link)
    return out_dir / "libcuda.so.1", len(names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gen-cuda-stub.sh", description="A link-time stand-in for the NVIDIA "
                                 "driver library, libcuda.so.1, from a toolkit's cuda.h.",
                                 epilog="Writes OUT/libcuda.so.1 and the link name OUT/libcuda.so.")
    ap.add_argument("--cuda-h", required=True, type=Path, help="the toolkit's include/cuda.h")
    ap.add_argument("--out", required=True, type=Path, help="the folder for the stub (on no loader path)")
    ap.add_argument("--cc", help="the C compiler (default: CC, else cc)")
    a = ap.parse_args(argv)

    def go() -> int:
        lib, n = build(a.cuda_h, a.out, a.cc or config.settings().cc)
        plain(f"{lib}: {n} entry points, {lib.stat().st_size / 1024:.0f} KB, soname libcuda.so.1")
        return 0

    return guard(go)


if __name__ == "__main__":
    raise SystemExit(main())
