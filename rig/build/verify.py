"""Verify a kernels tarball against what this tree needs, then install it all or nothing.

The gate of the container build and of ``nox -s verify``, so it needs only
Python's standard library (plus the ``zstd`` program for a ``.tar.zst``).
What the tarball says about itself (its manifest, its sha256 list) is checked,
but it is never the only word:

* the file set is compared with this tree's kernels (rig/build/kernels/expected.py): the
  ops step's record of a build here, or the precompiled route's list that
  ``./build.sh`` keeps beside the series, made from the pinned wheel: every
  file there, nothing else, each of its sha256 and size;
* sizes are bounded without the manifest: by those sizes, or else by a
  ratio to the tarball's own size, and by the free disk;
* members are inspected before anything is extracted (regular files and
  folders only, clean names, no duplicates, no name that is both a file and
  a folder), then extracted through tarfile's ``data`` filter (rig.base.tarsafe) into a
  scratch folder and re-hashed. CPython 3.11.7 and 3.13.0 predate the 2025
  fixes for tar-filter bypasses: the inspection is what makes this safe;
* the destination is checked (no folder where a file goes, no link on the
  way out of it), and the files move in with the ones they replace kept
  aside, so a failure midway puts everything back.

A verify that was killed leaves its scratch folder named by its pid; the next
verify removes it and says so.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO

from rig.base import tarsafe
from rig.base.errors import WorkFailed, problem
from rig.base.hashing import sha256_file
from rig.base.proc import alive
from rig.build.artifacts import MANIFEST, SUMS, TARBALLS, Refused, check_target, clean_name, read_manifest, read_sums
from rig.build.kernels.expected import Expected

#: The most a kernel tarball may expand, when no expected sizes are known: shared objects and sources
#: compress 3 to 6 times; a member that goes past this is a decompression bomb, not kernels.
RATIO = 50
#: What the tar stream may hold after its end marker: tar pads to its record size (10 KiB by default).
TRAILER = 64 << 10
SCRATCH = ".rig-verify-"
CHUNK = 1 << 20
REPACK = "pack again with nox -s pack, and copy the whole artifacts/ folder"
AGAIN = "free space there, then verify again; nothing was installed"


# -- reading the tarball ----------------------------------------------------------------------------------


@contextmanager
def decompressed(path: Path) -> Iterator[IO[bytes]]:
    """The tarball's decompressed bytes. When reading fails, the decompressor's own error is the cause reported,
    never the SIGPIPE it gets when the reader stops early."""
    if not path.name.endswith(".zst"):
        with gzip.open(path, "rb") as fh:
            yield fh
        return
    zstd = shutil.which("zstd")
    if not zstd:  # a GPU box may have no zstd program: the zstandard module, where it is importable
        with _module_stream(path) as fh:
            yield fh
        return
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([zstd, "-dc", "-q", str(path)], stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout

        def zstd_failed() -> str:
            code = proc.wait()
            if code in (0, -signal.SIGPIPE):  # -SIGPIPE: we stopped reading, zstd did not fail
                return ""
            err.seek(0)
            return err.read().decode(errors="replace").strip() or f"zstd exit {code}"

        try:
            yield proc.stdout
        except (tarfile.TarError, EOFError):  # the stream ended early or is garbage: zstd knows why
            proc.stdout.close()
            if cause := zstd_failed():
                raise _corrupt(path, cause) from None
            raise
        except BaseException:  # a refusal of ours, or an interrupt: zstd's SIGPIPE is not the news
            proc.kill()
            proc.stdout.close()
            proc.wait()
            raise
        proc.stdout.close()
        if cause := zstd_failed():
            raise _corrupt(path, cause)


@contextmanager
def _module_stream(path: Path) -> Iterator[IO[bytes]]:
    """The tarball's bytes through the ``zstandard`` module, where no zstd program is on PATH."""
    try:
        import zstandard  # optional: only where no zstd program is installed
    except ImportError:
        raise Refused(problem(path.name, "the zstd program (or Python's zstandard module) to read it", "neither",
                              "apt-get install -y zstd")) from None
    with open(path, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh, read_size=CHUNK,
                                                                            read_across_frames=True) as raw:
        try:
            yield raw
        except zstandard.ZstdError as exc:
            raise _corrupt(path, str(exc)) from None


