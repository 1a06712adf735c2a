"""llama-benchy runs against the served model (``benchmarks/bench.sh``): saved, compared, plotted.

One run checks its arguments and the server (the one-token health check of ``./start.sh``),
serves the book text on loopback (llama-benchy only fetches it over http), runs llama-benchy
once over every concurrency and depth, and writes ``<results>/<timestamp>/``: llama-benchy's
JSON, a markdown table, ``run.json`` (the parameters and figures the next run compares with)
and, for a sweep, a PNG plot.

The package, by concern (each imports only those above it):

* ``tool``: the pinned llama-benchy, what its venv installs beside it, how it is launched;
* ``request``: bench.sh's arguments, their defaults and the ``--help`` text;
* ``cells``: a run's figures, its markdown table and the comparison with the previous run;
* ``plot``: the sweep PNG (matplotlib, imported only when drawing);
* ``book``: the book text and the loopback HTTP server that serves it;
* ``preflight``: the checks before the first benchmark request, the server's health last;
* ``run``: one run, measured and saved; ``history``: every run's record under the rig's state, set beside the
  last of the same identity but for the tree, and plotted; ``sweep``: the power-sweep table (``__main__``).

Every module imports only the standard library and the rig at the top: ``python3 -m rig.control.bench
table`` (the power-sweep table) runs without the bench venv.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from rig.base.console import plain
from rig.control.bench import history, run
from rig.control.bench.book import book_file
from rig.control.bench.cells import Cell, compare, previous
from rig.control.bench.request import BOOK_NAME, Request, parse, usage
from rig.control.bench.tool import TOOL, TOOL_DEPS
from rig.facts import slots


def compare_last(env: Mapping[str, str]) -> int:
    """``bench.sh --compare``: the history's newest run set beside its baseline (exit 1 when there is no run)."""
    state = slots.settings(env).state_dir
    recs = history.records(state)
    if not recs:
        plain(f"history: no run recorded in {history.folder(state)} yet: run bench.sh first")
        return 1
    last = recs[-1]
    plain(f"history: {last['run']} ({last['identity']['profile']}, {last['identity']['card']}, tree "
          f"{last['identity']['tree']})")
    for line in history.compared(state, last["identity"], last["cells"], last["run"]):
        plain(line)
    return 0


#: What other code imports from ``rig.control.bench``: noxfile.py the pin, rig.cli ``main``, the tests the rest.
__all__ = ["BOOK_NAME", "TOOL", "TOOL_DEPS", "Cell", "Request", "book_file", "compare", "main", "parse",
           "previous"]


def main(argv: Sequence[str]) -> int:
    """``bench.sh`` behind ``python -m rig.cli bench``; ``--compare``: the newest run of the history against its
    baseline, nothing measured."""
    if list(argv) == ["--compare"]:
        return compare_last(os.environ)
    req = parse(argv)
    if req is None:
        plain(usage())
        return 0
    return run.run(req)
