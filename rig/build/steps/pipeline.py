"""The build pipeline: steps in order, each skipped when its inputs are unchanged, under the build lock.

The steps (rig/build/steps/order.py lists them) are what rig/build/steps/base.py defines.
The pipeline prints ``[n/8] name — summary``, skips current steps with the
reason, runs the others, and records each step's typed outputs in the build
record (rig/facts/record.py, written atomically) so later steps can read them.
``Options`` and ``context`` are the runners' to use from here, as they are
the steps' from rig/build/steps/base.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from rig.base.console import fact, header, note, say
from rig.base.errors import BadInput, problem
from rig.build import leftovers
from rig.build.steps.base import Context, Options, Step, context
from rig.build.steps.order import ORDER
from rig.facts import record
from rig.facts.config import Settings


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
    note(f"build: {len(chosen)} step(s) in {time.monotonic() - started:.1f} s")
    return ctx.record


def first_stale(steps: Sequence[Step], s: Settings, upto: str = "install") -> tuple[str, str] | None:
    """(step, reason) of the first step up to ``upto`` whose output is not current, or None: what start asks."""
    ctx = context(s)
    if ctx.record.tools is None:
        return "tools", f"no build record at {record.path(s.record_dir, s.device)} (a first run)"
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
        record.save(ctx.settings.record_dir, ctx.record, ctx.settings.device)
