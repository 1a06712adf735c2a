"""The hang watchdog: requests pending and no token generated for ``HANG_WINDOW`` seconds is a hung engine.

A hung EngineCore (a stuck collective, a deadlocked step) leaves the API server answering ``/v1/models`` and
``/health``; only the engine's own numbers show it. They come from vLLM's Prometheus endpoint (``GET /metrics``
on the engine's host and port, not guarded by the API key): the gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` and the counter ``vllm:generation_tokens_total``, each summed over its label sets
(one per engine and model name). The gauges are the scheduler's, sent by EngineCore with each step, so a core
stuck in a step leaves them at the requests it was running; a core that hung while idle reports none pending,
and only a health check sees that one.

The decision (:class:`Tracker`) is pure: it gets samples (time, pending, tokens) and says idle, generating,
stalled or hung, so it is tested without a server or a sleep. The HTTP side (:func:`probe`) and the foreground
supervisor's thread (:class:`Watcher`) feed it; its state is saved in ``RIG_STATE/watchdog.json``, where
``nox -s status`` reads the supervisor's, or, for a detached engine that nobody samples continuously, compares
its own sample with the last one saved (:class:`Look`).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rig.base import atomic
from rig.base.console import say as console_say
from rig.running.health import connect_host

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TOKENS = "vllm:generation_tokens_total"
METRICS = (RUNNING, WAITING, TOKENS)

# name, optional {labels} (quoted values may hold '}', spaces and escaped quotes), value; a timestamp may follow
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+(\S+)')

IDLE, GENERATING, UNKNOWN, STALLED, HUNG = "idle", "generating", "unknown", "stalled", "hung"


def parse(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text exposition with its values summed over the label sets.
    ``# HELP``/``# TYPE`` lines and other comments are skipped, and so are values that are not finite."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue  # a comment, a blank line, or a line of another format
        try:
            value = float(m[3])
        except ValueError:
            continue
        if math.isfinite(value):
            out[m[1]] = out.get(m[1], 0.0) + value
    return out


@dataclass(frozen=True)
class Sample:
    t: float  # wall-clock seconds: samples are compared across processes (the supervisor's, a later status)
    pending: int  # running + waiting
    tokens: float  # generation tokens so far


def sample(values: Mapping[str, float], t: float) -> Sample | str:
    """The sample of parsed ``/metrics`` values, or why there is none: a missing metric is not a hang."""
    missing = [name for name in METRICS if name not in values]
    if missing:
        return f"/metrics has no {', '.join(missing)} (not vLLM's, or an older one)"
    return Sample(t, int(values[RUNNING] + values[WAITING]), values[TOKENS])


@dataclass(frozen=True)
class Verdict:
    """What the samples so far say. ``stall``: the first sample of the current run in which requests were
    pending and the counter stood still (None: none), so ``quiet`` is a time in which no token certainly came."""

    state: str
    t: float
    pending: int
    tokens: float
    progress: float  # when the counter was first seen at its current value
    stall: float | None
    window: int  # 0: off

    @property
    def quiet(self) -> float:
        return 0.0 if self.stall is None else self.t - self.stall

    @property
    def hung(self) -> bool:
        return self.state == HUNG

    def line(self) -> str:
        n = f"{self.pending} request{'s' if self.pending != 1 else ''} pending"
        window = f"window {self.window} s" if self.window else "HANG_WINDOW=0: never called hung"
        if self.state == IDLE:
            return (f"idle (no request pending; {self.tokens:.0f} tokens generated so far, the last by "
                    f"{_hms(self.progress)})")
        if self.state == GENERATING:
            return f"generating ({n}, {self.tokens:.0f} tokens so far)"
        if self.state == UNKNOWN:
            return f"{n}; whether tokens come is not known from one sample ({window})"
        since = _hms(self.t if self.stall is None else self.stall)
        if self.hung:  # hung since the window ran out
            return (f"hung: no tokens for {self.quiet:.0f} s with {n} ({window}; none since {since}, hung since "
                    f"{_hms(self.t - self.quiet + self.window)})")
        return f"no tokens for {self.quiet:.0f} s with {n} ({window}; none since {since})"


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


@dataclass
class Tracker:
    """The watchdog's memory between samples; ``observe`` is the whole decision.

    The stall starts at the first sample that sees requests pending with the counter at its current value, not
    at the last token before it: an engine idle for an hour that just got a request has not been quiet for an
    hour. So a hang is called at most one sampling interval late, never early.
    """

    window: int  # seconds; 0: never hung
    t: float = 0.0
    pending: int = 0
    tokens: float = 0.0
    progress: float = 0.0
    stall: float | None = None
    moved: bool = False  # the counter grew between the last two samples
    samples: int = 0

    def observe(self, s: Sample) -> Verdict:
        fresh = self.samples == 0 or s.tokens < self.tokens  # the first sample, or a counter reset (a new engine)
        self.moved = not fresh and s.tokens > self.tokens
        if fresh or self.moved:
            self.progress = s.t
        if s.pending <= 0:
            self.stall = None
        elif fresh or self.moved or self.stall is None:
            self.stall = s.t
        self.t, self.pending, self.tokens = s.t, s.pending, s.tokens
        self.samples = 1 if fresh else self.samples + 1
        return self.verdict()

    def verdict(self) -> Verdict:
        if self.pending <= 0:
            state = IDLE
        elif self.moved:
            state = GENERATING
        elif self.stall == self.t:
            state = UNKNOWN  # pending since this sample: no time has passed in which a token could have come
        elif self.window and self.stall is not None and self.t - self.stall >= self.window:
            state = HUNG
        else:
            state = STALLED
        return Verdict(state, self.t, self.pending, self.tokens, self.progress, self.stall, self.window)


def interval(window: int) -> float:
    """Seconds between the supervisor's samples: a tenth of the window, from 0.5 to 5 s. A hang is seen at most
    one interval late (5 s: under 2% of the 300 s default); one GET of a few kB every 5 s is nothing beside the
    engine; a window of a few seconds (the tests) still gets several samples."""
    return min(5.0, max(0.5, window / 10))


def fetch(host: str, port: int, timeout: float = 5.0) -> str:
    """``GET /metrics``: the text, or OSError / HTTPException."""
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace")
    finally:
        conn.close()
    if resp.status != 200:
        raise http.client.HTTPException(f"HTTP {resp.status} from /metrics")
    return body


Fetch = Callable[[str, int], str]


def probe(host: str, port: int, clock: Callable[[], float] = time.time, get: Fetch = fetch) -> Sample | str:
    """One sample of the engine, or why there is none."""
    t = clock()
    try:
        text = get(host, port)
    except (OSError, http.client.HTTPException) as exc:
        return f"/metrics did not answer ({exc.__class__.__name__}: {exc})"
    return sample(parse(text), t)


# --- the saved state: RIG_STATE/watchdog.json --------------------------------------------------------------------

def state_path(state_dir: Path) -> Path:
    return state_dir / "watchdog.json"


@dataclass
class Saved:
    engine: str  # which engine the samples are of (its pid file's pid and start time): another's are not compared
    by: str  # "supervisor" (samples continuously) or "status" (samples when asked)
    checked: float  # when the last probe was made, answered or not
    tracker: Tracker
    note: str = ""  # why the last probe had no sample; empty when it had one


def load(state_dir: Path, engine: str) -> Saved | None:
    """The saved state of ``engine``; None when there is none, it is another engine's, or it is unreadable."""
    try:
        data = json.loads(state_path(state_dir).read_text())
        known = {f.name for f in fields(Tracker)}
        tracker = Tracker(**{k: v for k, v in data.pop("tracker").items() if k in known})
        saved = Saved(tracker=tracker, **{k: data[k] for k in ("engine", "by", "checked", "note") if k in data})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return saved if saved.engine == engine else None


