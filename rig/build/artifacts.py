"""The compiled kernels as a checked tarball: pack them, and verify a tarball before installing it.

``artifacts/`` holds three files, written to temporary names and renamed
(the manifest last, naming the tarball's sha256, so a pack cut short leaves
the old complete set or nothing a later run trusts):

* ``ops.tar.zst``: every product of the build record, zstd-compressed (or
  ``ops.tar.gz`` where no ``zstd`` is installed);
* ``ops.sha256``: one sha256 per file, the format ``sha256sum -c`` reads;
* ``manifest.toml``: what the kernels were built for.

``verify`` (rig/build/verify.py) reads them with the readers here, checks a tarball
against what this tree needs and installs it, all or nothing; the readers and
the target check run on the standard library alone, as the container's verify
does.
"""

from __future__ import annotations

import datetime as dt
import gzip
import os
import posixpath
import re
import shutil
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.hashing import sha256_file

MANIFEST = "manifest.toml"
SUMS = "ops.sha256"
TARBALLS = ("ops.tar.zst", "ops.tar.gz")
REQUIRED = ("device", "ops_obj", "tree", "route", "arch", "python", "cuda", "torch", "glibc", "files", "bytes", "date",
            "tarball", "tarball_sha256", "compression")
COUNTS = ("files", "bytes")  # the manifest's integer fields
SUM_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")
ZSTD_LEVEL = "3"
REPACK = "pack again: scripts/nox.sh -s pack -- --force (the file was edited, or is not the rig's)"


class Refused(BadInput):
    """A tarball that does not fit or is malformed (exit 2): one line naming the member or field."""


def read_sums(path: Path) -> dict[str, str]:
    """name -> sha256 from a ``sha256sum`` list; every name must be a clean relative path."""
    sums: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise Refused(problem(f"{path}", "the sha256 list", "no such file", "copy the whole artifacts/ folder")
                      ) from None
    for n, line in enumerate(lines, 1):
        m = SUM_LINE.match(line)
        if not m or not clean_name(m[2]):
            raise Refused(problem(f"{path}:{n}", "'<sha256>  <relative path>'", repr(line[:80]), REPACK))
        if m[2] in sums:
            raise Refused(problem(f"{path}:{n}", "each file listed once", f"{m[2]} listed twice", REPACK))
        sums[m[2]] = m[1]
    return sums


def clean_name(name: str) -> bool:
    """A relative, normalised name with no '..' and no odd characters: what a list or a tarball may name."""
    return (bool(name) and not name.startswith("/") and "\\" not in name and "\0" not in name
            and posixpath.normpath(name) == name and not any(p in ("..", ".") for p in name.split("/")))


