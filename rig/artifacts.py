"""The compiled kernels as a checked tarball: pack them, and verify a tarball before installing it.

``artifacts/`` holds three files, written to temporary names and renamed
(the manifest last, naming the tarball's sha256, so a pack cut short leaves
the old complete set or nothing a later run trusts):

* ``ops.tar.zst``: every product of the build record, zstd-compressed (or
  ``ops.tar.gz`` where no ``zstd`` is installed);
* ``ops.sha256``: one sha256 per file, the format ``sha256sum -c`` reads;
* ``manifest.toml``: what the kernels were built for.

``verify`` is the gate of the container build, so it needs only Python's
standard library (plus the ``zstd`` program for a ``.tar.zst``). Before it
extracts anything it inspects every member (regular files and folders only,
each file in the sha256 list, no absolute names, no ``..``, no links,
devices or FIFOs, no duplicates, sizes within the manifest's totals), then
extracts with tarfile's ``data`` filter into a temporary folder, re-hashes
every file and only then moves the result into place. CPython 3.11.7 and
3.13.0 predate the 2025 fixes for tar-filter bypasses; the inspection is what
makes extraction safe. Nothing is installed on any failure.

  python3 -m rig.artifacts verify --help
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rig.console import INDENT, guard
from rig.errors import BadInput, WorkFailed
from rig.hashing import sha256_file

MANIFEST = "manifest.toml"
SUMS = "ops.sha256"
TARBALLS = ("ops.tar.zst", "ops.tar.gz")
REQUIRED = ("device", "ops_obj", "tree", "route", "arch", "python", "cuda", "torch", "glibc", "files", "bytes", "date",
            "tarball", "tarball_sha256", "compression")
COUNTS = ("files", "bytes")  # the manifest's integer fields
SUM_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")
ZSTD_LEVEL = "3"


class Refused(BadInput):
    """A tarball that does not fit or is malformed (exit 2): one line naming the member or field."""


def read_sums(path: Path) -> dict[str, str]:
    """name -> sha256 from a ``sha256sum`` list; every name must be a clean relative path."""
    sums: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise Refused(f"{path}: the sha256 list is missing. Fix: copy the whole artifacts/ folder") from None
    for n, line in enumerate(lines, 1):
        m = SUM_LINE.match(line)
        if not m or not _clean(m[2]):
            raise Refused(f"{path}:{n}: expected '<sha256>  <relative path>', found {line[:80]!r}")
        if m[2] in sums:
            raise Refused(f"{path}:{n}: {m[2]} is listed twice")
        sums[m[2]] = m[1]
    return sums


def _clean(name: str) -> bool:
    """A relative, normalised name with no '..' and no odd characters."""
    return (bool(name) and not name.startswith("/") and "\\" not in name and "\0" not in name
            and posixpath.normpath(name) == name and not any(p in ("..", ".") for p in name.split("/")))


def read_manifest(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise Refused(f"{path}: the manifest is missing. Fix: copy the whole artifacts/ folder") from None
    except tomllib.TOMLDecodeError as exc:
        raise Refused(f"{path}: not valid TOML ({exc})") from None
    for key in REQUIRED:
        if key not in data:
            raise Refused(f"{path}: field '{key}' is missing (expected one of the fields nox -s pack writes)")
        kind = int if key in COUNTS else str
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise Refused(f"{path}: field '{key}': expected a {kind.__name__}, found {data[key]!r}. Fix: pack again "
                          "with nox -s pack (the manifest was edited, or is not the rig's)")
    if data["files"] < 1 or data["bytes"] < 1:
        raise Refused(f"{path}: expected at least one kernel file, found files = {data['files']}, bytes = "
                      f"{data['bytes']}. Fix: pack again from a build (./build.sh), not from an empty tree")
    return data


def archs(text: str) -> set[str]:
    """GPU architectures as a set: ``8.6 8.9``, ``8.6;8.9`` and ``8.6,8.9`` are the same two."""
    return {a for a in re.split(r"[\s;,]+", text.strip()) if a}


# -- pack ---------------------------------------------------------------------------------------------


def pack(vllm_dir: Path, out: Path, facts: dict, progress: bool = True, compression: str | None = None) -> dict:
    """Pack the products listed in ``vllm_dir/.build-products.sha256`` into ``out``; return the manifest.

    ``compression``: ``zstd`` (multithreaded; the default where the program is installed) or ``gzip``.
    """
    import tomli_w  # only the pack needs it; verify runs on the standard library

    sums_text = (vllm_dir / ".build-products.sha256").read_text()
    sums = read_sums(vllm_dir / ".build-products.sha256")
    names = sorted(sums)
    total = sum((vllm_dir / n).stat().st_size for n in names)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp"):  # left by a pack that was killed; never part of a set
        stale.unlink(missing_ok=True)
    zstd = shutil.which("zstd") if compression in (None, "zstd") else None
    if compression == "zstd" and not zstd:
        raise WorkFailed("packing with zstd needs the zstd program. Fix: apt-get install -y zstd")
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
                    print(f"{INDENT}packing: {done / 1e6:.0f} / {total / 1e6:.0f} MB", file=sys.stderr, flush=True)
        tar_sha = sha256_file(tmp_tar)
        manifest = {**facts, "files": len(names), "bytes": total, "date": dt.date.today().isoformat(),
                    "glibc": os.confstr("CS_GNU_LIBC_VERSION").split()[-1], "tarball": tar_name,
                    "tarball_sha256": tar_sha, "compression": "zstd" if zstd else "gzip"}
        tmp_sums = out / f".{SUMS}.{os.getpid()}.tmp"
        tmp_manifest = out / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp_sums.write_text(sums_text)
        tmp_manifest.write_text("# generated by `nox -s pack`: what these kernels were built for\n"
                                + tomli_w.dumps(manifest))
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
        print(f"{INDENT}packed {len(names)} files, {total / 1e6:.0f} MB into {out / tar_name} "
              f"({size / 1e6:.0f} MB, {time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    return manifest


@contextmanager
def _compressor(dest: Path, zstd: str | None) -> Iterator[IO[bytes]]:
    """A binary stream that lands compressed in ``dest``: zstd on all cores, else gzip."""
    if not zstd:
        import gzip
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
                raise WorkFailed(f"zstd failed (exit {proc.returncode}) while writing {dest}")


def current(out: Path, facts: dict, sums_text: str, rehash: bool = False) -> str:
    """'' when ``out`` holds a complete pack of these kernels, else what is missing or stale."""
    if not (out / MANIFEST).exists():
        return f"no {MANIFEST} yet"
    try:
        m = read_manifest(out / MANIFEST)
    except Refused as exc:
        return str(exc).split(": ", 1)[-1]
    for key, want in facts.items():
        if m.get(key) != want:
            return f"the manifest is for {key} {m.get(key)!r}, the build is {want!r}"
    tar = out / str(m["tarball"])
    if not tar.exists():
        return f"{tar.name} is missing"
    if rehash and sha256_file(tar) != m["tarball_sha256"]:
        return f"{tar.name} does not match the manifest's sha256"
    try:
        if (out / SUMS).read_text() != sums_text:
            return f"{SUMS} differs from the build record"
    except FileNotFoundError:
        return f"{SUMS} is missing"
    return ""


# -- verify ---------------------------------------------------------------------------------------------


@contextmanager
def _open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    """The tarball as a stream, whatever it is compressed with; a corrupt stream is refused."""
    if path.name.endswith(".zst"):
        zstd = shutil.which("zstd")
        if not zstd:
            raise Refused(f"{path.name}: needs the zstd program to read (apt-get install -y zstd)")
        proc = subprocess.Popen([zstd, "-dc", "-q", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|", bufsize=1 << 20) as tf:
                yield tf
            proc.stdout.read()
        finally:
            proc.stdout.close()
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            if proc.wait() != 0:
                raise Refused(f"{path.name}: truncated or corrupt ({err or f'zstd exit {proc.returncode}'})")
    else:
        with tarfile.open(path, mode="r|gz", bufsize=1 << 20) as tf:
            yield tf


def inspect(tar: Path, sums: dict[str, str], manifest: dict) -> int:
    """Check every member header before anything is extracted; return the file count."""
    seen: set[str] = set()
    files = size = 0
    try:
        with _open_tar(tar) as tf:
            for m in tf:
                name = m.name.rstrip("/") if m.isdir() else m.name
                kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev() and not
                        m.isfifo() else "FIFO" if m.isfifo() else None)
                if kind:
                    raise Refused(f"{tar.name}: member {m.name!r} is a {kind}; only regular files and folders "
                                  "are allowed")
                if not (m.isfile() or m.isdir()):
                    raise Refused(f"{tar.name}: member {m.name!r} has type {m.type!r}; only files and folders")
                if not _clean(name):
                    raise Refused(f"{tar.name}: member {m.name!r} is not a clean relative name "
                                  "(absolute, '..' or odd characters)")
                if name in seen:
                    raise Refused(f"{tar.name}: member {m.name!r} appears twice")
                seen.add(name)
                if m.isfile():
                    if name not in sums:
                        raise Refused(f"{tar.name}: member {m.name!r} is not in {SUMS}")
                    files += 1
                    size += m.size
                    if files > manifest["files"] or size > manifest["bytes"]:
                        raise Refused(f"{tar.name}: member {m.name!r} goes past the manifest's totals "
                                      f"({manifest['files']} files, {manifest['bytes']} bytes)")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Refused(f"{tar.name}: truncated or corrupt ({type(exc).__name__}: {exc})") from None
    missing = sorted(set(sums) - seen)
    if missing:
        raise Refused(f"{tar.name}: {missing[0]} is in {SUMS} but not in the tarball"
                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return files


def check_target(manifest: dict, target: dict[str, str]) -> None:
    """The manifest against what it is to be installed into; the first mismatch names the item."""
    for key, want in target.items():
        if want is None:
            continue
        found = manifest.get(key)
        ok = archs(want) <= archs(str(found)) if key == "arch" else str(found) == str(want)
        if not ok:
            what = "the architectures it holds" if key == "arch" else key
            raise Refused(f"{MANIFEST}: {what}: the target needs {want!r}, the tarball has {found!r}. "
                          "Fix: pack again for this target (./build.sh), or build with the compile route")


def verify(artifacts: Path, dest: Path, target: dict[str, str]) -> int:
    """Check the set in ``artifacts`` against ``target`` and install its files under ``dest``; return the count."""
    manifest = read_manifest(artifacts / MANIFEST)
    check_target(manifest, target)
    tar = artifacts / str(manifest["tarball"])
    if manifest["tarball"] not in TARBALLS or not tar.exists():
        raise Refused(f"{MANIFEST}: tarball {manifest['tarball']!r} is not in {artifacts}")
    found = sha256_file(tar)
    if found != manifest["tarball_sha256"]:
        raise Refused(f"{tar.name}: sha256 expected {manifest['tarball_sha256']} (the manifest), found {found}")
    sums = read_sums(artifacts / SUMS)
    n = inspect(tar, sums, manifest)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rig-verify-", dir=dest))
    try:
        _extract_hashed(tar, tmp, sums)
        for name in sorted(sums):  # every file checked: now, and only now, into place
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / name, dest / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n


def _extract_hashed(tar: Path, tmp: Path, sums: dict[str, str]) -> None:
    """Extract into ``tmp`` member by member through tarfile's ``data`` filter, hashing as each file is written."""
    try:
        with _open_tar(tar) as tf:
            for member in tf:
                m = tarfile.data_filter(member, str(tmp))  # raises on anything the filter refuses
                path = tmp / m.name
                if m.isdir():
                    path.mkdir(parents=True, exist_ok=True)
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                assert src is not None
                h = hashlib.sha256()
                with open(path, "wb") as out:
                    while chunk := src.read(1 << 20):
                        h.update(chunk)
                        out.write(chunk)
                os.chmod(path, m.mode if m.mode is not None else 0o644)
                if h.hexdigest() != sums[m.name]:
                    raise Refused(f"{tar.name}: member {m.name!r} has sha256 {h.hexdigest()}, {SUMS} says "
                                  f"{sums[m.name]}")
    except tarfile.TarError as exc:
        raise Refused(f"{tar.name}: extraction refused ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m rig.artifacts", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check a kernels tarball against a target and install it")
    v.add_argument("--artifacts", type=Path, required=True, help="the folder with manifest.toml, ops.sha256, ops.tar.*")
    v.add_argument("--dest", type=Path, required=True, help="the source tree to install the kernels into")
    for key in ("device", "ops-obj", "tree", "arch", "python", "cuda", "torch"):
        v.add_argument(f"--{key}", help=f"the target's {key} (checked against the manifest)")
    a = ap.parse_args(argv)
    target = {"device": a.device, "ops_obj": a.ops_obj, "tree": a.tree, "arch": a.arch, "python": a.python,
              "cuda": a.cuda, "torch": a.torch}
    def go() -> int:
        n = verify(a.artifacts, a.dest, target)
        print(f"verified and installed {n} files into {a.dest}")
        return 0

    return guard(go)


if __name__ == "__main__":
    raise SystemExit(main())