def save(state_dir: Path, saved: Saved) -> None:
    atomic.write_text(state_path(state_dir), json.dumps(asdict(saved), indent=1) + "\n")


# --- the foreground supervisor's thread ---------------------------------------------------------------------------

class Watcher:
    """Samples ``/metrics`` every :func:`interval` seconds from a daemon thread, saves what it saw for
    ``nox -s status``, and calls ``on_hang`` once, from that thread, when the engine is hung. ``stopping`` (a
    stop requested by a signal) quiets it: a drain is not a hang."""

    def __init__(self, host: str, port: int, window: int, state_dir: Path, engine: str,
                 on_hang: Callable[[Verdict], None], stopping: threading.Event | None = None,
                 clock: Callable[[], float] = time.time, get: Fetch = fetch,
                 say: Callable[[str], None] = console_say) -> None:
        self.host, self.port, self.state_dir, self.on_hang, self.say = host, port, state_dir, on_hang, say
        self.stopping = stopping or threading.Event()
        self.clock, self.get = clock, get
        self.saved = Saved(engine, "supervisor", 0.0, Tracker(window))
        self.hang: Verdict | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """End the thread; waits for a hang being handled (``on_hang`` stops the engine) up to ``timeout``."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def poll(self) -> Verdict | str:
        """One sample, judged and saved: the thread's whole step (the tests call it directly)."""
        got = probe(self.host, self.port, self.clock, self.get)
        self.saved.checked = self.clock()
        if isinstance(got, str):
            if not self.saved.note:
                self.say(f"hang watchdog: {got}; a missing sample is not a hang, it keeps trying")
            self.saved.note = got
            save(self.state_dir, self.saved)
            return got
        if self.saved.note:
            self.say("hang watchdog: /metrics answers again")
            self.saved.note = ""
        verdict = self.saved.tracker.observe(got)
        save(self.state_dir, self.saved)
        if verdict.hung and self.hang is None and not self.stopping.is_set():
            self.hang = verdict
            self.on_hang(verdict)
        return verdict

    def _run(self) -> None:
        every = interval(self.saved.tracker.window)
        try:
            while not self._done.wait(every) and not self.stopping.is_set() and self.hang is None:
                self.poll()
        except Exception as exc:  # a bug here must not take the engine down: say so, and leave it unwatched
            self.say(f"hang watchdog: failed ({exc.__class__.__name__}: {exc}); the engine runs on unwatched")


