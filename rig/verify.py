"""Verify a kernels tarball against what this tree needs, then install it all or nothing.

The gate of the container build and of ``nox -s verify``, so it needs only
Python's standard library (plus the ``zstd`` program for a ``.tar.zst``).
What the tarball says about itself (its manifest, its sha256 list) is checked,
but it is never the only word:

* the file set is compared with this tree's kernels (:class:`Expected`): the
  ops step's record of a build here, or the precompiled route's list that
  ``./build.sh`` keeps beside the series, made from the pinned wheel: every
  file there, nothing else, each of its sha256 and size;
* sizes are bounded without the manifest: by those sizes, or else by a
  ratio to the tarball's own size, and by the free disk;
* members are inspected before anything is extracted (regular files and
  folders only, clean names, no duplicates, no name that is both a file and
  a folder), then extracted through tarfile's ``data`` filter into a
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
import tomllib
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from rig import atomic
from rig.artifacts import MANIFEST, SUMS, TARBALLS, Refused, _clean, check_target, read_manifest, read_sums
from rig.errors import WorkFailed
from rig.hashing import sha256_file
from rig.proc import alive

#: The most a kernel tarball may expand, when no expected sizes are known: shared objects and sources
#: compress 3 to 6 times; a member that goes past this is a decompression bomb, not kernels.
RATIO = 50
#: What the tar stream may hold after its end marker: tar pads to its record size (10 KiB by default).
TRAILER = 64 << 10
SCRATCH = ".rig-verify-"
CHUNK = 1 << 20


@dataclass(frozen=True)
class Expected:
    """This tree's kernels: name -> (sha256, size), the route they are made by, and where that was read."""

    source: str
    route: str
    files: dict[str, tuple[str, int]]
    wheel_sha256: str = ""  # a precompiled list's: the wheel its kernels came from


def read_expected(path: Path) -> Expected:
    """The ops step's record (``vllm/.build-products``, TOML) or a precompiled list (``sha256 size name`` lines
    under ``# key: value`` headers)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise Refused(f"{path}: the list of this tree's kernels cannot be read ({exc.strerror})") from None
    try:
        rec = tomllib.loads(text)  # the ops step's record is TOML; a list is not
    except tomllib.TOMLDecodeError:
        rec = None
    if rec is not None:
        try:
            files = {n: (str(f["sha256"]), int(f["size"])) for n, f in rec["files"].items()}
            return Expected(str(path), str(rec["facts"]["route"]), files)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise Refused(f"{path}: not the ops step's record of its products. Fix: ./build.sh") from None
    lines = text.splitlines()
    head = _header(lines)
    files = {}
    for n, line in enumerate(lines, 1):
        if line.startswith("#"):
            continue
        parts = line.split(" ", 2)
        if len(parts) != 3 or len(parts[0]) != 64 or not parts[1].isdigit():
            raise Refused(f"{path}:{n}: expected '<sha256> <size> <path>', found {line[:80]!r}")
        files[parts[2]] = (parts[0], int(parts[1]))
    return Expected(str(path), head.get("route", "precompiled"), files, head.get("wheel_sha256", ""))


def _header(lines: Iterable[str]) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a precompiled list."""
    head = {}
    for line in lines:
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].partition(":")
        if sep:
            head[key.strip()] = value.strip()
    return head


def list_path(patches_dir: Path, device: str) -> Path:
    """Where the precompiled route's list of kernels for ``device`` is kept: beside the series."""
    return Path(patches_dir) / "precompiled" / f"{device}.list"


def write_list(path: Path, device: str, wheel_sha256: str, files: dict[str, tuple[str, int]]) -> None:
    """The precompiled route's list of kernels, written atomically."""
    lines = [f"# The kernels the precompiled route installs for DEVICE={device}: sha256, size, path in the tree.",
             "# ./build.sh writes it from the wheel below; verify checks a tarball's files against it.",
             "# route: precompiled", f"# device: {device}", f"# wheel_sha256: {wheel_sha256}"]
    lines += [f"{sha} {size} {name}" for name, (sha, size) in sorted(files.items())]
    atomic.write_text(path, "\n".join(lines) + "\n")