@contextmanager
def open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    """The tarball as a stream of members; data after the tar's end beyond its padding is refused unread."""
    with decompressed(path) as raw:
        with tarfile.open(fileobj=raw, mode="r|", bufsize=CHUNK) as tf:
            yield tf
        after = 0
        while chunk := raw.read(CHUNK):
            after += len(chunk)
            if after > TRAILER:
                raise Refused(problem(path.name, "only the tar's padding after its end", f"more than "
                                      f"{TRAILER >> 10} KiB of data after the tar's end", REPACK))


def _corrupt(tar: Path, cause: BaseException | str) -> Refused:
    why = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
    return Refused(problem(tar.name, "a whole tarball", f"one truncated or corrupt ({why})", REPACK))


def _member(tar: Path, name: str, expected: str, found: str) -> Refused:
    return Refused(problem(f"{tar.name}: member {name!r}", expected, found, REPACK))


def _parents(name: str) -> list[str]:
    return [str(p) for p in PurePosixPath(name).parents if str(p) != "."]


def inspect(tar: Path, sums: dict[str, str], manifest: dict, expected: Expected | None = None) -> int:
    """Check every member header before anything is extracted; return the file count.

    Sizes: each file's must be the expected one; without an expected set, the total may not pass
    :data:`RATIO` times the tarball's size (nor the manifest's totals).
    """
    seen: set[str] = set()
    files: set[str] = set()
    size = 0
    bound = RATIO * tar.stat().st_size + CHUNK
    try:
        with open_tar(tar) as tf:
            for m in tf:
                name = m.name.rstrip("/") if m.isdir() else m.name
                kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev() and not
                        m.isfifo() else "FIFO" if m.isfifo() else None)
                if kind:
                    raise _member(tar, m.name, "a regular file or folder", f"a {kind}")
                if not (m.isfile() or m.isdir()):
                    raise _member(tar, m.name, "a regular file or folder", f"type {m.type!r}")
                if not clean_name(name):
                    raise _member(tar, m.name, "a clean relative name", "an absolute name, '..' or odd characters")
                if name in seen:
                    raise _member(tar, m.name, "each member once", "it appears twice")
                seen.add(name)
                if not m.isfile():
                    continue
                if name not in sums:
                    raise _member(tar, m.name, f"a file {SUMS} lists", f"it is not in {SUMS}")
                files.add(name)
                size += m.size
                if expected is not None and name in expected.files and m.size != expected.files[name][1]:
                    raise _member(tar, m.name, f"{expected.files[name][1]} bytes, this tree's kernel "
                                  f"({expected.source})", f"{m.size} bytes")
                if len(files) > manifest["files"] or size > manifest["bytes"]:
                    raise _member(tar, m.name, f"at most the manifest's totals ({manifest['files']} files, "
                                  f"{manifest['bytes']} bytes)", f"{len(files)} files, {size} bytes with it")
                if size > bound:
                    raise _member(tar, m.name, f"an unpacked size of at most {RATIO} times the tarball's "
                                  f"{tar.stat().st_size} bytes", f"{size} bytes with it: not a kernels tarball")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(tar, exc) from None
    for name in sorted(files):
        clash = next((p for p in _parents(name) if p in files), None)
        if clash:
            raise Refused(problem(f"{tar.name}: {clash!r}", "a file or a folder",
                                  f"both a file and the folder of {name!r}", REPACK))
    missing = sorted(set(sums) - files)
    if missing:
        raise Refused(problem(tar.name, f"every file {SUMS} lists", f"{missing[0]}{_more(missing)} not in the "
                              "tarball", REPACK))
    return len(files)


# -- the set, the destination, the install -----------------------------------------------------------------


