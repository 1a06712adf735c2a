"""One build at a time: the lock every command that writes the build's files holds (build, verify, start's
build, patches new)."""

from __future__ import annotations

import datetime as dt
import fcntl
import os

from rig.config import Settings
from rig.errors import BadInput, problem


class BuildLock:
    """One build at a time: an exclusive flock on ``.rig/build.lock``.

    The lock file names the holder, so a second caller is told who holds it.
    The kernel drops the lock when the holder dies, so a crash never wedges it.
    """

    def __init__(self, s: Settings, what: str) -> None:
        self.path = s.state_dir / "build.lock"
        self.what = what
        self._fh = None

    def __enter__(self) -> BuildLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "an unknown process"
            fh.close()
            raise BadInput(problem(f"the build lock {self.path}", "free", f"held by {holder}",
                                   "wait for that build to finish (or stop it), then run again")) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} ({self.what}, since {dt.datetime.now():%Y-%m-%d %H:%M:%S})\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc) -> None:
        if self._fh:
            self._fh.seek(0)
            self._fh.truncate()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
