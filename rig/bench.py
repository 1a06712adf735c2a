"""llama-benchy runs against the served model (``benchmarks/bench.sh``): saved, compared, plotted.

One run checks its arguments and the server (the one-token health check of ``./start.sh``),
serves the book text on loopback (llama-benchy only fetches it over http), runs llama-benchy
once over every concurrency and depth, and writes ``<results>/<timestamp>/``: llama-benchy's
JSON, a markdown table, ``run.json`` (the parameters and figures the next run compares with)
and, for a sweep, a PNG plot. The folder is filled under a hidden name and renamed when
complete, so a failed or interrupted run leaves nothing a later comparison reads.

This module imports only the standard library at the top: ``python3 -m rig.bench table``
(the power-sweep table) runs without the bench venv.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from rig import REPO_ROOT, atomic, prose
from rig.console import say, warn
from rig.errors import BadInput, WorkFailed, problem

TOOL = "llama-benchy==0.4.0"
TOOL_VERSION = TOOL.partition("==")[2]
#: What llama-benchy 0.4.0 imports, installed beside it with ``--no-deps``: its full install adds
#: transformers (~300 MB), which it only needs when ``tokenizers`` cannot read the tokenizer.
TOOL_DEPS = ("aiohttp>=3.9", "numpy>=1.26", "pydantic>=2.12.5", "requests>=2.31", "tabulate>=0.9",
             "tokenizers>=0.15", "matplotlib>=3.8")
#: The default book: prose the rig generates (rig.prose), kept in RIG_CACHE; a bench needs no network.
BOOK_NAME = f"bench-book-v{prose.VERSION}.txt"
CACHED = "Saved text to cache: "  # llama-benchy's line naming its cached copy of a fetched book
DEFAULT_RESULTS = Path("benchmarks") / "results"
DROP = 0.05  # a throughput this much below the previous run's is flagged
POSITIONAL = (("PP", "32768", "prompt tokens per request; 1 measures decode only"),
              ("TG", "2048", "tokens generated per request; 1 measures prefill only"),
              ("CONCURRENCY", "1", 'concurrent requests: one level or a list, like "1 2 4"'),
              ("DEPTH", "0", 'earlier conversation tokens before the measured prompt: one or a list, like "0 8192"'))
#: llama-benchy options the rig sets itself, and where their values come from.
FIXED = {"--base-url": "BASE_URL", "--model": "MODEL", "--tokenizer": "TOKENIZER", "--api-key": "VLLM_API_KEY",
         "--pp": "PP (the first argument)", "--tg": "TG (the second argument)",
         "--concurrency": "CONCURRENCY (the third argument)", "--depth": "DEPTH (the fourth argument)",
         "--format": "the rig (it saves the JSON and a markdown table)",
         "--save-result": "the rig (it saves into --results-dir)"}
#: Runs llama-benchy with the API key taken from the environment, so it never shows on a command line.
BOOT = ("import os, sys\nfrom llama_benchy.__main__ import main\nkey = os.environ.pop('RIG_BENCH_API_KEY', '')\n"
        "sys.argv = ['llama-benchy', *sys.argv[1:], *(['--api-key', key] if key else [])]\nmain()\n")


@dataclass(frozen=True)
class Request:
    """One bench.sh call: the measured sizes, the extra llama-benchy arguments, where to save."""

    pp: int
    tg: int
    concurrency: tuple[int, ...]
    depth: tuple[int, ...]
    extra: tuple[str, ...] = ()
    results: Path = REPO_ROOT / DEFAULT_RESULTS
    book: Path | None = None

    @property
    def key(self) -> dict:
        """What must match for two runs to be compared."""
        return {"pp": self.pp, "tg": self.tg, "concurrency": list(self.concurrency), "depth": list(self.depth),
                "extra": list(self.extra)}

    @property
    def sweep(self) -> str | None:
        """The swept value a plot's x axis shows: ``concurrency``, ``depth`` or none."""
        if len(self.concurrency) > 1:
            return "concurrency"
        return "depth" if len(self.depth) > 1 else None


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


