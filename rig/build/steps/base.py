"""What every build step shares: its :class:`Status`, the switches (:class:`Options`), the :class:`Context` it
sees, and the :class:`Step` it is.

A step is a small object: a name, a one-line summary, the steps it needs, a
pure ``check`` saying whether its output is current and why (it prints nothing
and starts no program), a ``run``, and ``describe`` (the lines shown under its
header). rig/build/steps/pipeline.py runs the steps in the order rig/build/steps/order.py
lists them; a step imports this module, never the pipeline.

Facts every step may need are read once per run, through the context: the
settings (built once at the entry), series.toml and the patch files, and the uv
to use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from rig.facts import record, series, uv
from rig.facts.config import Settings


@dataclass
class Status:
    """Whether a step's output is current, why, and the outputs it stands on (None when not current)."""

    current: bool
    reason: str
    outputs: object | None = None


@dataclass
class Options:
    """The command-line switches a step may read."""

    force: bool = False
    accept: bool = False
    verify: bool = False
    pack: bool = True
    bytecode_from: Path | None = None  # an update's: the serving build's venv, whose bytecode the new one borrows


@dataclass
class Context:
    """What every step sees: the settings, the switches, the typed record of earlier steps, and the facts
    read at most once per run (series.toml, the patch files, the uv to use)."""

    settings: Settings
    options: Options
    record: record.BuildRecord

    @functools.cached_property
    def series(self) -> series.Series:
        return series.load(self.settings.patches_dir)

    @functools.cached_property
    def patches(self) -> list[Path]:
        return series.patch_files(self.series.patches_dir)  # series.toml first: a missing folder says so

    @functools.cached_property
    def uv(self) -> str | None:
        return uv.resolve(self.settings)


class Step:
    """One build step. Subclasses set the class attributes and implement check/run."""

    name: str = ""
    summary: str = ""
    needs: tuple[str, ...] = ()
    #: Machine-readable output fields printed as ``key: value`` after the step.
    facts: tuple[str, ...] = ()

    def check(self, ctx: Context) -> Status:  # pragma: no cover - interface
        raise NotImplementedError

    def run(self, ctx: Context) -> object:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self, ctx: Context, outputs: object) -> list[str]:
        """Lines shown under the step's header once it is current or has run (the build shows them)."""
        return []


def context(s: Settings, options: Options | None = None) -> Context:
    """The context of one run: the build record read once."""
    return Context(s, options or Options(), record.load(s.record_dir, s.device))
