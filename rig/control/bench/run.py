"""One bench run: check, measure with llama-benchy once, save the run folder, compare with the last run.

The folder ``<results>/<timestamp>/`` holds llama-benchy's JSON and log, a markdown table,
``run.json`` (the parameters and figures the next run compares with) and, for a sweep, a PNG plot.
It is filled under a hidden name and renamed when complete, so a failed or interrupted run leaves
nothing a later comparison reads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

from rig.base import atomic
from rig.base.console import plain, warn
from rig.base.errors import BadInput, WorkFailed, problem
from rig.control.bench import history
from rig.control.bench.book import serve_book
from rig.control.bench.cells import cells, compare, comparison, previous, table
from rig.control.bench.plot import plot, plot_series
from rig.control.bench.preflight import Target, check
from rig.control.bench.request import Request
from rig.control.bench.tool import BOOT, TOOL_VERSION, run_tool
from rig.facts import slots


def _stamp(root: Path) -> str:
    base = time.strftime("%Y%m%d-%H%M%S")
    name, n = base, 1
    while (root / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def run(req: Request, env: dict[str, str] | None = None) -> int:
    """One bench.sh run: check, measure, save, compare. Returns the exit status."""
    env = dict(os.environ if env is None else env)
    t = check(req, env)
    req.results.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".run-", dir=req.results))
    try:
        report, log = _measure(req, t, env, work)
        rows = cells(report)
        if not any(c.measured for c in rows):
            raise WorkFailed(problem("llama-benchy's results", "throughput figures for at least one cell",
                                     "none: every measured request failed (llama-benchy drops failed requests "
                                     "and still exits 0)", "read the errors in its output above and the "
                                     "engine's log (./vllm-logs.sh)"))
        before = previous(req.results, req.key)
        changes = compare(before[1], rows) if before else []
        name = _stamp(req.results)
        summary = comparison(before[0] if before else None, changes)
        args = " ".join(req.extra) or "none"
        md = "\n".join([f"# llama-benchy run {name}", "",
                        f"* server `{t.base_url}`, model `{t.model}`, tokenizer `{t.tokenizer}`",
                        f"* PP {req.pp}, TG {req.tg}, concurrency {' '.join(map(str, req.concurrency))}, "
                        f"depth {' '.join(map(str, req.depth))}; llama-benchy {TOOL_VERSION}, extra arguments: "
                        f"`{args}`", f"* book `{t.book or 'from --book-url'}`", "", table(rows), "", summary, ""])
        atomic.write_text(work / "results.md", md)
        atomic.write_text(work / "llama-benchy.log", log)
        atomic.write_text(work / "run.json", json.dumps({
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "key": req.key, "base_url": t.base_url,
            "model": t.model, "tokenizer": str(t.tokenizer), "llama_benchy": TOOL_VERSION,
            "cells": [asdict(c) for c in rows]}, indent=2) + "\n")
        if (data := plot_series(req, rows)) is not None:
            atomic.write_bytes(work / "throughput.png", plot(req, data))
        work.chmod(0o755)  # mkdtemp makes it private
        os.replace(work, req.results / name)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    plain(f"\n{table(rows)}\n\n{summary}")
    for c in rows:
        if not c.measured:
            warn(f"no figures at concurrency {c.concurrency}, depth {c.depth} ({c.phase}): its requests failed")
    for ch in (ch for ch in changes if ch.drop):
        c, d, phase = ch.where
        warn(f"{ch.what} throughput at concurrency {c}, depth {d} ({phase}) fell {-ch.percent:.1f} % "
             f"({ch.before:.1f} -> {ch.now:.1f} t/s) since {before[0]}")
    plain(f"results: {req.results / name}")
    _history(env, req, rows, name)
    return 0


def _history(env: dict[str, str], req: Request, rows: list, name: str) -> None:
    """The run into the bench history, beside its baseline, and the history's plot; a history that cannot be
    written is said, and the run (saved above) stands."""
    try:
        s = slots.settings(env)
        state, ident = s.state_dir, history.identity(s, req.key)
        history.save(state, ident, rows, name)
        for line in history.compared(state, ident, rows, name):
            plain(line)
        if (png := history.plot(state)) is not None:
            plain(f"history: {png}")
    except (BadInput, OSError, ValueError) as exc:
        warn(f"history: this run is not in it ({exc})")


def _measure(req: Request, t: Target, env: dict[str, str], work: Path) -> tuple[dict, str]:
    """Run llama-benchy into ``work``: (its JSON report, its output)."""
    raw = work / "llama-benchy.partial.json"
    child = {**env, "RIG_BENCH_API_KEY": t.api_key}
    loop = "127.0.0.1,localhost,::1"
    for k in ("NO_PROXY", "no_proxy"):  # the loopback book and a loopback server never go through a proxy
        child[k] = f"{child[k]},{loop}" if child.get(k) else loop
    with serve_book(t.book) if t.book else nullcontext() as url:
        cmd = [sys.executable, "-c", BOOT, "--base-url", t.base_url, "--model", t.model,
               "--tokenizer", str(t.tokenizer), "--pp", str(req.pp), "--tg", str(req.tg),
               "--concurrency", *map(str, req.concurrency), "--depth", *map(str, req.depth),
               *(["--book-url", url] if url else []), "--format", "json", "--save-result", str(raw), *req.extra]
        code, log = run_tool(cmd, child, own_book=url is not None)
    if code != 0:
        tail = next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), "no output")
        raise WorkFailed(problem("llama-benchy", "exit status 0", f"{code} ({tail[:200]})",
                                 "read its output above"))
    try:
        text = raw.read_text()
        report = json.loads(text)
    except (OSError, ValueError) as exc:
        raise WorkFailed(problem(f"llama-benchy's report {raw.name}", "a JSON file it saved",
                                 exc.__class__.__name__, "read its output above")) from exc
    atomic.write_text(work / "llama-benchy.json", text)
    raw.unlink()
    return report, log
