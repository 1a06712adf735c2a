"""Whether a host's torch carries what the kernels need (``TORCH=host``): its version and its symbols.

The official kernels are built on torch's stable ABI, so a torch a few releases older can load them, but not any
torch: series.toml's ``oldest_torch`` is the oldest one they were tested under, and every symbol a kernel module
leaves undefined must be defined by a library it needs or by torch's own libraries (which ``import torch`` loads
before any kernel). The symbol check reads the dynamic symbol tables with ``nm -D``, so it needs no driver: the
driver's entry points come from the driver, or from the toolchain step's link stub on a box without one.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from rig.base.errors import BadInput, problem

#: Symbols the interpreter defines for every extension module at load time.
INTERPRETER = re.compile(r"^_?Py")
DEFINED = set("TDBRVWiuGSCA")
#: Where the ELF tools come from, and the folders a user's PATH may lack (Debian keeps ldconfig in /sbin).
PACKAGES = {"nm": "binutils", "readelf": "binutils", "ldconfig": "libc-bin"}
SBIN = ("/usr/sbin", "/sbin")


def elf_tool(name: str) -> str:
    """The path of ``nm``, ``readelf`` or ``ldconfig``: PATH, then the sbin folders."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))
    if not found:
        raise BadInput(problem(f"{name} (reads the kernels' ELF files, no driver needed)", "on PATH or in "
                               f"{' or '.join(SBIN)}", "not found", f"install {PACKAGES[name]} (Debian/Ubuntu: "
                               f"apt-get install {PACKAGES[name]}), then run again"))
    return found


def loader_cache() -> dict[str, Path]:
    """Library file name -> path, from the system loader's cache (``ldconfig -p``)."""
    out = subprocess.run([elf_tool("ldconfig"), "-p"], capture_output=True, text=True).stdout
    index: dict[str, Path] = {}
    for name, path in re.findall(r"^\s+(\S+) \([^)]*\) => (\S+)$", out, re.M):
        index.setdefault(name, Path(path))
    return index


def version_tuple(text: str) -> tuple[int, ...]:
    """``host 2.11.0+cu130`` or ``2.11.0`` -> (2, 11, 0)."""
    m = re.search(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m[1].split(".")) if m else ()


def check_version(torch: str, oldest: str | None, python: str) -> None:
    """Refuse a torch older than the kernels' oldest tested one, with both versions."""
    if oldest and version_tuple(torch) < version_tuple(oldest):
        raise BadInput(problem(f"torch of PYTHON={python} (TORCH=host)", f">= {oldest} (series.toml [upstream] "
                               "oldest_torch: the oldest torch these kernels were tested under)", torch,
                               "point PYTHON at an interpreter with a newer torch, or unset TORCH for the lock's"))


@functools.cache
def symbols(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(defined, undefined) dynamic symbols of an ELF file, version suffixes dropped; weak ones count as neither."""
    out = subprocess.run([elf_tool("nm"), "-D", str(path)], capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        kind, name = parts[-2], parts[-1].split("@", 1)[0]
        if kind == "U":
            undefined.add(name)
        elif kind in DEFINED:
            defined.add(name)
    return frozenset(defined), frozenset(undefined)


@functools.cache
def dynamic(path: Path) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """An ELF file's NEEDED libraries and its RUNPATH/RPATH folders, from one ``readelf -d``."""
    out = subprocess.run([elf_tool("readelf"), "-d", str(path)], capture_output=True, text=True).stdout
    dirs: list[Path] = []
    for m in re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", out):
        dirs += [Path(d.replace("$ORIGIN", str(path.parent))) for d in m.split(":") if d]
    return tuple(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)), tuple(dirs)


def needed(path: Path) -> tuple[str, ...]:
    return dynamic(path)[0]


def library_index(dirs: Iterable[Path]) -> dict[str, Path]:
    """Library file name -> path, from the system's loader cache and then ``dirs`` (searched deeply)."""
    index = loader_cache()
    for d in dirs:
        for p in sorted(Path(d).rglob("*.so*")) if Path(d).is_dir() else ():
            if p.is_file():
                index.setdefault(p.name, p)
    return index


def closure(module: Path, index: dict[str, Path]) -> list[Path]:
    """The libraries ``module`` needs, and theirs, as far as they are found."""
    seen: dict[str, Path] = {}
    todo = list(needed(module))
    while todo:
        name = todo.pop()
        if name in seen or name not in index:
            continue
        seen[name] = index[name]
        todo.extend(needed(index[name]))
    return list(seen.values())


def missing(modules: list[Path], index: dict[str, Path], torch_lib: Path) -> list[tuple[Path, str]]:
    """(module, symbol) for each symbol a module leaves undefined that neither its libraries nor torch's define."""
    torch_defined: set[str] = set()
    for lib in sorted(torch_lib.glob("*.so*")):
        torch_defined |= symbols(lib)[0]
    out = []
    for module in modules:
        have = set(torch_defined)
        for lib in closure(module, index):
            have |= symbols(lib)[0]
        out += [(module, sym) for sym in sorted(symbols(module)[1]) if sym not in have and not INTERPRETER.match(sym)]
    return out


def check_symbols(modules: list[Path], dirs: list[Path], torch_lib: Path, torch: str, stub: Path | None
                  ) -> tuple[int, dict[Path, str]]:
    """Refuse the first stable-ABI kernel module (``*.abi3.so``) whose symbols this torch lacks; the number of
    modules checked, and the others that lack one (module -> symbol): those are built on torch's full C++ ABI
    (DeepGEMM's ``_C``), which holds only for the torch they were built with, so they are left out, not fatal."""
    index = library_index(dirs)
    if stub is not None and "libcuda.so.1" not in index:
        index["libcuda.so.1"] = stub  # no driver here: its entry points come from the link stub
    gaps = missing(modules, index, torch_lib)
    stable = [(m, sym) for m, sym in gaps if m.name.endswith(".abi3.so")]
    if stable:
        module, sym = stable[0]
        more = f" (and {len(stable) - 1} more symbol(s))" if len(stable) > 1 else ""
        raise BadInput(problem(f"the kernel module {module.name} under torch {torch}",
                               "every symbol it needs defined by its libraries or torch's",
                               f"{sym} is defined by none of them{more}",
                               "use a torch whose stable ABI carries it (the lock's, or a newer one), or unset TORCH "
                               "for the lock's torch"))
    full: dict[Path, str] = {}
    for m, sym in gaps:
        full.setdefault(m, sym)
    return len(modules), full