def usage() -> str:
    lines = ["usage: benchmarks/bench.sh [PP] [TG] [CONCURRENCY] [DEPTH] [--results-dir DIR] [--book-file FILE] "
             "[llama-benchy arguments]", "",
             f"Measure the running server with llama-benchy {TOOL_VERSION}; results go to "
             f"{DEFAULT_RESULTS}/<timestamp>/ (JSON, markdown table, a PNG plot for sweeps).", "", "arguments:"]
    lines += [f"  {name:12} default {default:6} {meaning}" for name, default, meaning in POSITIONAL]
    lines += ["", "options of the rig (relative paths are taken from the repository root):",
              f"  --results-dir DIR   where the run folders go (default {DEFAULT_RESULTS})",
              f"  --book-file FILE    the text prompts are cut from (default RIG_CACHE/{BOOK_NAME}, prose the "
              "rig generates: no network needed)", "",
              "Every other argument goes to llama-benchy unchanged: --runs N, --enable-prefix-caching, --no-cache, "
              "--skip-coherence, --latency-mode, --book-url URL, ...", "The rig sets these itself:"]
    lines += [f"  {opt:15} {src}" for opt, src in FIXED.items()]
    lines += ["", "variables: BASE_URL (default http://127.0.0.1:$PORT/v1), MODEL (default the first MODEL_NAME), "
              "TOKENIZER (default $CKPT, a folder with tokenizer.json), VLLM_API_KEY"]
    return "\n".join(lines)


def _numbers(name: str, raw: str, low: int, example: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"[\s,]+", raw.strip()) if p]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values or any(v < low for v in values):
        kind = f"a whole number >= {low}" if example.isdigit() else f"whole numbers >= {low} separated by spaces"
        raise BadInput(problem(name, f"{kind}, like {example!r}", repr(raw),
                               f"pass {name} as {example!r} (or leave it out for the default)"))
    return values


def _one(name: str, raw: str, example: str) -> int:
    values = _numbers(name, raw, 1, example)
    if len(values) > 1:
        raise BadInput(problem(name, f"one whole number >= 1, like {example!r}", repr(raw),
                               "measure one size per run; CONCURRENCY and DEPTH take lists"))
    return values[0]


def _conflict(arg: str) -> str | None:
    """The fixed option a llama-benchy argument would set (argparse also takes a unique prefix)."""
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg.split("=", 1)[0]
    hits = [opt for opt in FIXED if opt.startswith(name)]
    return hits[0] if hits else None


