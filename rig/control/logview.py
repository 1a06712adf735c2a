"""``./vllm-logs.sh``: one coloured line per engine stats update, from the log file or the container.

vLLM writes a stats line every ``VLLM_LOG_STATS_INTERVAL`` seconds while the
engine is busy, and a SpecDecoding line right after it when speculative
decoding is on. rig/running/logs.py parses both (with their optional parts); this
reader merges them into one line, passes the engine's warnings and errors
through, marked, and prints the KV capacity line once. File names and line
numbers in the prefix move between vLLM versions, so nothing keys on them.

Sources: ``docker logs --since 10m <container>`` (the default), or the log
file with ``-f``, followed across rotation (renamed or truncated).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from rig.base.console import plain, warn
from rig.base.errors import BadInput, problem
from rig.facts.config import Settings
from rig.running.logs import GUARD_KINDS, Event, parse


class Palette:
    def __init__(self, color: bool) -> None:
        self.on = color

    def __call__(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.on else text


def _pct(v: float) -> str:
    return "nan" if v != v else f"{v:.1f}%"


def render(stats: Event, spec: Event | None, c: Palette) -> str:
    d = stats.data
    prompt, gen = f"{d['prompt']:8.1f}", f"{d['gen']:7.1f}"
    parts = [c("2", stats.time), f"prompt {c('36', prompt)} tok/s", f"gen {c('32', gen)} tok/s",
             f"run {int(d['running'])}", f"wait {int(d['waiting'])}"]
    if d.get("deferred"):
        parts.append(c("33", f"deferred {int(d['deferred'])}"))
    if d.get("preempted"):
        parts.append(c("31", f"preempted {int(d['preempted'])}"))
    kv = d["kv"]
    parts.append(f"KV {c('31' if kv >= 90 else '33' if kv >= 70 else '0', _pct(kv))}")
    parts.append(f"prefix hit {_pct(d['prefix_hit'])}")
    if any(f"guard_{k}" in d for k in GUARD_KINDS):
        counts = [int(d.get(f"guard_{k}", 0)) for k in GUARD_KINDS]
        parts.append(c("33" if any(counts) else "0", "guard " + "/".join(map(str, counts))))
    if "abliteration" in d:
        parts.append(f"abl {d['abliteration']}")
    if spec:
        al, ar = spec.data["accept_len"], spec.data["accept_rate"]
        parts.append(f"MTP len {'nan' if al != al else f'{al:.2f}'} accept {_pct(ar)}")
    return "  ".join(parts)


def lines_of(events: Iterable[Event | None], c: Palette, counts: dict[str, int]) -> Iterator[str]:
    """Rendered lines: a stats event waits for the SpecDecoding line that may follow it."""
    pending: Event | None = None
    capacity_shown = False
    for ev in events:
        if ev is None:  # a line the reader does not show, or a pause in follow mode: flush
            if pending:
                yield render(pending, None, c)
                pending = None
            continue
        if ev.kind == "spec" and pending:
            yield render(pending, ev, c)
            pending = None
            continue
        if pending:
            yield render(pending, None, c)
            pending = None
        if ev.kind == "stats":
            counts["stats"] += 1
            pending = ev
        elif ev.kind == "bad":
            counts["unparsed"] += 1
        elif ev.kind == "capacity" and not capacity_shown:
            capacity_shown = True
            d = ev.data
            yield c("1", f"{ev.time}  {d['device']} KV cache: {d['tokens']:,} tokens, "
                         f"{d['concurrency']:.2f}x concurrency at {d['context']:,} tokens per request")
        elif ev.kind in ("warning", "error"):
            yield f"{ev.time}  {c('31' if ev.kind == 'error' else '33', ev.kind.upper())} {ev.text}"
    if pending:
        yield render(pending, None, c)


def follow(path: Path, start_lines: int, poll: float = 0.05, stop: float | None = None) -> Iterator[str | None]:
    """The last ``start_lines`` lines of ``path``, then every new line, across rotation.

    Yields None when nothing arrived for a poll interval (so a waiting stats line is flushed).
    A line cut in half by a write in progress is held until its newline arrives.
    """
    fh = open(path, "rb")
    ino = os.fstat(fh.fileno()).st_ino
    yield from tail(fh, start_lines)
    seen = _before(fh, _MATCH)  # the bytes read last, to know logrotate's copy of this file
    buf = b""
    deadline = None if stop is None else time.monotonic() + stop
    while deadline is None or time.monotonic() < deadline:
        chunk = fh.read(1 << 16)
        if chunk:
            seen = (seen + chunk)[-_MATCH:]
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                yield raw.decode("utf-8", "replace")
            continue
        yield None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            time.sleep(poll)  # renamed away, the new file not there yet
            continue
        if st.st_ino != ino or st.st_size < fh.tell():  # rotated (renamed) or truncated (copytruncate)
            # whatever the writer added before the rotation: still in the renamed file, or, once
            # truncated, only in logrotate's copy
            buf += fh.read() if st.st_ino != ino else _from_copy(path, fh.tell(), seen)
            *done, buf = buf.split(b"\n")
            for raw in done:
                yield raw.decode("utf-8", "replace")
            fh.close()
            fh = open(path, "rb")
            ino = os.fstat(fh.fileno()).st_ino
            seen = b""
            continue
        time.sleep(poll)


_MATCH = 4096  # how many of the bytes read last must match for logrotate's copy to count as this file


def _before(fh: IO[bytes], n: int) -> bytes:
    """The up to ``n`` bytes before the position of ``fh``, which stays where it was."""
    pos = fh.tell()
    fh.seek(max(0, pos - n))
    return fh.read(pos - fh.tell())


def _from_copy(path: Path, pos: int, seen: bytes) -> bytes:
    """After a copytruncate: the bytes from ``pos`` on in the copy (``<path>.1``), if it is this file's copy.

    The lines written between the reader's last read and the truncation survive only there. The copy
    counts when its bytes before ``pos`` are the ones read last (it is uncompressed: delaycompress);
    with nothing read yet there is nothing to match, and an older rotation must not be replayed.
    """
    if not seen:
        return b""
    try:
        with open(path.with_name(path.name + ".1"), "rb") as cp:
            cp.seek(pos - len(seen))
            return cp.read() if cp.read(len(seen)) == seen else b""
    except OSError:  # no copy
        return b""


def tail(fh: IO[bytes], n: int) -> list[str]:
    """The last ``n`` complete lines of an open file; leaves the file at its end."""
    fh.seek(0, os.SEEK_END)
    end = fh.tell()
    size, data = 0, b""
    while end - size > 0 and data.count(b"\n") <= n:
        size = min(end, size + (1 << 16))
        fh.seek(end - size)
        data = fh.read(size)
    fh.seek(end)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:  # an unfinished last line: left for follow() to complete
        fh.seek(end - len(lines.pop()))
    return [ln.decode("utf-8", "replace") for ln in lines[-n:]] if n else []


def docker_lines(container: str, since: str) -> Iterator[str]:
    try:
        proc = subprocess.Popen(["docker", "logs", "--since", since, container], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
    except FileNotFoundError:
        raise BadInput(problem("docker", f"the docker client, to read the container {container!r}", "not found",
                               "read the log file instead: ./vllm-logs.sh -f")) from None
    assert proc.stdout
    first = True
    for line in proc.stdout:
        if first and ("No such container" in line or "Cannot connect to the Docker daemon" in line):
            proc.wait()
            raise BadInput(problem(f"container {container!r}", "a running container", line.strip(),
                                   "docker compose up -d, set VLLM_CONTAINER, or read the file: ./vllm-logs.sh -f"))
        first = False
        yield line
    proc.wait()


def show(s: Settings, follow_file: bool, lines: int | None, since: str, file: str | None) -> int:
    """``./vllm-logs.sh``: the stats lines of the log file (``-f`` follows it) or of the container."""
    color = Palette(sys.stdout.isatty() and not s.no_color)
    counts = {"stats": 0, "unparsed": 0}
    if follow_file or file:
        path = Path(file or s.log or "")
        if not file and not s.log:
            raise BadInput(problem("LOG", "the log file's path for -f", "empty", "LOG=/var/log/vllm.log"))
        if not path.is_file():
            raise BadInput(problem(str(path), "the engine's log file", "no such file",
                                   "point LOG or --file at the engine's log (is the server started?)"))
        n = lines if lines is not None else 500
        raw: Iterable[str | None] = follow(path, n) if follow_file else tail(open(path, "rb"), n)
    else:
        raw = docker_lines(s.container, since)
    try:
        events = (parse(x) if x is not None else None for x in raw)
        for out in lines_of(events, color, counts):
            plain(out)
    except KeyboardInterrupt:  # the usual end of -f
        pass
    if counts["unparsed"]:
        warn(f"vllm-logs: {counts['unparsed']} stats line(s) could not be parsed")
    return 0


