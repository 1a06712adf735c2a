"""What one ``benchmarks/bench.sh`` call asks for: its arguments, their defaults and the ``--help`` text.

The positional PP TG CONCURRENCY DEPTH, the rig's own ``--results-dir`` and ``--book-file``, and
everything else passed to llama-benchy unchanged, except the options the rig sets itself (FIXED),
which are refused here so that a run never measures something other than what it records.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rig import REPO_ROOT
from rig.base import prose
from rig.base.errors import BadInput, problem
from rig.control.bench.tool import TOOL_VERSION

DEFAULT_RESULTS = Path("benchmarks") / "results"
#: The default book: prose the rig generates (rig.base.prose), kept in RIG_CACHE; a bench needs no network.
BOOK_NAME = f"bench-book-v{prose.VERSION}.txt"
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


def usage() -> str:
    """The ``bench.sh --help`` text."""
    lines = ["usage: benchmarks/bench.sh [PP] [TG] [CONCURRENCY] [DEPTH] [--results-dir DIR] [--book-file FILE] "
             "[llama-benchy arguments]", "",
             f"Measure the running server with llama-benchy {TOOL_VERSION}; results go to "
             f"{DEFAULT_RESULTS}/<timestamp>/ (JSON, markdown table, a PNG plot for sweeps).", "", "arguments:"]
    lines += [f"  {name:12} default {default:6} {meaning}" for name, default, meaning in POSITIONAL]
    lines += ["", "options of the rig (relative paths are taken from the repository root):",
              f"  --results-dir DIR   where the run folders go (default {DEFAULT_RESULTS})",
              f"  --book-file FILE    the text prompts are cut from (default RIG_CACHE/{BOOK_NAME}, prose the "
              "rig generates: no network needed)",
              "  --compare           alone: the newest run of the bench history (RIG_STATE/bench-history) against "
              "the last one that differs only in the patched tree; nothing is measured", "",
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


def has_book_url(extra: Sequence[str]) -> bool:
    """Whether the llama-benchy arguments name their own book (``--book-url``)."""
    return any(a == "--book-url" or a.startswith("--book-url=") for a in extra)
