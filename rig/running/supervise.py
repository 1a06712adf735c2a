"""Start the engine, prove it healthy, and supervise it until it ends: three steps, one value for how it ended.

:func:`spawn` starts ``vllm serve`` in a session of its own (its process group holds the API server, EngineCore and
the workers; rig/running/enginerec.py keeps its record), :func:`wait_healthy` waits for a one-token chat completion
(``/v1/models`` is a static list that answers 200 while the engine is dead), and in the foreground
:func:`supervise` waits for the engine to end and says how, as one :class:`Ending`; :data:`ENDINGS` maps each to
the exit status, the message and the systemd notice. The API server's own exit status decides the ending: the log
writer records it the moment the server exits (rig/running/logpump.py ``--status``), so a server killed is never taken
for one that shut down, whatever the timing.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rig import REPO_ROOT
from rig.base.console import error, quote, say, warn
from rig.base.errors import WorkFailed, problem
from rig.build.buildlock import held_alone
from rig.facts.config import Serve, Settings
from rig.plan.engine import Engine, runtime_dir
from rig.plan.serve import Plan
from rig.running import logs, metrics, sdnotify, watchdog
from rig.running.enginerec import (
    Record,
    already_running,
    clear_runtime,
    create_time,
    engine_key,
    group_members,
    leftovers,
    load,
    own_runtime,
    pid_path,
    save,
    server_alive,
    stopped_by_rig,
    terminate,
)
from rig.running.health import connect_host, health, port_open

HEARTBEAT = 15.0  # seconds between "still waiting" lines
POLL = 0.25
#: Seconds between one-token requests once the port is open: a probe costs about 10 ms of the engine's time
#: (benchmarks/demo_start.py), and every second between the engine's readiness and the next probe is a second
#: added to the start.
RETRY = 0.5
#: Seconds the log writer gets to record the status of a server found gone (it polls its child every 0.2 s).
STATUS_GRACE = 3.0
#: The file in the engine's runtime folder where the log writer records the API server's exit status.
STATUS_FILE = "rig-server-status"


@dataclass(frozen=True)
class Launch:
    """What :func:`start` starts, and how; every hook is given when it is made (rig/control/start.py)."""

    s: Settings
    v: Serve
    engine: Engine
    foreground: bool
    health: dict = field(default_factory=dict)  # the profile's extra fields of the one-token request
    # Multi-node (rig/control/start.py, rig/nodes/): run once the engine is spawned, and once it is healthy; a headless
    # worker's health is what ``probe`` says (the head's API answered), not a request of its own.
    on_spawn: Callable[[], None] | None = None
    on_ready: Callable[[], None] | None = None
    probe: Callable[[], tuple[bool, str]] | None = None
    # The head's look at its workers while its engine starts: '' while all is well, else what is wrong (a worker
    # that joined but runs no engine), which ends the start instead of vLLM's init waiting until START_TIMEOUT.
    nodes_check: Callable[[], str] | None = None

    @classmethod
    def of(cls, plan: Plan, *, on_spawn: Callable[[], None] | None = None,
           on_ready: Callable[[], None] | None = None, probe: Callable[[], tuple[bool, str]] | None = None,
           nodes_check: Callable[[], str] | None = None) -> Launch:
        """The launch of the plan's engine, with this node's hooks."""
        return cls(plan.s, plan.v, plan.engine, foreground=plan.foreground, health=plan.profile.health,
                   on_spawn=on_spawn, on_ready=on_ready, probe=probe, nodes_check=nodes_check)


def _lock(s: Settings) -> IO[str]:
    return held_alone(s.state_dir / "engine.lock", "the engine lock", "another start",
                      "wait for that start to finish, then nox -s status")



@dataclass
class Spawned:
    """An engine just started: its process (the group's leader), its record, and its output's reader."""

    proc: subprocess.Popen
    rec: Record
    lines: logs.Lines


def start(launch: Launch) -> int:
    """Start the engine and wait until it is healthy; in the foreground, then supervise it until it ends."""
    s, v = launch.s, launch.v
    spawned = spawn(launch)
    if spawned is None:
        return 0
    proc, rec = spawned.proc, spawned.rec
    say(f"engine started: pid {proc.pid}" + (f", log {s.log}" if s.log else ", output below"))
    if launch.on_spawn:
        launch.on_spawn()
    sdnotify.notify(f"STATUS=starting the engine (pid {proc.pid})")
    stopping = _forward_signals(rec) if launch.foreground else threading.Event()
    try:
        wait_healthy(launch, spawned, stopping)
    except KeyboardInterrupt:
        if not launch.foreground:
            say(f"stopped waiting; the engine keeps starting (pid {proc.pid}): nox -s status, or nox -s stop")
            return 130
        raise
    except WorkFailed:
        # The whole group, its leader gone or not: EngineCore and the workers outlive the server, and nothing of
        # a failed engine may still run (or clean up) when the next one starts (an update's rollback).
        terminate(rec.pgid, v.stop_timeout)
        pid_path(s).unlink(missing_ok=True)
        if not group_members(rec.pgid):
            clear_runtime(s, rec.runtime)
        raise
    if not launch.foreground:
        return 0
    if rec.ready:  # healthy, not stopped while starting: systemd's Type=notify start is over
        sdnotify.notify("READY=1", f"STATUS=ready: {v.names[0]} on {s.host}:{s.port}, pid {proc.pid}")
    return report(s, rec, supervise(s, v, rec, proc, stopping))


def spawn(launch: Launch) -> Spawned | None:
    """Under the engine lock: ``vllm serve`` (behind the log writer when there is a log) in a session of its own,
    with a runtime folder of its own, and its record; None when an engine already runs (said)."""
    s, v = launch.s, launch.v
    with _lock(s):
        if rec := load(s):
            already_running(rec, attached=launch.foreground)
            return None
        v.cache_root.mkdir(parents=True, exist_ok=True)
        own, ended, left = own_runtime(s, v.stop_timeout)
        if ended or left:
            say(f"an engine that is gone left {ended} process(es) running and {left} file(s) in {runtime_dir(s)}: "
                "ended and removed before this start")
        argv, env, offset = launch.engine.argv, sdnotify.engine_env(launch.engine.full_env()), 0
        env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(own)
        if s.log:
            offset = _banner(s.log, argv[0])
            # The pump leads the group and writes the log, following a rotation by rename.
            # Run as a script (standard library only): no PYTHONPATH to the repository reaches the engine, where
            # the tree's folder vllm/ would shadow the installed package as a namespace package.
            argv = [sys.executable, str(REPO_ROOT / "rig" / "running" / "logpump.py"), s.log, "--status",
                    str(own / STATUS_FILE), "--", *argv]
        # A detached engine must not hold the caller's terminal or pipes: with a log, nothing is inherited.
        out = subprocess.DEVNULL if s.log else subprocess.PIPE
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.DEVNULL if s.log else subprocess.STDOUT, env=env, cwd=s.root,
                                start_new_session=True)
        rec = Record(pid=proc.pid, pgid=proc.pid, create_time=create_time(proc.pid), started=time.time(),
                     host=s.host, port=s.port, model=v.names[0], log=s.log,
                     supervisor=os.getpid() if launch.foreground else 0, health=json.dumps(launch.health),
                     ckpt=str(s.ckpt), runtime=str(own))
        save(s, rec)
    return Spawned(proc, rec, logs.Lines(Path(s.log) if s.log else None, offset, proc.stdout))


def _banner(log: str, program: str) -> int:
    """The start's line in the log; the log's size after it (where this engine's lines begin)."""
    with logs.open_log(log) as log_fh:
        try:
            log_fh.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {program} serve\n".encode())
        except OSError as exc:  # a full disk must not keep the engine down: its log writer copes
            warn(f"LOG {log}: {exc.strerror}: the engine starts anyway; its log writer drops what it cannot write "
                 "and says how much once the disk has room")
        return os.fstat(log_fh.fileno()).st_size


# -- how the engine ended ----------------------------------------------------------------------------------------


class Ending(enum.Enum):
    """How a supervised engine ended."""

    SIGNAL = "the supervisor was told to stop (SIGTERM, SIGINT, SIGHUP)"
    STOPPED = "nox -s stop ended it (the unit's ExecStop, a second terminal)"
    HUNG = "the hang watchdog ended it"
    SHUTDOWN = "the API server exited 0 on its own: vLLM's answer to a dead EngineCore"
    FAILED = "the API server exited with an error status"
    KILLED = "the API server was killed by a signal"
    LEADER = "the log writer, the group's leader, was killed (the server's status is unknown)"


@dataclass(frozen=True)
class Ended:
    """One supervised engine's end: how, the API server's own exit status (negative: a signal; None: unknown),
    and the processes of its group the supervisor ended after it."""

    how: Ending
    status: int | None
    left: str = ""


def _signal_name(status: int | None) -> str:
    return signal.Signals(-status).name if status is not None and status < 0 else "a signal"


_RESTART = "so systemd's Restart=on-failure starts it again"
#: Each ending: the supervisor's exit status, whether it is an error, and its words (``{status}``, ``{sig}``,
#: ``{left}``, ``{log}`` filled in), and the systemd notice.
ENDINGS: dict[Ending, tuple[int, bool, str, str]] = {
    Ending.SIGNAL: (0, False, "engine stopped (exit {status})", ""),
    Ending.STOPPED: (0, False, "engine stopped by nox -s stop (exit {status})", "STATUS=stopped by nox -s stop"),
    Ending.HUNG: (1, False, f"engine stopped by the hang watchdog (its exit {{status}}); exit 1, {_RESTART}",
                  "STATUS=stopped by the hang watchdog"),
    Ending.SHUTDOWN: (1, True, "the engine|running until it is stopped|it ended on its own with exit 0 (vLLM's API "
                      "server does that when its EngineCore has died)|nothing by hand: the supervisor exits 1, "
                      "so systemd restarts it; why it died is in {log}", "STATUS=the engine ended on its own"),
    Ending.FAILED: (1, True, "the engine|running until it is stopped|its API server exited with status {status}"
                    "{left}|nothing by hand: the supervisor exits 1, so systemd restarts it; why is in {log}",
                    "STATUS=the engine failed"),
    Ending.KILLED: (1, True, "the engine's API server|running while its engine runs|gone: killed by {sig}{left}|"
                    "nothing by hand: the rig ended the group and exits 1, so systemd restarts it",
                    "STATUS=the engine's API server was killed"),
    Ending.LEADER: (1, True, "the engine's log writer (its group's leader)|running until the engine is stopped|"
                    "killed by {sig}|nothing by hand: the rig ended the group and exits 1, so systemd restarts it",
                    "STATUS=the engine's log writer was killed"),
}


def report(s: Settings, rec: Record, ended: Ended) -> int:
    """Say how the engine ended (:data:`ENDINGS`), notify systemd, and return the supervisor's exit status."""
    code, is_error, words, notice = ENDINGS[ended.how]
    metrics.add(s.state_dir, "rig_engine_ends_total", cause=ended.how.name.lower())
    left = f", leaving {ended.left} in its group (pid {rec.pgid})" if ended.left else ""
    text = words.format(status=ended.status, sig=_signal_name(ended.status), left=left,
                        log=s.log or "the output above")
    if is_error:
        error(problem(*text.split("|")))
    else:
        say(text)
    if ended.how is Ending.STOPPED:
        sdnotify.notify("STOPPING=1", notice)
    elif notice:
        sdnotify.notify(notice)
    return code


def supervise(s: Settings, v: Serve, rec: Record, proc: subprocess.Popen, stopping: threading.Event) -> Ended:
    """Until the engine has ended, with the hang watchdog on a healthy engine; then nothing of it is left."""
    watch = _watch(s, v, rec, stopping) if v.hang_window and rec.ready else None
    hung = lambda: bool(watch and watch.hang)  # noqa: E731 - read again at each look
    status, leader, orphans = _wait_server(s, rec, proc, lambda: stopping.is_set() or hung())
    by_rig = stopped_by_rig(s, rec)  # before this supervisor removes the pid file itself
    if watch:
        watch.stop(v.stop_timeout + 10)  # a hang being handled: its terminate() finishes first
    leftover = terminate(rec.pgid, v.stop_timeout)  # what the server left behind
    pid_path(s).unlink(missing_ok=True)
    clear_runtime(s, rec.runtime)
    if leftover and not orphans:
        warn(f"the engine left {len(leftover)} process(es) behind; they were stopped")
    # Nothing recorded: the log writer was killed (its status says by what), or it passed the server's on.
    leader_killed = status is None and (leader is None or leader < 0)
    status = leader if status is None else status
    how = (Ending.SIGNAL if stopping.is_set() else Ending.HUNG if hung() else Ending.STOPPED if by_rig
           else Ending.LEADER if leader_killed else Ending.SHUTDOWN if status == 0
           else Ending.KILLED if status < 0 else Ending.FAILED)
    return Ended(how, status, orphans)


def _wait_server(s: Settings, rec: Record, proc: subprocess.Popen,
                 ending: Callable[[], bool]) -> tuple[int | None, int | None, str]:
    """Until the API server has exited: (its own exit status, None when unknown; the group leader's, None while it
    runs; the processes the server left in the group). Without a log the server leads the group. With a log the
    leader is the log writer, which outlives the server while its children keep the output pipe open (a killed
    server can leave EngineCore holding it, and its memory): each second the server is looked for by its command
    line, unless the group is being ended already (``ending``), and its status is what the log writer recorded."""
    while True:
        try:
            code = proc.wait(timeout=1.0)
            return (_recorded_status(rec, wait=code >= 0) if s.log else code), code, ""
        except subprocess.TimeoutExpired:
            pass
        if ending() or server_alive(rec) or stopped_by_rig(s, rec):
            continue
        return _recorded_status(rec, wait=True), None, leftovers(rec)


def _recorded_status(rec: Record, wait: bool) -> int | None:
    """The API server's exit status as the log writer recorded it, waiting up to ``STATUS_GRACE`` for it when
    ``wait`` (a killed log writer records nothing); None when there is none."""
    path = Path(rec.runtime) / STATUS_FILE
    end = time.monotonic() + (STATUS_GRACE if wait else 0.0)
    while True:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            if time.monotonic() >= end:
                return None
            time.sleep(0.1)


def _watch(s: Settings, v: Serve, rec: Record, stopping: threading.Event) -> watchdog.Watcher:
    """The hang watchdog of a healthy foreground engine: on a hang, one error line, the hang in the pid file
    and the log, the group ended; the supervisor then exits 1 (see start)."""
    def on_hang(verdict: watchdog.Verdict) -> None:
        since = time.strftime("%H:%M:%S", time.localtime(verdict.stall or verdict.t))
        error(problem("the engine", f"a token within HANG_WINDOW={v.hang_window} s while requests are pending",
                      f"{verdict.pending} request(s) pending and no token for {verdict.quiet:.0f} s (since {since}): "
                      "it is hung", f"nothing by hand: the rig ends its group (pid {rec.pgid}) and exits 1, so "
                      f"systemd restarts it; if it hangs again, {s.log or 'the output above'} is what to report"))
        try:  # what the hang leaves behind for status and the log; the group is ended whatever fails here
            rec.hang = verdict.line()
            save(s, rec)
            sdnotify.notify(f"STATUS=hung: {verdict.line()}; stopping the engine")
            if s.log:
                with open(s.log, "ab") as fh:
                    fh.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} hang watchdog: {verdict.line()}; "
                             "stopping the engine group\n".encode())
        finally:
            terminate(rec.pgid, v.stop_timeout)

    return watchdog.Watcher(s.host, s.port, v.hang_window, s.state_dir, engine_key(rec), on_hang, stopping,
                            say=say).start()