def list_header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a precompiled list, read alone (empty when there is none)."""
    try:
        with open(path) as fh:
            return _header(fh)
    except OSError:
        return {}


# -- reading the tarball ----------------------------------------------------------------------------------


@contextmanager
def _stream(path: Path) -> Iterator[IO[bytes]]:
    """The tarball's decompressed bytes. When reading fails, the decompressor's own error is the cause reported,
    never the SIGPIPE it gets when the reader stops early."""
    if not path.name.endswith(".zst"):
        with gzip.open(path, "rb") as fh:
            yield fh
        return
    zstd = shutil.which("zstd")
    if not zstd:
        raise Refused(f"{path.name}: needs the zstd program to read (apt-get install -y zstd)")
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
                raise Refused(f"{path.name}: truncated or corrupt ({cause})") from None
            raise
        except BaseException:  # a refusal of ours, or an interrupt: zstd's SIGPIPE is not the news
            proc.kill()
            proc.stdout.close()
            proc.wait()
            raise
        proc.stdout.close()
        if cause := zstd_failed():
            raise Refused(f"{path.name}: truncated or corrupt ({cause})")


@contextmanager
def open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    """The tarball as a stream of members; data after the tar's end beyond its padding is refused unread."""
    with _stream(path) as raw:
        with tarfile.open(fileobj=raw, mode="r|", bufsize=CHUNK) as tf:
            yield tf
        after = 0
        while chunk := raw.read(CHUNK):
            after += len(chunk)
            if after > TRAILER:
                raise Refused(f"{path.name}: more than {TRAILER >> 10} KiB of data after the tar's end (expected "
                              "only its padding). Fix: pack again with nox -s pack")


