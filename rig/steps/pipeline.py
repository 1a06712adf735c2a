"""The build pipeline: steps in order, each skipped when its inputs are unchanged.

A step is a small object: a name, a one-line summary, the steps it needs, a
pure ``check`` saying whether its output is current and why (it prints nothing
and starts no program), a ``run``, and ``describe`` (the lines shown under its
header). The pipeline prints ``[n/8] name — summary``, skips current steps with
the reason, runs the others, and records each step's typed outputs in the build
record (rig/record.py, written atomically) so later steps can read them.

Facts every step may need are read once per run, through the context: the
settings (built once at the entry), series.toml and the patch files, and the uv
to use.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import functools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rig import leftovers, record, series, uv
from rig.config import Settings
from rig.console import fact, header, say
from rig.errors import BadInput, problem


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
    return Context(s, options or Options(), record.load(s.state_dir, s.device))


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


def select(steps: Sequence[Step], only: Sequence[str] | None) -> list[Step]:
    """The steps named by ``--only`` (in pipeline order), or all of them."""
    if not only:
        return list(steps)
    names = [st.name for st in steps]
    for n in only:
        if n not in names:
            raise BadInput(problem(f"--only {n}", "one of " + ", ".join(names), repr(n),
                                   "name steps from that list, comma-separated"))
    return [st for st in steps if st.name in only]


def run(steps: Sequence[Step], s: Settings, options: Options, only: Sequence[str] | None = None
        ) -> record.BuildRecord:
    """Run (or skip) the selected steps in order; return the updated record."""
    chosen = select(steps, only)
    by_name = {st.name: st for st in steps}
    from rig.steps.order import ORDER  # the one list of the steps (it imports this module)

    leftovers.clean(s, say)  # what a killed run left: the lock says no run of the rig owns it now
    ctx = context(s, options)
    total = len(ORDER)
    chosen_names = {st.name for st in chosen}
    started = time.monotonic()
    for st in chosen:
        for need in st.needs:
            if need in chosen_names:
                continue
            status = by_name[need].check(ctx)
            if not status.current:
                raise BadInput(problem(f"step {need} (needed by {st.name})", "current", status.reason,
                                       f"run it first: ./build.sh --only {need},{st.name}"))
            _keep(ctx, need, status.outputs)
        n = ORDER.index(st.name) + 1
        header(n, total, st.name, st.summary)
        t0 = time.monotonic()
        status = st.check(ctx)
        if status.current and not options.force:
            say(f"current: {status.reason}")
            outputs = status.outputs
        else:
            if not status.current:
                say(f"runs: {status.reason}")
            else:
                say("runs: --force")
            outputs = st.run(ctx)
            say(f"done in {time.monotonic() - t0:.1f} s")
        _keep(ctx, st.name, outputs)
        for line in st.describe(ctx, outputs):
            say(line)
        values = dataclasses.asdict(outputs) if dataclasses.is_dataclass(outputs) else {}
        for key in st.facts:
            if values.get(key) not in (None, ""):
                fact(key, values[key])
    print(f"build: {len(chosen)} step(s) in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return ctx.record


def first_stale(steps: Sequence[Step], s: Settings, upto: str = "install") -> tuple[str, str] | None:
    """(step, reason) of the first step up to ``upto`` whose output is not current, or None: what start asks."""
    ctx = context(s)
    if ctx.record.tools is None:
        return "tools", f"no build record at {record.path(s.state_dir, s.device)} (a first run)"
    for st in steps:
        status = st.check(ctx)
        if not status.current:
            return st.name, status.reason
        ctx.record.put(st.name, status.outputs)
        if st.name == upto:
            break
    return None


def _keep(ctx: Context, name: str, outputs: object) -> None:
    """A step's outputs into the record, written at once when they changed."""
    if outputs is not None and ctx.record.put(name, outputs):
        record.save(ctx.settings.state_dir, ctx.record, ctx.settings.device)