def _forward_signals(rec: Record) -> threading.Event:
    """In the foreground, SIGTERM/SIGINT/SIGHUP to the supervisor go to the whole engine group."""
    stopping = threading.Event()

    def handler(signum, _frame) -> None:
        if not stopping.is_set():
            sdnotify.notify("STOPPING=1", f"STATUS=stopping the engine ({signal.Signals(signum).name})")
        stopping.set()
        try:
            os.killpg(rec.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    return stopping


def _api_check(s: Settings, v: Serve, rec: Record, deadline: float) -> Callable[[], tuple[bool, str, bool]]:
    """The engine's own health while it starts: its port, then a one-token generation; (healthy, what to say,
    whether a request was sent)."""
    def check() -> tuple[bool, str, bool]:
        if not port_open(s.host, s.port):
            return False, "not listening yet", False
        ok, detail = health(s.host, s.port, v.names[0], v.api_key,
                            timeout=max(1.0, min(120.0, deadline - time.monotonic())), extra=json.loads(rec.health))
        if not ok:
            return False, detail, True
        return True, (f"http://{connect_host(s.host)}:{s.port}/v1, model {', '.join(v.names)} (a one-token "
                      "generation answered)"), True
    return check


def wait_healthy(launch: Launch, spawned: Spawned, stopping: threading.Event) -> None:
    """Until the engine is healthy (then the launch's ``on_ready``), stopped by a signal, or failed (WorkFailed)."""
    s, rec = launch.s, spawned.rec
    _wait_healthy(s, launch.v, rec, spawned.proc, spawned.lines, quiet=not s.log, stopping=stopping,
                  probe=launch.probe, nodes_check=launch.nodes_check)
    if launch.on_ready and rec.ready:
        launch.on_ready()


def _wait_healthy(s: Settings, v: Serve, rec: Record, proc: subprocess.Popen, lines: logs.Lines, quiet: bool,
                  stopping: threading.Event, probe: Callable[[], tuple[bool, str]] | None = None,
                  nodes_check: Callable[[], str] | None = None) -> None:
    t0 = time.monotonic()
    next_nodes = t0
    deadline = t0 + v.start_timeout
    last_beat = t0
    next_try = t0
    last_detail = "not listening yet"
    check = (lambda: (*probe(), True)) if probe else _api_check(s, v, rec, deadline)
    while True:
        for line in lines.new():
            note = None if quiet else logs.notable(line)
            if note:
                kind, text = note
                say(f"{'engine ' + kind + ': ' if kind in ('warning', 'error') else ''}{text}")
            if logs.CAPACITY.search(line):
                rec.capacity = logs.CAPACITY.search(line)[0]
        if (code := proc.poll()) is not None:
            if stopping.is_set():
                return  # stopped by a signal while starting: not a failure
            list(lines.new())  # the last lines, into lines.tail
            if s.log:
                for line in list(lines.tail)[-15:]:
                    quote(line, err=True)
            raise WorkFailed(problem("the engine", "a healthy start (a one-token generation)", f"it exited with code "
                                     f"{code} after {time.monotonic() - t0:.0f} s, before it was healthy"
                                     + (" (its last lines are above)" if s.log else ""),
                                     f"see why in the full log, {s.log}" if s.log else "see why in its output above"))
        now = time.monotonic()
        if nodes_check and now >= next_nodes:
            next_nodes = now + 1.0
            if wrong := nodes_check():
                raise WorkFailed(problem("the head's engine", "every worker that joined running its engine", wrong,
                                         "see that worker's start: an engine of the rig already running there "
                                         "refuses to join (nox -s stop on it), then start the head again"))
        if now >= next_try:
            ok, last_detail, asked = check()
            if ok:
                rec.ready = time.time()
                save(s, rec)
                say(f"ready in {time.monotonic() - t0:.1f} s: {last_detail}")
                metrics.add(s.state_dir, "rig_engine_starts_total")
                metrics.put(s.state_dir, "rig_engine_start_seconds", round(rec.ready - rec.started, 3))
                if rec.capacity:
                    say(rec.capacity)
                return
            if asked:  # a port not open yet is looked at again at the next poll
                next_try = time.monotonic() + RETRY
        if now >= deadline:
            raise WorkFailed(problem("the engine", "a healthy start (a one-token generation)", f"none: not healthy "
                                     f"within START_TIMEOUT={v.start_timeout} s (last check: {last_detail}); it was "
                                     "stopped", "raise START_TIMEOUT for a slow first start"))
        if now - last_beat >= HEARTBEAT:
            last_beat = now
            say(f"waiting for the engine: {now - t0:.0f} s, health: {last_detail}")
            sdnotify.notify(f"STATUS=starting: {now - t0:.0f} s, health: {last_detail}")
        time.sleep(POLL)