def _more(items: list[str]) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def check_set(sums: dict[str, str], expected: Expected) -> None:
    """The tarball's list against this tree's kernels: every file there, nothing else, the same sha256."""
    missing = sorted(set(expected.files) - set(sums))
    extra = sorted(set(sums) - set(expected.files))
    if missing:
        raise Refused(problem(SUMS, f"every kernel of this tree ({expected.source})", f"{missing[0]}"
                              f"{_more(missing)} not in the tarball", "pack again from a complete build (nox -s "
                              "pack -- --force)"))
    if extra:
        raise Refused(problem(SUMS, f"only the kernels of this tree ({expected.source})", f"{extra[0]}"
                              f"{_more(extra)}, which is not one of them", "pack again from a build of this tree"))
    for name in sorted(sums):
        if sums[name] != expected.files[name][0]:
            raise Refused(problem(f"{SUMS}: {name}", f"sha256 {expected.files[name][0]} ({expected.source})",
                                  sums[name], "pack again from a build of this tree"))


def check_names(names: list[str], dest: Path) -> None:
    """Without an expected set: kernels live in the package folder, and never replace a file git tracks."""
    outside = [n for n in names if not n.startswith("vllm/")]
    if outside:
        raise Refused(problem(f"{SUMS}: {outside[0]}", "a file in the package folder vllm/, where every kernel "
                              "lives", "a file outside it", "pack again from a build (nox -s pack)"))
    if not (dest / ".git").exists() or not shutil.which("git"):
        return
    out = subprocess.run(["git", "-C", str(dest), "ls-files", "-z", "--", "vllm"], capture_output=True)
    tracked = set(out.stdout.decode(errors="replace").split("\0")) & set(names) if out.returncode == 0 else set()
    if tracked:
        raise Refused(problem(f"{SUMS}: {sorted(tracked)[0]}", "a kernel (a file git does not track)",
                              "a source file of the tree (git tracks it)", "pack again from a build of this tree; "
                              "verify never overwrites the tree's sources"))


def check_dest(dest: Path, names: list[str]) -> None:
    """Nothing in the destination may stop a file from moving in: a folder where it goes, a file where its
    folder goes, or a link on its way (a link would take the write out of the tree)."""
    for name in names:
        for parent in reversed(_parents(name)):
            p = dest / parent
            if p.is_symlink():
                raise Refused(problem(f"{dest}: {parent}", "a real folder of the tree (verify installs only into "
                                      "those)", "a link", "replace the link with a folder"))
            if p.exists() and not p.is_dir():
                raise Refused(problem(f"{dest}: {parent}", f"the folder of {name}", "a file", "move it away"))
        p = dest / name
        if p.is_dir() and not p.is_symlink():
            raise Refused(problem(f"{dest}: {name}", "a file, or nothing (the tarball's file goes there)",
                                  "a folder", "move it away"))


def free_space(path: Path) -> tuple[Path, int]:
    """The folder at or above ``path`` that exists (``path`` may not yet), and the bytes free on its disk."""
    where = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    return where, shutil.disk_usage(where).free


def check_space(dest: Path, need: int) -> None:
    where, free = free_space(dest)
    if need > free:
        raise WorkFailed(problem(f"{where}", f"{need / 1e6:.0f} MB free for the kernels", f"{free / 1e6:.0f} MB "
                                 "free", AGAIN))