# --- what nox -s status knows ------------------------------------------------------------------------------------

class Look:
    """The watchdog as ``nox -s status`` sees it. Under a foreground supervisor that samples continuously, what
    the supervisor saved. Otherwise (a detached engine, or a supervisor that does not sample) status samples
    itself and compares with the last sample saved, by status or the supervisor: two calls a window apart see
    a hang, one call sees only how things stand now."""

    def __init__(self, state_dir: Path, engine: str, host: str, port: int, window: int, supervisor: int,
                 clock: Callable[[], float] = time.time, get: Fetch = fetch) -> None:
        self.state_dir, self.engine, self.host, self.port, self.window = state_dir, engine, host, port, window
        self.supervisor, self.clock, self.get = supervisor, clock, get
        self.verdict: Verdict | None = None
        self.source = ""
        self.note = ""

    def _supervisors(self) -> Saved | None:
        """The supervisor's saved state while it is fresh: sampled within three of its intervals (and a margin)."""
        saved = load(self.state_dir, self.engine) if self.supervisor else None
        if saved and saved.by == "supervisor" and self.clock() - saved.checked <= 3 * interval(
                saved.tracker.window) + 2:
            return saved
        return None

    def take(self) -> Look:
        """Read the supervisor's state, or take a sample and compare it with the saved one; returns self."""
        now = self.clock()
        if saved := self._supervisors():
            self.verdict = saved.tracker.verdict() if saved.tracker.samples else None
            self.note = saved.note
            every = interval(saved.tracker.window)
            self.source = (f"the supervisor (pid {self.supervisor}) samples /metrics every {every:g} s, the last "
                           f"{now - saved.checked:.0f} s ago")
            return self
        if self.window == 0:
            self.verdict, self.note, self.source = None, "", ""
            return self
        saved = load(self.state_dir, self.engine)
        before = saved.tracker.t if saved and saved.tracker.samples else 0.0
        by = saved.by if saved else ""
        tracker = saved.tracker if saved else Tracker(self.window)
        tracker.window = self.window  # status judges by its own HANG_WINDOW: nobody else watches this engine
        got = probe(self.host, self.port, self.clock, self.get)
        if isinstance(got, str):
            self.note = got
            self.verdict = None
            return self
        self.note = ""
        self.verdict = tracker.observe(got)
        save(self.state_dir, Saved(self.engine, "status", self.clock(), tracker))
        who = ("nobody samples a detached engine continuously" if not self.supervisor else
               f"the supervisor (pid {self.supervisor}) saved no recent sample (HANG_WINDOW=0 when it started?)")
        self.source = (f"{who}: this sample against the one {by} saved {got.t - before:.0f} s ago" if before else
                       f"{who}: the first sample of this engine, nox -s status again compares with it")
        return self

    @property
    def hung(self) -> bool:
        return bool(self.verdict and self.verdict.hung)

    def line(self) -> str:
        if self.verdict is None and not self.note:
            return ("off (HANG_WINDOW=0)" if not self.source else f"no sample yet ({self.source})")
        if self.verdict is None:
            return f"no sample: {self.note}" + (f" ({self.source})" if self.source else "")
        return f"{self.verdict.line()}; {self.source}"
