"""This tree's kernels, the set a tarball must hold: the ops step's record of a build here, or the precompiled
route's list kept beside the series.

The list (``patches/precompiled/<device>.list``) is written by the ops step from the wheel series.toml pins, so
that a tree that was never built (the container) still knows its kernels. Standard library only: the
container's verify reads both before the rig's dependencies exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rig.base import atomic
from rig.base.errors import problem
from rig.build.artifacts import Refused
from rig.facts import products

REBUILD = "remove it and run ./build.sh (the ops step writes it again from the pinned wheel)"


@dataclass(frozen=True)
class Expected:
    """This tree's kernels: name -> (sha256, size), the route they are made by, and where that was read."""

    source: str
    route: str
    files: dict[str, tuple[str, int]]
    wheel_sha256: str = ""  # a precompiled list's: the wheel its kernels came from


def read_expected(path: Path) -> Expected:
    """The ops step's record (``vllm/.build-products``, JSON) or a precompiled list (``sha256 size name`` lines
    under ``# key: value`` headers)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise Refused(problem(f"{path}", "the list of this tree's kernels, readable", f"{exc.strerror}",
                              "run ./build.sh, or restore the list from git")) from None
    try:
        rec = products.loads(text)  # the ops step's record is JSON (or TOML); a list is neither
    except ValueError:  # TOMLDecodeError is one
        rec = None
    if rec is not None:
        try:
            files = {n: (str(f["sha256"]), int(f["size"])) for n, f in rec["files"].items()}
            return Expected(str(path), str(rec["facts"]["route"]), files)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise Refused(problem(f"{path}", "the ops step's record of its products (facts.route, files with "
                                  "sha256 and size)", "a TOML file of another shape", "./build.sh")) from None
    lines = text.splitlines()
    head = _header(lines)
    files = {}
    for n, line in enumerate(lines, 1):
        if line.startswith("#"):
            continue
        parts = line.split(" ", 2)
        if len(parts) != 3 or len(parts[0]) != 64 or not parts[1].isdigit():
            raise Refused(problem(f"{path}:{n}", "'<sha256> <size> <path>'", repr(line[:80]), REBUILD))
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
