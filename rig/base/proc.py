"""Long-running commands: their output shown and logged, and a status line at an interval.

A 20-minute compile or a several-GB download must never look hung: every
``interval`` seconds a status line says how long it has run and what it did
last (the caller decides what that is). Also :func:`alive`, the one liveness check of a pid (standard
library only: verify in the bare image uses it).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from rig.base.console import quote, say

Status = Callable[[float, list[str]], str]


def watch(cmd: list[str], *, status: Status, interval: float, env: Mapping[str, str] | None = None,
          cwd: Path | None = None, log: IO[str] | None = None, keep: int = 400) -> tuple[int, list[str]]:
    """Run ``cmd``; show each line (and write it to ``log``); return the exit code and the last lines."""
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=keep)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval):
            say(status(time.monotonic() - start, list(tail)))

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dict(env) if env is not None else None, cwd=cwd, errors="replace")
    t = threading.Thread(target=beat, daemon=True)
    t.start()
    assert proc.stdout
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if log:
                log.write(line + "\n")
            if line.strip():
                quote(line)
        code = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    finally:
        done.set()
        t.join()
    return code, list(tail)


def alive(pid: int) -> bool:
    """Whether a process of that pid runs (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
