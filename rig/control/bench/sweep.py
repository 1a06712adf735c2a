"""The table of a sweep of runs (``benchmarks/power-sweep.sh``): one markdown table over many run folders.

``python3 -m rig.control.bench table`` (see ``__main__.py``) runs with the system Python, outside the bench
venv, so this module, like every module of the package, imports only the standard library and the
rig at the top.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

from rig.base import atomic
from rig.base.console import plain
from rig.base.errors import BadInput, problem
from rig.control.bench.cells import cell_from_record, fmt


def sweep_table(title: str, runs: Sequence[tuple[str, Path]]) -> str:
    """One markdown table over several run folders, one row per run and cell."""
    lines = [f"| {title} | concurrency | depth | phase | prompt t/s | generation t/s | run |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for label, folder in runs:
        rec = folder / "run.json"
        try:
            rows = [cell_from_record(c) for c in json.loads(rec.read_text())["cells"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(problem(f"run folder {folder}", "a run.json written by bench.sh",
                                   exc.__class__.__name__, "pass the folders bench.sh printed as results:")) from exc
        for c in rows:
            lines.append(f"| {label} | {c.concurrency} | {c.depth} | {c.phase} | {fmt(c.prompt)} | {fmt(c.gen)} "
                         f"| {folder.name} |")
    return "\n".join(lines)


def table_main(argv: Sequence[str]) -> int:
    """``python3 -m rig.control.bench table TITLE LABEL=FOLDER ...``: print and save the sweep table beside the runs."""
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        raise BadInput(problem("rig.control.bench table arguments", "TITLE LABEL=FOLDER [LABEL=FOLDER ...]",
                               " ".join(argv) or "none", "pass the folders bench.sh printed as results:"))
    runs = [(lab, Path(p)) for lab, _, p in (a.partition("=") for a in argv[1:])]
    text = f"# {argv[0]} sweep\n\n{sweep_table(argv[0], runs)}\n"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", argv[0]).strip("-") or "sweep"
    out = runs[0][1].parent / f"{slug}-sweep-{time.strftime('%Y%m%d-%H%M%S')}.md"
    atomic.write_text(out, text)
    plain(text)
    plain(f"table: {out}")
    return 0
