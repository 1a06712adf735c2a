"""The build record ``.rig/build.toml``: one typed table per step's outputs.

Each step returns one of the dataclasses below; the pipeline keeps them in
:class:`BuildRecord` and writes the file atomically after every step. Reading
needs the standard library alone (the container's verify and ``fact`` read it
before the rig's dependencies exist); only writing imports tomli-w. A table
that does not fit its dataclass (a hand edit, an older rig) counts as absent,
so that step simply runs again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rig.base import atomic

FILE = "build.toml"  # build-cpu.toml for DEVICE=cpu: the two builds never share a record


@dataclass(frozen=True)
class Tools:
    """Step 1: where each build tool is, and a fingerprint of the files looked at."""

    fingerprint: str = ""
    git: str = ""
    cc: str = ""
    cxx: str = ""
    cmake: str = ""
    cmake_version: str = ""
    ninja: str = ""
    uv: str = ""
    ccache: str = ""
    ccache_dir: str = ""
    cargo: str = ""  # empty unless cargo of vLLM's Rust channel is there


@dataclass(frozen=True)
class Tree:
    """Step 2: the patched tree and its compiled-input hash."""

    tree: str = ""
    head: str = ""
    base: str = ""
    source: str = ""  # git | sdist
    ops_obj: str = ""
    base_ops_obj: str = ""


@dataclass(frozen=True)
class Venv:
    """Step 3: the serving venv."""

    venv: str = ""
    python: str = ""
    uv: str = ""


@dataclass(frozen=True)
class Runtime:
    """Step 4: the lock that was installed, and a digest per pin (to reinstall only what changed)."""

    lock_sha256: str = ""
    pins: int = 0
    pin_digests: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Toolchain:
    """Step 5: the CUDA toolkit, torch's CUDA, the driver, the link stub."""

    cuda_home: str = ""
    nvcc: str = ""
    nvcc_stamp: str = ""  # path, size, mtime: a re-run need not ask nvcc its version again
    nvcc_version: str = ""
    torch_cuda: str = ""
    driver: bool = False
    cuda_h_sha256: str = ""
    cuda_stub: str = ""
    stub_entries: int = 0


@dataclass(frozen=True)
class Ops:
    """Step 6: the kernels (their full record is ``vllm/.build-products``)."""

    route: str = ""
    ops_obj: str = ""
    products: int = 0
    record: str = ""
    version: str = ""
    arch: str = ""
    python: str = ""


@dataclass(frozen=True)
class Install:
    """Step 7: the vllm installed and the kernels its import check saw."""

    vllm_version: str = ""
    ops_obj: str = ""
    route: str = ""
    torch: str = ""  # the torch the import check ran under ("host 2.11.0+cu130" on the TORCH=host route)


@dataclass(frozen=True)
class Pack:
    """Step 8: the kernels tarball."""

    tarball: str = ""
    files: int = 0
    bytes: int = 0
    ops_obj: str = ""
    sha256: str = ""  # the tarball file's, as packed: the cheap check compares size and mtime, then this
    size: int = 0
    mtime_ns: int = 0


#: Step name -> the dataclass of its outputs, in pipeline order.
TYPES: dict[str, type] = {"tools": Tools, "tree": Tree, "venv": Venv, "runtime": Runtime,
                          "toolchain": Toolchain, "ops": Ops, "install": Install, "pack": Pack}


@dataclass
class BuildRecord:
    """The outputs of each step that has run (None: not recorded), and when each was recorded."""

    tools: Tools | None = None
    tree: Tree | None = None
    venv: Venv | None = None
    runtime: Runtime | None = None
    toolchain: Toolchain | None = None
    ops: Ops | None = None
    install: Install | None = None
    pack: Pack | None = None
    at: dict[str, str] = field(default_factory=dict)

    def put(self, step: str, outputs: object) -> bool:
        """Keep a step's outputs; True when they changed (the file then needs writing)."""
        if not isinstance(outputs, TYPES[step]):
            raise TypeError(f"step {step} returned {type(outputs).__name__}, not {TYPES[step].__name__}")
        if getattr(self, step) == outputs:
            return False
        setattr(self, step, outputs)
        self.at[step] = dt.datetime.now().isoformat(timespec="seconds")
        return True


def path(state_dir: Path, device: str = "cuda") -> Path:
    return Path(state_dir) / (FILE if device == "cuda" else f"build-{device}.toml")


def _typed(cls: type, table: object) -> object | None:
    """``table`` as ``cls``, or None when a key is unknown or a value has the wrong type."""
    if not isinstance(table, dict):
        return None
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    if not set(table) <= set(kinds):
        return None
    want = {"str": str, "int": int, "bool": bool, "dict[str, str]": dict}
    for key, value in table.items():
        kind = want[kinds[key]]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return None
    return cls(**table)


def load(state_dir: Path, device: str = "cuda") -> BuildRecord:
    """The build record of ``device``; an unreadable file, or a table that does not fit, counts as absent."""
    try:
        data = tomllib.loads(path(state_dir, device).read_text())
    except (FileNotFoundError, NotADirectoryError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return BuildRecord()
    rec = BuildRecord()
    steps = data.get("steps") if isinstance(data.get("steps"), dict) else {}
    for name, cls in TYPES.items():
        entry = steps.get(name)
        if isinstance(entry, dict) and (out := _typed(cls, entry.get("outputs"))) is not None:
            setattr(rec, name, out)
            rec.at[name] = str(entry.get("at", ""))
    return rec


def save(state_dir: Path, rec: BuildRecord, device: str = "cuda") -> None:
    """Write the record atomically (a run cut short leaves the previous file whole)."""
    import tomli_w  # only writing needs it

    steps = {name: {"outputs": dataclasses.asdict(out), "at": rec.at.get(name, "")}
             for name in TYPES if (out := getattr(rec, name)) is not None}
    text = "# Written by the rig after each build step.\n" + tomli_w.dumps({"steps": steps})
    atomic.write_text(path(state_dir, device), text)


def labels(rec: BuildRecord) -> dict[str, str]:
    """The build in short labels (the metrics' build info, the bench history's identity): vLLM's version, the
    patched tree, the kernels key and torch; empty where a step is not recorded."""
    return {"version": rec.install.vllm_version if rec.install else "", "tree": rec.tree.tree[:12] if rec.tree else "",
            "kernels": rec.ops.ops_obj[:12] if rec.ops else "", "torch": rec.install.torch if rec.install else ""}
