"""vLLM's log as the rig reads it on the start path: the engine's log file, its lines, and what they say.

The engine log (``LOG``) is appended to by rig/running/logpump.py; :func:`check_log` and :func:`open_log` are how the
start checks and creates it, :class:`Lines` how the supervisor reads the engine's new lines while it starts
(:func:`notable`: the ones worth showing), :func:`last_capacity` how status finds the KV cache line. :func:`parse`
reads one line (a stats line with the series' counters, a SpecDecoding line, a warning): ``./vllm-logs.sh``'s
reader (rig/control/logview.py) shows what it finds.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rig.base.console import echo
from rig.base.errors import BadInput, problem

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PREFIX = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \[[^\]]*\] (.*)$")
STATS_MARK = "Avg prompt throughput:"
SPEC_MARK = "SpecDecoding metrics:"
CAPACITY = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
                      r"request: ([\d.]+)x")
NUM = r"(nan|[-+]?\d+(?:\.\d+)?)"
STATS_FIELDS = {  # key in the line -> our name; the value's first word is the number
    "Avg prompt throughput": "prompt", "Avg generation throughput": "gen", "Running": "running",
    "Waiting": "waiting", "Deferred": "deferred", "Preemptions": "preempted", "Corrupted": "corrupted",
    "Prefix cache hit rate": "prefix_hit", "External prefix cache hit rate": "ext_prefix_hit",
    "MM cache hit rate": "mm_hit",
    # the series' counters (COUNTERS=1, patches/0003-bounds-guard.patch)
    "Guard token_ids": "guard_token_ids", "Guard positions": "guard_positions", "Guard sampling": "guard_sampling",
}
TEXT_FIELDS = {"Abliteration": "abliteration"}  # COUNTERS=1, patch 0005: a name, or off
GUARD_KINDS = ("token_ids", "positions", "sampling")
STATS_RE = re.compile(
    r"Avg prompt throughput: (?P<prompt>\S+) tokens/s, Avg generation throughput: (?P<gen>\S+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs(?:, Deferred: (?P<deferred>\d+) reqs)?"
    r"(?:, Preemptions: (?P<preempted>\d+))?(?:, [^,]*?)*?, (?P<device>\w+) KV cache usage: (?P<kv>\S+)%, "
    r"Prefix cache hit rate: (?P<prefix_hit>\S+)%(?:, (?P<tail>.*))?$")
SPEC_LEN = re.compile(r"Mean acceptance length: " + NUM)
SPEC_RATE = re.compile(r"Avg Draft acceptance rate: " + NUM + "%")
MARKS = re.compile("|".join(re.escape(x) for x in (STATS_MARK, SPEC_MARK, "KV cache size", "WARNING", "ERROR",
                                                   "CRITICAL")))
#: Milestones of a vLLM start worth showing while waiting (besides the capacity line, warnings, errors).
MILESTONES = re.compile(r"Loading weights took|Model loading took|torch\.compile takes|Capturing CUDA graphs|"
                        r"Graph capturing finished|init engine .* took|Starting vLLM API server|"
                        r"Application startup complete|Traceback \(most recent call last\)")


@dataclass
class Event:
    kind: str  # stats | spec | capacity | warning | error
    time: str
    data: dict = field(default_factory=dict)
    text: str = ""


def _num(v: str) -> float:
    return float("nan") if v == "nan" else float(v)


def parse_stats(msg: str) -> dict | None:
    """The fields of a stats message, or None when a required one is missing or malformed.

    One regex takes the required parts in their order (unknown optional parts may stand between
    them); the optional tail is read part by part.
    """
    m = STATS_RE.search(msg)
    if not m:
        return None
    try:
        out: dict = {k: float(v) for k, v in m.groupdict().items() if v is not None and k not in ("device", "tail")}
        out["device"] = m["device"]
        for part in m["tail"].split(", ") if m["tail"] else ():
            key, sep, value = part.partition(": ")
            if sep and (name := STATS_FIELDS.get(key)):
                out[name] = float(value.split(" ", 1)[0].rstrip("%"))
            elif sep and (name := TEXT_FIELDS.get(key)):
                out[name] = value
    except ValueError:
        return None
    if msg.startswith("Engine "):
        out["engine"] = msg.split(":", 1)[0].split()[-1]
    return out


def parse(line: str) -> Event | None:
    """One log line -> an Event, or None for lines the reader does not show."""
    if not MARKS.search(line):  # most lines: one scan, no parse
        return None
    if "\x1b" in line:
        line = ANSI.sub("", line)
    m = PREFIX.search(line.rstrip("\r\n"))
    if not m:
        return None
    level, when, msg = m[1], m[2], m[3]
    if STATS_MARK in msg:
        data = parse_stats(msg)
        return Event("stats", when, data) if data else Event("bad", when, text=msg)
    if SPEC_MARK in msg:
        ln, rate = SPEC_LEN.search(msg), SPEC_RATE.search(msg)
        if not ln or not rate:
            return Event("bad", when, text=msg)
        return Event("spec", when, {"accept_len": _num(ln[1]), "accept_rate": _num(rate[1])})
    if c := CAPACITY.search(msg):
        return Event("capacity", when, {"device": c[1], "tokens": int(c[2].replace(",", "")),
                                        "context": int(c[3].replace(",", "")), "concurrency": float(c[4])})
    if level in ("WARNING", "ERROR", "CRITICAL"):
        return Event("error" if level != "WARNING" else "warning", when, text=msg)
    return None


# -- the engine log on the start path, and what the supervisor and status read of it ----------------------------


def check_log(path: str) -> None:
    """That LOG can be appended to by this user, without creating anything: what a dry run checks too."""
    p = Path(path)
    where = p if p.exists() else next((a for a in p.parents if a.exists()), Path("/"))
    blocked = p.is_dir() or (where != p and not where.is_dir())
    if blocked or not os.access(where, os.W_OK):
        found = ("a folder" if p.is_dir() else f"{where}, which is not a folder" if blocked
                 else f"{where} is not writable by uid {os.geteuid()}")
        raise BadInput(problem("LOG", f"a file this user can append to ({path})", found,
                               "run with sudo, set LOG=/a/writable/path, or LOG= to keep the output on the "
                               "terminal"))


def open_log(path: str) -> IO[bytes]:
    """The engine log, appended to (O_APPEND: safe beside rotation), created 0640: it can hold prompts."""
    check_log(path)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640), "ab", buffering=0)
    except OSError as exc:
        raise BadInput(problem("LOG", f"a file this user can append to ({path})", exc.strerror or str(exc),
                               "run with sudo, set LOG=/a/writable/path, or LOG= to keep the output on the "
                               "terminal")) from None


class Lines:
    """New lines of the engine's output: from the log file (tailed) or from a pipe (passed on to stdout)."""

    def __init__(self, log: Path | None, offset: int, pipe: IO[bytes] | None) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        self.tail: deque[str] = deque(maxlen=30)
        self._log, self._offset, self._buf = log, offset, b""
        if pipe is not None:
            threading.Thread(target=self._copy, args=(pipe,), daemon=True).start()

    def _copy(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            echo(raw)
            self.q.put(raw.decode(errors="replace").rstrip("\r\n"))

    def new(self) -> Iterator[str]:
        if self._log is not None:
            with open(self._log, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
            self._offset += len(chunk)
            *whole, self._buf = (self._buf + chunk).split(b"\n")
            for raw in whole:
                self.q.put(raw.decode(errors="replace").rstrip("\r"))
        while True:
            try:
                line = self.q.get_nowait()
            except queue.Empty:
                return
            self.tail.append(line)
            yield line


def notable(line: str) -> tuple[str, str] | None:
    """(kind, text) for a line worth showing while the engine starts."""
    if m := CAPACITY.search(line):
        return "capacity", m[0]
    ev = parse(line)
    if ev and ev.kind in ("warning", "error"):
        return ev.kind, ev.text
    if MILESTONES.search(line):
        m = PREFIX.search(ANSI.sub("", line))
        return "milestone", m[3] if m else line.strip()
    return None


def last_capacity(path: str) -> str:
    """The last KV cache capacity line in the log's last 4 MiB ("" when there is none, or no log)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - (4 << 20)))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    found = list(CAPACITY.finditer(text))
    return found[-1][0] if found else ""
