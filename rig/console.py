"""How the rig talks: step headers, indented detail lines, warnings, errors, and the one exit path."""

from __future__ import annotations

import sys
from collections.abc import Callable

from rig.errors import RigError

INDENT = "      "


def say(msg: str) -> None:
    """A detail line under the current step header."""
    print(f"{INDENT}{msg}", flush=True)


def warn(msg: str) -> None:
    """A warning: something works, but not as well as it could."""
    print(f"{INDENT}warning: {msg}", file=sys.stderr, flush=True)


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
