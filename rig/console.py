"""How the rig talks: step headers, indented detail lines, warnings, errors."""

from __future__ import annotations

import sys

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
