"""``python3 -m rig.control.bench table TITLE LABEL=FOLDER ...``: the power-sweep table, with the system Python.

``benchmarks/power-sweep.sh`` calls it after its runs; a benchmark itself goes through
``benchmarks/bench.sh`` (the bench venv), so any other subcommand is refused with exit 2.
"""

from __future__ import annotations

import sys

from rig.base.console import guard
from rig.base.errors import BadInput, problem
from rig.control.bench.sweep import table_main


def _main(args: list[str]) -> int:
    if not args or args[0] != "table":
        raise BadInput(problem("python -m rig.control.bench", "the subcommand table", " ".join(args) or "none",
                               "run benchmarks/bench.sh for a benchmark"))
    return table_main(args[1:])


raise SystemExit(guard(lambda: _main(sys.argv[1:])))
