"""tarfile's ``data`` extraction filter on every Python the rig runs on.

The filter (and ``TarInfo.replace``) came in 3.11.4; Debian 12's ``python3`` is 3.11.2, and on a fresh box the
rig's own session runs on it. Where tarfile has the filter it is used as is; elsewhere the same rules are applied
here: no absolute names, nothing written or linked outside the destination, no device or other special files,
no setuid/setgid/sticky or group/other write bits, no owners taken from the archive. Standard library only.
"""

from __future__ import annotations

import copy
import os
import stat
import tarfile
from collections.abc import Iterable
from typing import Any

NATIVE = hasattr(tarfile, "data_filter")


class Unsafe(ValueError):
    """A member the ``data`` filter refuses: the message names it and why."""


def renamed(member: tarfile.TarInfo, **changes: Any) -> tarfile.TarInfo:
    """A copy of ``member`` with ``changes`` (``TarInfo.replace``, which 3.11.2 lacks)."""
    if hasattr(member, "replace"):
        return member.replace(**changes, deep=False)
    new = copy.copy(member)
    for key, value in changes.items():
        setattr(new, key, value)
    return new


def _outside(path: str, dest: str) -> bool:
    return os.path.commonpath([path, dest]) != dest


def _fallback(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """The ``data`` filter's rules for a Python without it."""
    root = os.path.realpath(dest)
    name = member.name.lstrip("/" + os.sep)
    if os.path.isabs(name):
        raise Unsafe(f"{member.name!r} is an absolute path")
    target = os.path.realpath(os.path.join(root, name))
    if _outside(target, root):
        raise Unsafe(f"{member.name!r} would be extracted to {target!r}, outside the destination")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise Unsafe(f"{member.name!r} is a special file")
    if member.issym() or member.islnk():
        if os.path.isabs(member.linkname):
            raise Unsafe(f"{member.name!r} is a link to an absolute path ({member.linkname!r})")
        base = os.path.dirname(target) if member.issym() else root
        if _outside(os.path.realpath(os.path.join(base, member.linkname)), root):
            raise Unsafe(f"{member.name!r} is a link to {member.linkname!r}, outside the destination")
    mode = member.mode
    if member.isreg() or member.islnk():
        mode = (mode & 0o755) | 0o600  # owner can read and write; no group/other write, no special bits
        if not mode & stat.S_IXUSR:
            mode &= ~0o111
    else:
        mode = (mode & 0o755) | 0o700
    # -1 and no names: tarfile's chown (as root) leaves the owner as the extracting user
    return renamed(member, name=name, mode=mode, uid=-1, gid=-1, uname="", gname="")


def data_filter(member: tarfile.TarInfo, dest: str | os.PathLike[str]) -> tarfile.TarInfo:
    """``member`` as the ``data`` filter would extract it into ``dest``; raises ``Unsafe`` for what it refuses."""
    if not NATIVE:
        return _fallback(member, os.fspath(dest))
    try:
        return tarfile.data_filter(member, os.fspath(dest))
    except tarfile.FilterError as exc:
        raise Unsafe(str(exc)) from None


def extract_all(tf: tarfile.TarFile, dest: str | os.PathLike[str], members: Iterable[tarfile.TarInfo]) -> None:
    """Extract ``members`` into ``dest`` through the ``data`` filter; raises ``Unsafe`` at the first it refuses.
    Each member is checked just before it is written, so a link extracted earlier is followed as it now is."""
    if NATIVE:
        try:
            tf.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as exc:
            raise Unsafe(str(exc)) from None
        return
    for m in members:
        tf.extract(_fallback(m, os.fspath(dest)), dest)
