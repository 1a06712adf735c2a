"""Atomic file writes: a temporary name in the same folder, then a rename.

A reader (or a later run) sees either the old complete file or the new one,
never a half-written file, even after a kill -9 or a full disk.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def atomic_open(path: Path, mode: str = "w", perms: int = 0o644) -> Iterator[IO]:
    """Open a temporary sibling of ``path``; rename it over ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text(path: Path, text: str, perms: int = 0o644) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w", perms) as fh:
        fh.write(text)


def write_bytes(path: Path, data: bytes, perms: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb", perms) as fh:
        fh.write(data)