def read_manifest(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise Refused(problem(f"{path}", "the manifest", "no such file", "copy the whole artifacts/ folder")
                      ) from None
    except tomllib.TOMLDecodeError as exc:
        raise Refused(problem(f"{path}", "valid TOML", f"a syntax error ({exc})", REPACK)) from None
    for key in REQUIRED:
        if key not in data:
            raise Refused(problem(f"{path}", f"the field '{key}' (nox -s pack writes it)", "none", REPACK))
        kind = int if key in COUNTS else str
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise Refused(problem(f"{path}: field '{key}'", f"a {kind.__name__}", repr(data[key]), REPACK))
    if data["files"] < 1 or data["bytes"] < 1:
        raise Refused(problem(f"{path}", "at least one kernel file", f"files = {data['files']}, bytes = "
                              f"{data['bytes']}", "pack again from a build (./build.sh), not from an empty tree"))
    return data


def archs(text: str) -> set[str]:
    """GPU architectures as a set: ``8.6 8.9``, ``8.6;8.9`` and ``8.6,8.9`` are the same two."""
    return {a for a in re.split(r"[\s;,]+", text.strip()) if a}


# -- pack ---------------------------------------------------------------------------------------------


def pack(vllm_dir: Path, out: Path, facts: dict, progress: bool = True, compression: str | None = None) -> dict:
    """Pack the products listed in ``vllm_dir/.build-products.sha256`` into ``out``; return the manifest.

    ``compression``: ``zstd`` (multithreaded; the default where the program is installed) or ``gzip``.
    """
    sums_text = (vllm_dir / ".build-products.sha256").read_text()
    sums = read_sums(vllm_dir / ".build-products.sha256")
    names = sorted(sums)
    total = sum((vllm_dir / n).stat().st_size for n in names)
    out.mkdir(parents=True, exist_ok=True)
    zstd = shutil.which("zstd") if compression in (None, "zstd") else None
    if compression == "zstd" and not zstd:
        raise WorkFailed(problem("the zstd program", "on PATH (packing with zstd needs it)", "not found",
                                 "apt-get install -y zstd"))
    tar_name = TARBALLS[0] if zstd else TARBALLS[1]
    tmp_tar = out / f".{tar_name}.{os.getpid()}.tmp"
    start = time.monotonic()
    try:
        with _compressor(tmp_tar, zstd) as fh, tarfile.open(fileobj=fh, mode="w|", format=tarfile.PAX_FORMAT) as tf:
            done, last = 0, 0.0
            for name in names:
                path = vllm_dir / name
                info = tf.gettarinfo(str(path), arcname=name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(path, "rb") as src:
                    tf.addfile(info, src)
                done += info.size
                if progress and time.monotonic() - last > 2:
                    last = time.monotonic()
                    say(f"packing: {done / 1e6:.0f} / {total / 1e6:.0f} MB", err=True)
        tar_sha = sha256_file(tmp_tar)
        manifest = {**facts, "files": len(names), "bytes": total, "date": dt.date.today().isoformat(),
                    "glibc": os.confstr("CS_GNU_LIBC_VERSION").split()[-1], "tarball": tar_name,
                    "tarball_sha256": tar_sha, "compression": "zstd" if zstd else "gzip"}
        tmp_sums = out / f".{SUMS}.{os.getpid()}.tmp"
        tmp_manifest = out / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp_sums.write_text(sums_text)
        write_manifest(tmp_manifest, manifest)
        for other in TARBALLS:
            if other != tar_name:
                (out / other).unlink(missing_ok=True)
        os.replace(tmp_tar, out / tar_name)
        os.replace(tmp_sums, out / SUMS)
        os.replace(tmp_manifest, out / MANIFEST)  # last: its tarball_sha256 vouches for the set
    finally:
        for p in out.glob(f".*.{os.getpid()}.tmp"):
            p.unlink(missing_ok=True)
    if progress:
        size = (out / tar_name).stat().st_size
        say(f"packed {len(names)} files, {total / 1e6:.0f} MB into {out / tar_name} "
            f"({size / 1e6:.0f} MB, {time.monotonic() - start:.1f} s)", err=True)
    return manifest


def write_manifest(path: Path, manifest: dict) -> None:
    """Write ``manifest`` as TOML into ``path`` (the caller's scratch name, or atomically)."""
    import tomli_w  # only writing needs it; verify runs on the standard library

    path.write_text("# generated by `nox -s pack`: what these kernels were built for\n" + tomli_w.dumps(manifest))


@contextmanager
def _compressor(dest: Path, zstd: str | None) -> Iterator[IO[bytes]]:
    """A binary stream that lands compressed in ``dest``: zstd on all cores, else gzip."""
    if not zstd:
        with gzip.open(dest, "wb", compresslevel=6) as fh:
            yield fh
        return
    with open(dest, "wb") as out:
        proc = subprocess.Popen([zstd, "-T0", f"-{ZSTD_LEVEL}", "-q", "-c"], stdin=subprocess.PIPE, stdout=out)
        assert proc.stdin
        try:
            yield proc.stdin
        finally:
            proc.stdin.close()
            if proc.wait() != 0:
                raise WorkFailed(problem(f"zstd writing {dest}", "exit 0", f"exit {proc.returncode}",
                                         "check the free space there, then pack again"))


def current(out: Path, facts: dict, sums_text: str, rehash: bool = False,
            packed: tuple[str, int, int] | None = None) -> str:
    """'' when ``out`` holds a complete pack of these kernels, else what is missing or stale.

    ``packed``: the tarball this build packed, as (sha256, size, mtime_ns). A manifest naming another tarball
    is stale; the tarball is re-hashed against the manifest when ``rehash`` is asked, when its size or mtime
    differ from ``packed``, or when nothing is recorded: a tarball swapped for another valid one is not trusted.
    """
    if not (out / MANIFEST).exists():
        return f"no {MANIFEST} yet"
    try:
        m = read_manifest(out / MANIFEST)
    except Refused as exc:
        return exc.message.split(": ", 1)[-1]  # what is wrong, without the path the caller names
    for key, want in facts.items():
        if m.get(key) != want:
            return f"the manifest is for {key} {m.get(key)!r}, the build is {want!r}"
    tar = out / str(m["tarball"])
    if not tar.exists():
        return f"{tar.name} is missing"
    if packed and m["tarball_sha256"] != packed[0]:
        return f"{MANIFEST} names tarball sha256 {m['tarball_sha256'][:12]}, this build packed {packed[0][:12]}"
    st = tar.stat()
    if rehash or not packed or (st.st_size, st.st_mtime_ns) != packed[1:]:
        found = sha256_file(tar)
        if found != m["tarball_sha256"]:
            return (f"{tar.name} does not match the manifest's sha256 (found {found[:12]}, expected "
                    f"{m['tarball_sha256'][:12]})")
    try:
        if (out / SUMS).read_text() != sums_text:
            return f"{SUMS} differs from the build record"
    except FileNotFoundError:
        return f"{SUMS} is missing"
    return ""


def check_target(manifest: dict, target: dict[str, str | None]) -> None:
    """The manifest against the target it is to be installed for; the first mismatch names the item. The
    architectures are compared as sets: the tarball must hold every one the target needs."""
    for key, want in target.items():
        if want is None:
            continue
        found = manifest.get(key)
        if key == "arch":
            ok, expected = archs(want) <= archs(str(found)), f"architectures that include {want!r}"
        elif key == "python":  # "abi3", or the minors the kernels have a build for ("3.12" in "3.10 3.11 3.12")
            ok, expected = str(found) == "abi3" or want in str(found).split(), f"kernels that load under {want!r}"
        else:
            ok, expected = str(found) == str(want), repr(want)
        if not ok:
            raise Refused(problem(f"{MANIFEST}: {key}", f"{expected} (the target's)", f"{found!r}",
                                  "pack again for this target (./build.sh), or build with the compile route"))