def parse(argv: Sequence[str], root: Path = REPO_ROOT) -> Request | None:
    """bench.sh's arguments; None for ``--help``. Bad values raise BadInput (exit 2)."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        return None
    pos: list[str] = []
    while argv and len(pos) < len(POSITIONAL) and not (argv[0].startswith("-") and not re.match(r"-\d", argv[0])):
        pos.append(argv.pop(0))
    raw = [*pos, *(d for _, d, _ in POSITIONAL[len(pos):])]
    pp, tg = _one("PP", raw[0], "32768"), _one("TG", raw[1], "2048")
    conc = _numbers("CONCURRENCY", raw[2], 1, "1 2 4")
    depth = _numbers("DEPTH", raw[3], 0, "0 8192 65536")
    extra: list[str] = []
    results, book = root / DEFAULT_RESULTS, None
    while argv:
        a = argv.pop(0)
        if a == "--":
            continue  # a separator some callers add; llama-benchy would take what follows as positionals
        if a in ("--results-dir", "--book-file") or a.startswith(("--results-dir=", "--book-file=")):
            opt, _, val = a.partition("=")
            if not val:
                if not argv:
                    raise BadInput(problem(opt, "a path after it", "nothing", f"pass {opt} PATH"))
                val = argv.pop(0)
            path = Path(val).expanduser()
            path = path if path.is_absolute() else root / path
            if opt == "--results-dir":
                results = path
            else:
                book = path
            continue
        if fixed := _conflict(a):
            raise BadInput(problem(f"llama-benchy argument {a}", "an option the rig does not set",
                               f"{fixed}, which comes from {FIXED[fixed]}", f"leave {a} out; use {FIXED[fixed]}"))
        extra.append(a)
    return Request(pp, tg, conc, depth, tuple(extra), results, book)


# --- reading llama-benchy's JSON ---------------------------------------------------------------

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


def _cell(d: dict) -> Cell:
    return Cell(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


# --- the table, the comparison, the plot --------------------------------------------------------

def _fmt(m: tuple[float, float] | None) -> str:
    return "—" if m is None else f"{m[0]:.1f} ± {m[1]:.1f}"


def table(rows: Sequence[Cell]) -> str:
    """The markdown table of one run's cells."""
    lines = ["| concurrency | depth | phase | prompt t/s | prompt t/s per request | generation t/s "
             "| generation t/s per request | peak generation t/s | time to first token (ms) |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c.concurrency} | {c.depth} | {c.phase} | {_fmt(c.prompt)} | {_fmt(c.prompt_req)} | {_fmt(c.gen)} "
              f"| {_fmt(c.gen_req)} | {_fmt(c.peak)} | {_fmt(c.ttft_ms)} |" for c in rows]
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
                    found.append((data.get("created", ""), d.name, [_cell(c) for c in data["cells"]]))
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


def plot_series(req: Request, rows: Sequence[Cell]) -> dict | None:
    """What the sweep plot shows: prompt and generation t/s against the swept value, one line per other value."""
    axis = req.sweep
    if axis is None:
        return None
    other = "depth" if axis == "concurrency" else "concurrency"
    series = []
    for v in getattr(req, other):
        pts = sorted((getattr(c, axis), c) for c in rows if c.phase == "turn" and getattr(c, other) == v)
        series.append({"label": f"{other} {v}", "x": [x for x, _ in pts],
                       "prompt": [c.prompt[0] if c.prompt else None for _, c in pts],
                       "generation": [c.gen[0] if c.gen else None for _, c in pts]})
    return {"x": axis, "series": series}


def plot(req: Request, data: dict) -> bytes:
    """The PNG: prompt and generation throughput against the swept value; the data rides in its metadata."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for ax, what, title in ((axes[0], "prompt", "prompt processing"), (axes[1], "generation", "generation")):
        for s in data["series"]:
            ys = [float("nan") if y is None else y for y in s[what]]
            ax.plot(s["x"], ys, marker="o", label=s["label"])
        ax.set_ylabel("tokens/s (total)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[1].set_xlabel(data["x"])
    if data["x"] == "concurrency":
        axes[1].set_xticks(sorted({x for s in data["series"] for x in s["x"]}))
    fig.suptitle(f"PP {req.pp}, TG {req.tg}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Title": f"llama-benchy PP {req.pp} TG {req.tg}",
                                                       "Description": json.dumps(data)})
    plt.close(fig)
    return buf.getvalue()


# --- the book, served on loopback ---------------------------------------------------------------

def book_file(req: Request, cache: Path) -> Path:
    """The book text: --book-file, or prose the rig generates into RIG_CACHE (no network needed)."""
    if req.book is not None:
        path = req.book
        fix = "pass --book-file with a plain UTF-8 text file (any long text works; a short one is repeated)"
    else:
        path = prose.ensure(cache / BOOK_NAME)
        fix = f"remove {path} (it is made again), or pass --book-file FILE"
    if not path.is_file() or path.stat().st_size == 0:
        found = "an empty file" if path.is_file() else "nothing there"
        raise BadInput(problem(f"book text {path}", "a plain UTF-8 text file", found, fix))
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(problem(f"book text {path}", "UTF-8 text", f"undecodable bytes ({exc.reason})", fix)) from exc
    return path


@contextmanager
def serve_book(path: Path) -> Iterator[str]:
    """Serve ``path`` at a loopback URL while the block runs; remove llama-benchy's cached copy after."""
    data = path.read_bytes()
    name = f"/book-{hashlib.sha256(data).hexdigest()[:16]}.txt"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path != name:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}{name}"
    try:
        yield url
    finally:
        srv.shutdown()
        srv.server_close()
        # llama-benchy 0.4.0 keeps every fetched URL as ~/.cache/llama-benchy/<md5 of the URL>.txt
        cached = Path.home() / ".cache" / "llama-benchy" / f"{hashlib.md5(url.encode()).hexdigest()}.txt"
        cached.unlink(missing_ok=True)


