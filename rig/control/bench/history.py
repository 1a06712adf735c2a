"""The bench history: every run's record under ``RIG_STATE/bench-history/``, and each run set beside the last one
that differs only in the patched tree (``bench.sh --compare`` shows that alone).

A record says what identifies the run (:func:`identity`: the series hash and the patched tree, the kernels key,
the profile, the card or the CPU, the driver and torch, the bench arguments) and its cells. The comparison looks
for the newest record whose identity is the same but for the tree (and the series that made it), so that what it
shows is what the patches changed.

What counts as a change is what the box's own spread says: llama-benchy repeats each cell (``--runs``, 3 unless
the arguments say otherwise) and reports its mean and standard deviation; the difference of two runs spreads by
``sqrt(std_a^2 + std_b^2)``, and a change beyond :data:`SIGMAS` of those is flagged (about 95% of the changes
that are noise fall inside, when runs scatter normally). A cell measured once has no spread: its change is shown,
and says so. ``history.png`` plots each cell's generation and prompt throughput over time, run after run.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rig.base import atomic
from rig.control.bench.cells import Cell, cell_from_record
from rig.facts import record, series
from rig.facts.config import Settings

FOLDER = "bench-history"
PLOT = "history.png"
SIGMAS = 2.0
#: the identity's keys that a comparison lets differ: what the patches changed
TREE_KEYS = ("series", "tree")


def folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def identity(s: Settings, key: dict) -> dict:
    """What identifies a run: the build serving (series, tree, kernels, torch), the profile, the card or CPU and
    its driver, and the bench arguments ``key``."""
    from rig.plan import box  # psutil: the bench venv has it; `python3 -m rig.control.bench table` runs without

    build = record.labels(record.load(s.record_dir, s.device))
    try:
        reading = box.read_nvml()
    except box.NoDriver:
        reading = None
    gpus = reading.gpus if reading else []
    return {"series": series.digest(series.patch_files(s.patches_dir))[:16],
            "tree": build["tree"], "kernels": build["kernels"], "torch": build["torch"], "profile": s.profile,
            "device": s.device,
            "card": gpus[0].name if gpus else (platform.processor() or platform.machine()),
            "driver": reading.driver if gpus else "", "bench": key}


def save(state_dir: Path, ident: dict, rows: Sequence[Cell], run: str) -> Path:
    """The run's record, written atomically; its path."""
    d = folder(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{run}.json"
    atomic.write_text(path, json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "at": time.time(),
                                        "run": run, "identity": ident, "cells": [asdict(c) for c in rows]},
                                       indent=1) + "\n")
    return path


def records(state_dir: Path) -> list[dict]:
    """Every readable record, oldest first (a file that is not one is passed over)."""
    out = []
    for p in sorted(folder(state_dir).glob("*.json")):
        try:
            data = json.loads(p.read_text())
            data["cells"] = [cell_from_record(c) for c in data["cells"]]
            out.append(data)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: (r.get("at", 0), r.get("run", "")))


def _same_but_tree(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in TREE_KEYS} == {k: v for k, v in b.items() if k not in TREE_KEYS}


def baseline(state_dir: Path, ident: dict, before: str = "") -> dict | None:
    """The newest record (older than the run ``before``, when given) of the same identity but for the tree."""
    found = [r for r in records(state_dir) if _same_but_tree(r["identity"], ident) and r["run"] != before]
    return found[-1] if found else None


def changes(old: Sequence[Cell], new: Sequence[Cell]) -> list[str]:
    """A line per throughput both runs measured: the change, and whether it is beyond the spread."""
    prev = {c.where: c for c in old}
    lines = []
    for c in new:
        p = prev.get(c.where)
        if p is None:
            continue
        for what, a, b in (("generation", p.gen, c.gen), ("prompt", p.prompt, c.prompt)):
            if not (a and b and a[0] > 0):
                continue
            spread = math.hypot(a[1], b[1])
            pct = (b[0] / a[0] - 1) * 100
            if spread == 0:
                verdict = "measured once: no spread to judge by (--runs 3)"
            elif abs(b[0] - a[0]) > SIGMAS * spread:
                verdict = f"CHANGED: beyond {SIGMAS:g} x the spread {spread:.1f} t/s"
            else:
                verdict = f"within the spread ({SIGMAS:g} x {spread:.1f} t/s)"
            lines.append(f"c={c.concurrency} depth {c.depth} {c.phase}, {what}: {a[0]:.1f} -> {b[0]:.1f} t/s "
                         f"({pct:+.1f}%), {verdict}")
    return lines


def compared(state_dir: Path, ident: dict, rows: Sequence[Cell], run: str) -> list[str]:
    """The lines that set the run beside its baseline (or say there is none)."""
    base = baseline(state_dir, ident, before=run)
    if base is None:
        return ["history: no earlier run of this identity but for the tree (the profile, card, kernels, torch and "
                "bench arguments the same): this run is the baseline for the next"]
    what = "the same tree" if base["identity"]["tree"] == ident["tree"] else (
        f"tree {base['identity']['tree']} -> {ident['tree']}")
    return [f"history: against {base['run']} ({what}):", *(f"  {line}" for line in changes(base["cells"], rows))]


def plot(state_dir: Path) -> Path | None:
    """``history.png``: each cell's generation (and prompt) t/s over the runs, oldest first; None with fewer
    than two runs. The plotted figures ride in the PNG's metadata."""
    recs = records(state_dir)
    if len(recs) < 2:
        return None
    import matplotlib  # the bench venv's alone: the rest of the rig never plots

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # after the backend is chosen

    lines: dict[str, list[tuple[int, float]]] = {}
    for i, r in enumerate(recs):
        for c in r["cells"]:
            for what, m in (("generation", c.gen), ("prompt", c.prompt)):
                if m:
                    label = f"{r['identity'].get('profile', '')} c={c.concurrency} d={c.depth} {what}"
                    lines.setdefault(label, []).append((i, m[0]))
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, pts in sorted(lines.items()):
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xticks(range(len(recs)), [r["run"] for r in recs], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (total)")
    ax.set_title("bench history: each cell over the runs")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder(state_dir) / PLOT
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata={"Description": json.dumps(lines)})
    plt.close(fig)
    return path
