"""The figures of a run, cell by cell: read from llama-benchy's JSON, tabled, and set against the last run.

A cell is one (concurrency, depth, phase) of a run. ``run.json`` keeps a run's cells, so the next
run with the same parameters (``Request.key``) finds them with ``previous`` and flags any total
throughput that fell by more than DROP.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DROP = 0.05  # a throughput this much below the previous run's is flagged


@dataclass
class Cell:
    """The figures of one (concurrency, depth) cell: (mean, std) pairs, None where llama-benchy has none."""

    concurrency: int
    depth: int
    phase: str  # "turn", or "context load" (the first phase with --enable-prefix-caching)
    prompt: tuple[float, float] | None = None
    prompt_req: tuple[float, float] | None = None
    gen: tuple[float, float] | None = None
    gen_req: tuple[float, float] | None = None
    peak: tuple[float, float] | None = None
    ttft_ms: tuple[float, float] | None = None

    @property
    def where(self) -> tuple[int, int, str]:
        return self.concurrency, self.depth, self.phase

    @property
    def measured(self) -> bool:
        """Whether any request of the cell succeeded (llama-benchy drops failed ones)."""
        return any((self.prompt, self.prompt_req, self.gen, self.gen_req, self.peak, self.ttft_ms))


@dataclass
class Change:
    """One throughput of one cell against the previous run."""

    where: tuple[int, int, str]
    what: str  # "prompt" or "generation"
    before: float
    now: float
    drop: bool = field(init=False)

    def __post_init__(self) -> None:
        self.drop = self.now < self.before * (1 - DROP)

    @property
    def percent(self) -> float:
        return (self.now / self.before - 1) * 100 if self.before else 0.0


# --- reading llama-benchy's JSON and run.json ----------------------------------------------------

def _metric(obj: object) -> tuple[float, float] | None:
    if isinstance(obj, dict) and isinstance(obj.get("mean"), (int, float)):
        return float(obj["mean"]), float(obj.get("std") or 0.0)
    return None


def cells(report: dict) -> list[Cell]:
    """The cells of llama-benchy's ``--format json`` report, in its order."""
    out = []
    for b in report.get("benchmarks") or []:
        out.append(Cell(concurrency=int(b["concurrency"]), depth=int(b["context_size"]),
                        phase="context load" if b.get("is_context_prefill_phase") else "turn",
                        prompt=_metric(b.get("pp_throughput")), prompt_req=_metric(b.get("pp_req_throughput")),
                        gen=_metric(b.get("tg_throughput")), gen_req=_metric(b.get("tg_req_throughput")),
                        peak=_metric(b.get("peak_throughput")), ttft_ms=_metric(b.get("e2e_ttft"))))
    return out


def cell_from_record(d: dict) -> Cell:
    """A cell as ``run.json`` keeps it (``dataclasses.asdict``; JSON turned its tuples into lists)."""
    return Cell(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


# --- the table and the comparison ----------------------------------------------------------------

def fmt(m: tuple[float, float] | None) -> str:
    """A (mean, std) pair as ``mean ± std``; a dash where there is none."""
    return "—" if m is None else f"{m[0]:.1f} ± {m[1]:.1f}"


def table(rows: Sequence[Cell]) -> str:
    """The markdown table of one run's cells."""
    lines = ["| concurrency | depth | phase | prompt t/s | prompt t/s per request | generation t/s "
             "| generation t/s per request | peak generation t/s | time to first token (ms) |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c.concurrency} | {c.depth} | {c.phase} | {fmt(c.prompt)} | {fmt(c.prompt_req)} | {fmt(c.gen)} "
              f"| {fmt(c.gen_req)} | {fmt(c.peak)} | {fmt(c.ttft_ms)} |" for c in rows]
    return "\n".join(lines)


def compare(before: Sequence[Cell], now: Sequence[Cell]) -> list[Change]:
    """Each total throughput that both runs measured, cell by cell."""
    old = {c.where: c for c in before}
    out = []
    for c in now:
        if (p := old.get(c.where)) is None:
            continue
        for what, a, b in (("prompt", p.prompt, c.prompt), ("generation", p.gen, c.gen)):
            if a is not None and b is not None and a[0] > 0:
                out.append(Change(c.where, what, a[0], b[0]))
    return out


def previous(root: Path, key: dict) -> tuple[str, list[Cell]] | None:
    """The latest complete run under ``root`` with the same parameters: (its folder name, its cells)."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            rec = d / "run.json"
            if d.name.startswith(".") or not rec.is_file():
                continue
            try:
                data = json.loads(rec.read_text())
                if data.get("key") == key:
                    found.append((data.get("created", ""), d.name, [cell_from_record(c) for c in data["cells"]]))
            except (ValueError, KeyError, TypeError):
                continue  # not a run folder of this rig
    if not found:
        return None
    _, name, rows = max(found, key=lambda t: (t[0], t[1]))
    return name, rows


def comparison(name: str | None, changes: Sequence[Change]) -> str:
    """The markdown section that sets this run against the previous one."""
    if name is None:
        return "No earlier run with these parameters: this one is the baseline for the next."
    lines = [f"Against the previous run with these parameters, `{name}` (a drop of more than "
             f"{DROP:.0%} is marked DROP):", "",
             "| concurrency | depth | phase | throughput | before t/s | now t/s | change |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for ch in changes:
        c, d, phase = ch.where
        mark = " DROP" if ch.drop else ""
        lines.append(f"| {c} | {d} | {phase} | {ch.what} | {ch.before:.1f} | {ch.now:.1f} "
                     f"| {ch.percent:+.1f} %{mark} |")
    return "\n".join(lines)