# --- one run -------------------------------------------------------------------------------------

def _endpoint(base_url: str) -> tuple[str, int]:
    u = urlsplit(base_url)
    try:
        port = u.port or 80
    except ValueError:
        port = -1
    if u.scheme != "http" or not u.hostname or port < 0 or u.path.rstrip("/") != "/v1" or u.query:
        raise BadInput(problem("BASE_URL", "the server's OpenAI API as http://HOST:PORT/v1", repr(base_url),
                               "set BASE_URL=http://127.0.0.1:8000/v1 (or unset it: the default is built from "
                               "HOST and PORT)"))
    return u.hostname, port


def _tokenizer(path: Path) -> Path:
    fix = "set TOKENIZER to the checkpoint folder (it holds tokenizer.json) or to the tokenizer.json itself"
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        found = "a folder without tokenizer.json" if path.is_dir() else "nothing there"
        raise BadInput(problem(f"TOKENIZER {path}", "tokenizer.json, or a folder with one", found, fix))
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return path  # outside the bench venv: llama-benchy reads it
    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise BadInput(problem(f"TOKENIZER {file}", "a tokenizer.json the tokenizers package reads",
                               str(exc).splitlines()[0][:200], fix)) from exc
    return path


def _tool() -> None:
    from importlib import metadata

    try:
        found = metadata.version("llama-benchy")
    except metadata.PackageNotFoundError:
        found = "none installed"
    if found != TOOL_VERSION:
        raise BadInput(problem("llama-benchy", TOOL_VERSION, found,
                               "run benchmarks/bench.sh (nox -s bench installs it into its own venv)"))


def _run_tool(cmd: list[str], env: dict[str, str], own_book: bool) -> tuple[int, str]:
    """Run llama-benchy, showing its output as it comes; (exit status, the whole output).

    With ``own_book``, the copy of the loopback book it caches is removed as soon as it names it
    (it has the text in memory by then), so not even a killed run leaves one behind.
    """
    out: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as p:
        assert p.stdout is not None
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            out.append(line)
            if own_book and line.startswith(CACHED):
                Path(line.removeprefix(CACHED).strip()).unlink(missing_ok=True)
    return p.returncode, "".join(out)


