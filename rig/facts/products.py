"""The build record of the kernels: ``vllm/.build-products`` and ``vllm/.build-products.sha256``.

The products are the files of the package folder (``vllm/vllm/``) that git does
not track: the compiled extensions and what the build copies beside them. The
record names the tree commit, OPS_OBJ and route they were made for, and a
sha256, size and mtime per file: a re-run checks size and mtime (fast), or
re-hashes every file (``--verify``). Both files are written atomically; the
record is removed before a build starts, so an interrupted build is never
trusted.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rig.base import atomic
from rig.base.errors import WorkFailed, problem
from rig.base.gitutil import Git
from rig.base.hashing import sha256_file

RECORD = ".build-products"
SUMS = ".build-products.sha256"
SKIP_PARTS = {"__pycache__"}


@dataclass
class Record:
    facts: dict  # tree, ops_obj, route, arch, torch, python, ...
    files: dict[str, dict] = field(default_factory=dict)  # rel path -> {sha256, size, mtime_ns}


def product_paths(vllm_dir: Path) -> list[str]:
    """Untracked files of the package folder, relative to ``vllm_dir`` (ignored ones included)."""
    out = Git(vllm_dir).run("ls-files", "--others", "-z", "--", "vllm")[1]
    paths = []
    for rel in out.split("\0"):
        if rel and not SKIP_PARTS.intersection(rel.split("/")) and not rel.endswith((".pyc", ".pyo")):
            paths.append(rel)
    return sorted(paths)


def product_paths_recorded(vllm_dir: Path) -> list[str]:
    """The files the kernels' record names, and the record itself: the rig's own untracked files."""
    rec = read(vllm_dir)
    return [RECORD, SUMS, *(rec.files if rec else ())]


def collect(vllm_dir: Path, facts: dict) -> Record:
    files = {}
    for rel in product_paths(vllm_dir):
        st = (vllm_dir / rel).stat()
        files[rel] = {"sha256": sha256_file(vllm_dir / rel), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return Record(facts, files)


def read(vllm_dir: Path) -> Record | None:
    """The record, or None when there is none or it is not whole. Parsed once per run while the file is the
    same (a build's record of 2,000 files takes a tenth of a second to parse, and several steps ask)."""
    try:
        st = (vllm_dir / RECORD).stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _parsed(str(vllm_dir / RECORD), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed(path: str, ino: int, size: int, mtime_ns: int) -> Record | None:
    """``path`` parsed; the other arguments are the cache's key: a rewritten record is read again."""
    try:
        data = loads(Path(path).read_text())
        return Record(data["facts"], data["files"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def loads(text: str) -> dict:
    """The record's text: JSON (parsed ten times faster than TOML: a no-op build reads 2,000 entries), or the
    TOML a build before that wrote. ValueError when it is neither."""
    return json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)


def write(vllm_dir: Path, rec: Record) -> None:
    """The sums first, then the record: the record's presence means both are complete."""
    sums = "".join(f"{v['sha256']}  {k}\n" for k, v in sorted(rec.files.items()))
    exclude = vllm_dir / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.build-products" not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as fh:  # keep `git status` in vllm/ quiet about the record
            fh.write("/.build-products\n/.build-products.sha256\n")
    try:
        atomic.write_text(vllm_dir / SUMS, sums)
        atomic.write_text(vllm_dir / RECORD, json.dumps({"about": "the kernels of this tree, written by the rig's "
                                                         "ops step", "facts": rec.facts, "files": rec.files},
                                                        indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        forget(vllm_dir)
        raise WorkFailed(problem(f"the build record {vllm_dir / RECORD}", "written", f"it could not be written: "
                                 f"{exc.strerror or exc}", "free disk space and run ./build.sh again (no partial "
                                 "record was kept)")) from None


def forget(vllm_dir: Path) -> None:
    """Drop the record before a build, so a build cut short leaves nothing a later run trusts."""
    for name in (RECORD, SUMS):
        try:
            os.unlink(vllm_dir / name)
        except FileNotFoundError:
            pass


def _seconds_kept(found: int, recorded: int) -> bool:
    """A copy that kept the mtime to the second only: an image layer's tar (seen with buildah's docker format)
    drops the nanoseconds, so every kernel of an image would read as modified."""
    return found % 10**9 == 0 and found == recorded - recorded % 10**9


def mismatches(vllm_dir: Path, rec: Record, rehash: bool) -> list[str]:
    """Products that are gone or changed: by size and mtime, or by sha256 with ``rehash``."""
    bad = []
    for rel, want in rec.files.items():
        p = vllm_dir / rel
        try:
            st = p.stat()
        except FileNotFoundError:
            bad.append(f"{rel} (missing)")
            continue
        if st.st_size != want["size"]:
            bad.append(f"{rel} (size {st.st_size}, recorded {want['size']})")
        elif rehash and sha256_file(p) != want["sha256"]:
            bad.append(f"{rel} (sha256 differs)")
        elif not rehash and st.st_mtime_ns != want["mtime_ns"] and not _seconds_kept(st.st_mtime_ns, want["mtime_ns"]):
            bad.append(f"{rel} (modified since the build)")
    return bad



def pythons(names: list[str] | set[str] | dict) -> str:
    """The CPython minors a kernel set loads under, as a manifest records them: ``abi3`` when every extension
    module is built on the stable ABI, else the minors every versioned module has a build for (the official
    wheel's DeepGEMM ships one per minor: ``3.10 3.11 3.12 3.13 3.14``)."""
    by_module: dict[str, set[str]] = {}
    for n in names:
        m = re.match(r"^(.*)\.cpython-3(\d+)-[^/]*\.so$", n)
        if m:
            by_module.setdefault(m[1], set()).add(f"3.{m[2]}")
    if not by_module:
        return "abi3"
    common = set.intersection(*by_module.values())
    return " ".join(sorted(common, key=lambda v: int(v.split(".")[1])))
