"""One build at a time: the locks every command that writes the build's files holds (build, verify, start's
build, patches new).

A lock sits beside what it protects: the venv and the tree each have one (``.venv.build.lock`` beside
``.venv``), and the state folder has its own for the records. Two state folders on one checkout share the
venv and the tree, so they share those locks too, and never install into the same venv at once.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
from pathlib import Path
from typing import IO

from rig.base.errors import BadInput, problem
from rig.facts.config import Settings

SUFFIX = ".build.lock"


def lock_paths(s: Settings) -> list[Path]:
    """The lock files of one build, in the order they are taken: the state's, the venv's, the tree's."""
    beside = [d.parent / f"{d.name}{SUFFIX}" for d in (s.venv_dir, s.vllm_dir)]
    out = [s.state_dir / "build.lock"]
    for p in beside:
        if p not in out:
            out.append(p)
    return out


class BuildLock:
    """One build at a time: an exclusive flock on each of :func:`lock_paths`.

    Each lock file names its holder, so a second caller is told who holds which. The kernel drops a lock when
    its holder dies, so a crash never wedges it.
    """

    def __init__(self, s: Settings, what: str) -> None:
        self.paths = lock_paths(s)
        self.what = what
        self._held: list[IO[str]] = []

    def _take(self, path: Path) -> IO[str]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "an unknown process"
            fh.close()
            raise BadInput(problem(f"the build lock {path}", "free", f"held by {holder}",
                                   "wait for that build to finish (or stop it), then run again")) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} ({self.what}, since {dt.datetime.now():%Y-%m-%d %H:%M:%S})\n")
        fh.flush()
        return fh

    def __enter__(self) -> BuildLock:
        try:
            for p in self.paths:
                self._held.append(self._take(p))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self._held:
            fh = self._held.pop()
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()


def held_alone(path: Path, item: str, holder: str, fix: str) -> IO[str]:
    """An exclusive flock on ``path`` taken at once, or exit 2 naming ``item``, who ``holder`` is and the ``fix``;
    the kernel drops it with the returned file (close it, or use it in a ``with``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise BadInput(problem(item, "free", f"{holder} holds {path}", fix)) from None
    return fh