def clean_scratch(dest: Path) -> list[Path]:
    """Remove the scratch folders of verifies that were killed (their pid is gone); return them."""
    gone = []
    for d in dest.glob(f"{SCRATCH}*"):
        pid = d.name[len(SCRATCH):]
        if pid.isdigit() and alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _extract_hashed(tar: Path, tmp: Path, sums: dict[str, str]) -> None:
    """Extract into ``tmp`` member by member through tarfile's ``data`` filter (rig.base.tarsafe), hashing as each
    file is written."""
    try:
        with open_tar(tar) as tf:
            for member in tf:
                m = tarsafe.data_filter(member, tmp)  # raises on anything the filter refuses
                path = tmp / m.name
                if m.isdir():
                    path.mkdir(parents=True, exist_ok=True)
                    continue
                src = tf.extractfile(member)
                assert src is not None
                h = hashlib.sha256()
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "wb") as out:
                        while chunk := src.read(CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                    os.chmod(path, m.mode if m.mode is not None else 0o644)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise WorkFailed(problem(f"{tmp.parent}", "room for the kernels", f"the disk filled while "
                                                 f"writing {m.name} ({exc.strerror})", AGAIN)) from None
                    raise WorkFailed(problem(f"{path}", "a file verify can write", f"{exc.strerror}", "check the "
                                             "folder's owner and mode, then verify again; nothing was installed")
                                     ) from None
                if h.hexdigest() != sums[m.name]:
                    raise _member(tar, m.name, f"sha256 {sums[m.name]} ({SUMS})", h.hexdigest())
    except tarsafe.Unsafe as exc:
        raise Refused(problem(tar.name, "members tarfile's data filter accepts", f"one it refuses ({exc})",
                              REPACK)) from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(tar, exc) from None


def install(tmp: Path, dest: Path, names: list[str]) -> None:
    """Move every file from ``tmp`` into ``dest``, all or nothing: what a file replaces is kept aside until the
    last one is in, and put back (with the new files removed) when any move fails."""
    aside = tmp / ".replaced"
    moved: list[str] = []
    kept: list[str] = []
    made: list[Path] = []
    try:
        for name in names:
            target = dest / name
            for parent in reversed((target.parent, *target.parent.parents)):
                if parent == dest or dest in parent.parents:
                    if not parent.exists():
                        parent.mkdir()
                        made.append(parent)
            if target.exists() or target.is_symlink():
                (aside / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(target, aside / name)
                kept.append(name)
            os.replace(tmp / name, target)
            moved.append(name)
    except BaseException as exc:
        for name in moved:
            (dest / name).unlink(missing_ok=True)
        for name in kept:
            os.replace(aside / name, dest / name)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise WorkFailed(problem(f"{dest}", f"{len(names)} files installed", f"a failure at file "
                                     f"{len(moved) + 1} ({exc.strerror}); every file was put back as it was",
                                     "check the disk, then verify again")) from None
        raise


def verify(artifacts: Path, dest: Path, target: dict[str, str | None], expected: Expected | None = None,
           say: Callable[[str], None] = lambda msg: None) -> tuple[int, str]:
    """Check the set in ``artifacts`` against ``target`` and ``expected``, and install it under ``dest``.

    Returns the file count and what the file set was checked against.
    """
    manifest = read_manifest(artifacts / MANIFEST)
    check_target(manifest, target)
    tar = artifacts / str(manifest["tarball"])
    if manifest["tarball"] not in TARBALLS or not tar.exists():
        raise Refused(problem(f"{MANIFEST}: tarball", f"one of {', '.join(TARBALLS)} in {artifacts}",
                              repr(manifest["tarball"]), "copy the whole artifacts/ folder"))
    found = sha256_file(tar)
    if found != manifest["tarball_sha256"]:
        raise Refused(problem(tar.name, f"sha256 {manifest['tarball_sha256']} (the manifest's)", found, REPACK))
    sums = read_sums(artifacts / SUMS)
    names = sorted(sums)
    use = expected if expected is not None and expected.route == manifest["route"] else None
    if use is not None:
        check_set(sums, use)
        against = f"the {len(use.files)} kernels of this tree ({use.source})"
    else:
        check_names(names, dest)
        against = (f"names only: the {manifest['route']} route's files are known only after a build here"
                   if expected is None or expected.route != manifest["route"] else "")
    n = inspect(tar, sums, manifest, use)
    check_dest(dest, names)
    check_space(dest, sum(f[1] for f in use.files.values()) if use else int(manifest["bytes"]))
    dest.mkdir(parents=True, exist_ok=True)
    for gone in clean_scratch(dest):
        say(f"removed {gone}, left by a verify that was killed")
    tmp = dest / f"{SCRATCH}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _extract_hashed(tar, tmp, sums)
        install(tmp, dest, names)  # every file checked: now, and only now, into place
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n, against