def _stamp(root: Path) -> str:
    base = time.strftime("%Y%m%d-%H%M%S")
    name, n = base, 1
    while (root / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


@dataclass(frozen=True)
class Target:
    """The checked server, model, tokenizer, API key and book of one run."""

    base_url: str
    model: str
    tokenizer: Path
    api_key: str
    book: Path | None  # None: the extra arguments name their own --book-url


def check(req: Request, env: dict[str, str]) -> Target:
    """Everything a run needs, checked before the first benchmark request; BadInput (exit 2) otherwise."""
    from rig import config, supervise

    b = config.bench_settings(env)
    api_key = config.serve_settings(env).api_key
    host, port = _endpoint(b.base_url)
    tokenizer = _tokenizer(b.tokenizer)
    book = None if _has_book_url(req.extra) else book_file(req, config.settings(env).cache)
    _tool()
    if req.sweep:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BadInput(problem("matplotlib", "installed (it draws the sweep plot)", "none",
                                   "run benchmarks/bench.sh (nox -s bench installs it)")) from exc
    ok, detail = supervise.health(host, port, b.model, api_key)
    if not ok:
        raise BadInput(problem(f"server {b.base_url} (model {b.model})",
                               "a one-token generation, as ./start.sh checks it", " ".join(detail.split()),
                               "start it with ./start.sh and see nox -s status; BASE_URL and MODEL name "
                               "another server or model"))
    say(f"server {b.base_url}: healthy (one token generated); model {b.model}; tokenizer {tokenizer}")
    return Target(b.base_url, b.model, tokenizer, api_key, book)


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
    print(f"\n{table(rows)}\n\n{summary}")
    for c in rows:
        if not c.measured:
            warn(f"no figures at concurrency {c.concurrency}, depth {c.depth} ({c.phase}): its requests failed")
    for ch in (ch for ch in changes if ch.drop):
        c, d, phase = ch.where
        warn(f"{ch.what} throughput at concurrency {c}, depth {d} ({phase}) fell {-ch.percent:.1f} % "
             f"({ch.before:.1f} -> {ch.now:.1f} t/s) since {before[0]}")
    print(f"results: {req.results / name}", flush=True)
    return 0


def _has_book_url(extra: Sequence[str]) -> bool:
    return any(a == "--book-url" or a.startswith("--book-url=") for a in extra)


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
        code, log = _run_tool(cmd, child, own_book=url is not None)
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


def main(argv: Sequence[str]) -> int:
    """``bench.sh`` behind ``python -m rig.cli bench``."""
    req = parse(argv)
    if req is None:
        print(usage())
        return 0
    return run(req)


# --- the table of a sweep of runs (benchmarks/power-sweep.sh) -----------------------------------

def sweep_table(title: str, runs: Sequence[tuple[str, Path]]) -> str:
    """One markdown table over several run folders, one row per run and cell."""
    lines = [f"| {title} | concurrency | depth | phase | prompt t/s | generation t/s | run |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for label, folder in runs:
        rec = folder / "run.json"
        try:
            rows = [_cell(c) for c in json.loads(rec.read_text())["cells"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(problem(f"run folder {folder}", "a run.json written by bench.sh",
                                   exc.__class__.__name__, "pass the folders bench.sh printed as results:")) from exc
        for c in rows:
            lines.append(f"| {label} | {c.concurrency} | {c.depth} | {c.phase} | {_fmt(c.prompt)} | {_fmt(c.gen)} "
                         f"| {folder.name} |")
    return "\n".join(lines)


def table_main(argv: Sequence[str]) -> int:
    """``python3 -m rig.bench table TITLE LABEL=FOLDER ...``: print and save the sweep table beside the runs."""
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        raise BadInput(problem("rig.bench table arguments", "TITLE LABEL=FOLDER [LABEL=FOLDER ...]",
                               " ".join(argv) or "none", "pass the folders bench.sh printed as results:"))
    runs = [(lab, Path(p)) for lab, _, p in (a.partition("=") for a in argv[1:])]
    text = f"# {argv[0]} sweep\n\n{sweep_table(argv[0], runs)}\n"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", argv[0]).strip("-") or "sweep"
    out = runs[0][1].parent / f"{slug}-sweep-{time.strftime('%Y%m%d-%H%M%S')}.md"
    atomic.write_text(out, text)
    print(text)
    print(f"table: {out}")
    return 0


if __name__ == "__main__":
    from rig.console import error
    from rig.errors import RigError

    args = sys.argv[1:]
    try:
        if not args or args[0] != "table":
            raise BadInput(problem("python -m rig.bench", "the subcommand table", " ".join(args) or "none",
                                   "run benchmarks/bench.sh for a benchmark"))
        raise SystemExit(table_main(args[1:]))
    except RigError as exc:
        error(exc.message)
        raise SystemExit(exc.code) from None