def _corrupt(tar: Path, exc: BaseException) -> Refused:
    return Refused(f"{tar.name}: truncated or corrupt ({type(exc).__name__}: {exc})")


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
                if not m.isfile():
                    continue
                if name not in sums:
                    raise Refused(f"{tar.name}: member {m.name!r} is not in {SUMS}")
                files.add(name)
                size += m.size
                if expected is not None and name in expected.files and m.size != expected.files[name][1]:
                    raise Refused(f"{tar.name}: member {m.name!r} is {m.size} bytes; this tree's kernel is "
                                  f"{expected.files[name][1]} bytes ({expected.source})")
                if len(files) > manifest["files"] or size > manifest["bytes"]:
                    raise Refused(f"{tar.name}: member {m.name!r} goes past the manifest's totals "
                                  f"({manifest['files']} files, {manifest['bytes']} bytes)")
                if size > bound:
                    raise Refused(f"{tar.name}: member {m.name!r} takes the unpacked size past {RATIO} times the "
                                  f"tarball's {tar.stat().st_size} bytes: not a kernels tarball")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(tar, exc) from None
    for name in sorted(files):
        clash = next((p for p in _parents(name) if p in files), None)
        if clash:
            raise Refused(f"{tar.name}: {clash!r} is both a file and the folder of {name!r}")
    missing = sorted(set(sums) - files)
    if missing:
        raise Refused(f"{tar.name}: {missing[0]} is in {SUMS} but not in the tarball"
                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return len(files)


# -- the set, the destination, the install -----------------------------------------------------------------


def check_set(sums: dict[str, str], expected: Expected) -> None:
    """The tarball's list against this tree's kernels: every file there, nothing else, the same sha256."""
    missing = sorted(set(expected.files) - set(sums))
    extra = sorted(set(sums) - set(expected.files))
    more = lambda xs: f" (and {len(xs) - 1} more)" if len(xs) > 1 else ""  # noqa: E731
    if missing:
        raise Refused(f"{SUMS}: {missing[0]}{more(missing)} is a kernel of this tree ({expected.source}) but not in "
                      "the tarball. Fix: pack again from a complete build (nox -s pack -- --force)")
    if extra:
        raise Refused(f"{SUMS}: {extra[0]}{more(extra)} is in the tarball but is not a kernel of this tree "
                      f"({expected.source}). Fix: pack again from a build of this tree")
    for name in sorted(sums):
        if sums[name] != expected.files[name][0]:
            raise Refused(f"{SUMS}: {name}: sha256 expected {expected.files[name][0]} ({expected.source}), found "
                          f"{sums[name]}. Fix: pack again from a build of this tree")


def check_names(names: list[str], dest: Path) -> None:
    """Without an expected set: kernels live in the package folder, and never replace a file git tracks."""
    outside = [n for n in names if not n.startswith("vllm/")]
    if outside:
        raise Refused(f"{SUMS}: {outside[0]} is outside the package folder vllm/, where every kernel lives")
    if not (dest / ".git").exists() or not shutil.which("git"):
        return
    out = subprocess.run(["git", "-C", str(dest), "ls-files", "-z", "--", "vllm"], capture_output=True)
    tracked = set(out.stdout.decode(errors="replace").split("\0")) & set(names) if out.returncode == 0 else set()
    if tracked:
        raise Refused(f"{SUMS}: {sorted(tracked)[0]} is a source file of the tree (git tracks it), not a kernel: "
                      "verify never overwrites the tree's sources")


def check_dest(dest: Path, names: list[str]) -> None:
    """Nothing in the destination may stop a file from moving in: a folder where it goes, a file where its
    folder goes, or a link on its way (a link would take the write out of the tree)."""
    for name in names:
        for parent in reversed(_parents(name)):
            p = dest / parent
            if p.is_symlink():
                raise Refused(f"{dest}: {parent} is a link; verify installs only into real folders of the tree. "
                              "Fix: replace the link with a folder")
            if p.exists() and not p.is_dir():
                raise Refused(f"{dest}: {parent} is a file where the folder of {name} goes. Fix: move it away")
        p = dest / name
        if p.is_dir() and not p.is_symlink():
            raise Refused(f"{dest}: {name} is a folder where the tarball's file goes. Fix: move it away")


def check_space(dest: Path, need: int) -> None:
    where = next((p for p in (dest, *dest.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    if need > free:
        raise WorkFailed(f"{where}: the kernels need {need / 1e6:.0f} MB, {free / 1e6:.0f} MB is free. Fix: free "
                         "space there, then verify again; nothing was installed")


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
    """Extract into ``tmp`` member by member through tarfile's ``data`` filter, hashing as each file is written."""
    try:
        with open_tar(tar) as tf:
            for member in tf:
                m = tarfile.data_filter(member, str(tmp))  # raises on anything the filter refuses
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
                        raise WorkFailed(f"{tmp.parent}: the disk filled while writing {m.name} ({exc.strerror}). "
                                         "Fix: free space there, then verify again; nothing was installed") from None
                    raise WorkFailed(f"{path}: cannot write ({exc.strerror}); nothing was installed") from None
                if h.hexdigest() != sums[m.name]:
                    raise Refused(f"{tar.name}: member {m.name!r} has sha256 {h.hexdigest()}, {SUMS} says "
                                  f"{sums[m.name]}")
    except tarfile.FilterError as exc:
        raise Refused(f"{tar.name}: extraction refused ({exc})") from None
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
            raise WorkFailed(f"{dest}: installing {len(names)} files failed at {len(moved) + 1} ({exc.strerror}); "
                             "every file was put back as it was") from None
        raise


def verify(artifacts: Path, dest: Path, target: dict[str, str | None], expected: Expected | None = None,
           say=lambda msg: None) -> tuple[int, str]:
    """Check the set in ``artifacts`` against ``target`` and ``expected``, and install it under ``dest``.

    Returns the file count and what the file set was checked against.
    """
    manifest = read_manifest(artifacts / MANIFEST)
    check_target(manifest, target)
    tar = artifacts / str(manifest["tarball"])
    if manifest["tarball"] not in TARBALLS or not tar.exists():
        raise Refused(f"{MANIFEST}: tarball {manifest['tarball']!r} is not in {artifacts}")
    found = sha256_file(tar)
    if found != manifest["tarball_sha256"]:
        raise Refused(f"{tar.name}: sha256 expected {manifest['tarball_sha256']} (the manifest), found {found}")
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
