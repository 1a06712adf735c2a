"""How the rig talks: step headers, indented detail lines, warnings, errors, and the one exit path."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rig.base.errors import RigError

INDENT = "      "


def say(msg: str, *, err: bool = False) -> None:
    """A detail line under the current step header (``err``: on stderr, e.g. a check that failed)."""
    print(f"{INDENT}{msg}", file=sys.stderr if err else sys.stdout, flush=True)


def warn(msg: str) -> None:
    """A warning: something works, but not as well as it could."""
    print(f"{INDENT}warning: {msg}", file=sys.stderr, flush=True)


def quote(line: str, *, err: bool = False) -> None:
    """A line of another program's output (a compile, the engine's last words), marked as quoted."""
    print(f"{INDENT}| {line}", file=sys.stderr if err else sys.stdout, flush=True)


def plain(line: str) -> None:
    """A line that is the command's product (a table, the log reader's lines): stdout, as it is."""
    print(line, flush=True)


def note(msg: str) -> None:
    """A plain line on stderr beside a command's product: a summary (the build's time, a lock written)."""
    print(msg, file=sys.stderr, flush=True)


def stamped(msg: str) -> None:
    """A line of a background process's own log, with the date and time."""
    print(f"{time.strftime('%F %T')} {msg}", flush=True)


def echo(raw: bytes) -> None:
    """Another program's output passed through byte for byte (the engine's, when it has no log file)."""
    sys.stdout.buffer.write(raw)
    sys.stdout.buffer.flush()


def header(n: int, total: int, name: str, summary: str) -> None:
    print(f"[{n}/{total}] {name} — {summary}", flush=True)


def fact(key: str, value: object) -> None:
    """A machine-readable ``key: value`` line at the end of a step."""
    print(f"{key}: {value}", flush=True)


def error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def guard(fn: Callable[[], int]) -> int:
    """Run an entry point: a :class:`RigError` becomes one ``error:`` line and its exit code (2 bad input, 1 the
    work failed); Ctrl-C becomes 130. Every command of the rig ends through here."""
    try:
        return fn()
    except RigError as exc:
        error(exc.message)
        return exc.code
    except KeyboardInterrupt:
        error("interrupted; nothing half-done is trusted by the next run")
        return 130
