"""The build pipeline: steps in order, each skipped when its inputs are unchanged.

A step is a small object: a name, a one-line summary, the steps it needs, a
``check`` saying whether its output is current (and why), and a ``run``. The
pipeline prints ``[n/8] name — summary``, skips current steps with the reason,
runs the others, and records each step's outputs in the build record
(``.rig/build.toml``, written atomically) so later steps can read them.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from rig import atomic
from rig.config import Settings
from rig.console import fact, header, say
from rig.errors import BadInput, problem

#: The eight steps of the design, in pipeline order.
ORDER = ("tools", "tree", "venv", "runtime", "toolchain", "ops", "install", "pack")


@dataclass
class Status:
    """Whether a step's output is current, why, and the outputs it stands on."""

    current: bool
    reason: str
    outputs: dict = field(default_factory=dict)


@dataclass
class Options:
    """The command-line switches a step may read."""

    force: bool = False
    accept: bool = False
    verify: bool = False
    pack: bool = True


@dataclass
class Context:
    """What every step sees: the settings, the switches, the record of earlier steps."""

    settings: Settings
    options: Options
    record: dict

    def outputs_of(self, step: str) -> dict:
        return self.record.get("steps", {}).get(step, {}).get("outputs", {})


class Step:
    """One build step. Subclasses set the class attributes and implement check/run."""

    name: str = ""
    summary: str = ""
    needs: tuple[str, ...] = ()
    #: Machine-readable output keys printed as ``key: value`` after the step.
    facts: tuple[str, ...] = ()

    def check(self, ctx: Context) -> Status:  # pragma: no cover - interface
        raise NotImplementedError

    def run(self, ctx: Context) -> dict:  # pragma: no cover - interface
        raise NotImplementedError


def record_path(s: Settings) -> Path:
    return s.state_dir / "build.toml"


def load_record(s: Settings) -> dict:
    """The build record; an unreadable one is treated as absent (and rewritten)."""
    try:
        return tomllib.loads(record_path(s).read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        return {}


def save_record(s: Settings, record: dict) -> None:
    atomic.write_text(record_path(s), "# Written by the rig after each build step.\n" + tomli_w.dumps(record))


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


def run(steps: Sequence[Step], s: Settings, options: Options, only: Sequence[str] | None = None) -> dict:
    """Run (or skip) the selected steps in order; return the updated record."""
    chosen = select(steps, only)
    by_name = {st.name: st for st in steps}
    record = load_record(s)
    ctx = Context(s, options, record)
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
            if _store(record, need, status.outputs):
                save_record(s, record)
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
        if _store(record, st.name, outputs):
            save_record(s, record)
        for key in st.facts:
            if key in outputs:
                fact(key, outputs[key])
    print(f"build: {len(chosen)} step(s) in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return record


def first_stale(steps: Sequence[Step], s: Settings, upto: str = "install") -> tuple[str, str] | None:
    """(step, reason) of the first step up to ``upto`` whose output is not current, or None: what start asks."""
    record = load_record(s)
    if not record:
        return "tools", f"no build record at {record_path(s)} (a first run)"
    ctx = Context(s, Options(), record)
    for st in steps:
        status = st.check(ctx)
        if not status.current:
            return st.name, status.reason
        _store(record, st.name, status.outputs)
        if st.name == upto:
            break
    return None


def _store(record: dict, name: str, outputs: dict) -> bool:
    """Keep a step's outputs in the record; True when they changed."""
    entry = record.setdefault("steps", {}).get(name)
    if entry and entry.get("outputs") == outputs:
        return False
    record["steps"][name] = {"outputs": outputs, "at": dt.datetime.now().isoformat(timespec="seconds")}
    return True
