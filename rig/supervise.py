"""Start, stop and report the engine process; prove it healthy.

The engine runs in its own session (so its process group holds the API server, EngineCore
and the workers), with a pid file (``RIG_STATE/engine.toml``) naming the group. Healthy means
a one-token chat completion succeeded: ``/v1/models`` is a static list that answers 200 while
the engine is dead. Stop (:func:`stop`, what ``nox -s stop`` and a worker's agent run) is SIGTERM
to the whole group, a wait, SIGKILL, and then a check that no process of it is left: vLLM's
EngineCore and workers outlive a SIGKILL of the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import psutil
import tomli_w

from rig import REPO_ROOT, atomic, logs, sdnotify, watchdog
from rig.buildlock import held_alone
from rig.config import Serve, Settings
from rig.console import error, quote, say, warn
from rig.engine import Engine, runtime_dir
from rig.errors import BadInput, WorkFailed, problem
from rig.health import ENGINE_RECORD, connect_host, health, port_open
from rig.proc import alive

HEARTBEAT = 15.0  # seconds between "still waiting" lines
POLL = 0.25
#: Seconds between one-token requests once the port is open: a probe costs about 10 ms of the engine's time
#: (benchmarks/demo_start.py), and every second between the engine's readiness and the next probe is a second
#: added to the start.
RETRY = 0.5


@dataclass
class Record:
    """What the pid file says about a running engine."""

    pid: int
    pgid: int
    create_time: float  # psutil's, so a reused pid is not mistaken for the engine
    started: float
    host: str
    port: int
    model: str
    log: str
    supervisor: int = 0  # the foreground supervisor's pid, 0 when detached
    ready: float = 0.0
    capacity: str = ""
    health: str = "{}"  # the profile's extra fields of the one-token request, as JSON
    ckpt: str = ""  # what the API server serves: its command line names it after `serve`
    hang: str = ""  # set by the foreground supervisor's hang watchdog while it ends a hung engine
    stopping: int = 0  # the pid of a `nox -s stop` under way: a foreground supervisor then exits 0


def pid_path(s: Settings) -> Path:
    return s.state_dir / ENGINE_RECORD


def load(s: Settings) -> Record | None:
    """The pid file's record if its process still runs; a stale file is removed."""
    path = pid_path(s)
    try:
        data = tomllib.loads(path.read_text())
        rec = Record(**{k: v for k, v in data.items() if k in Record.__dataclass_fields__})  # older or newer rigs
    except FileNotFoundError:
        return None
    except (tomllib.TOMLDecodeError, TypeError):
        path.unlink(missing_ok=True)
        return None
    try:
        if abs(psutil.Process(rec.pid).create_time() - rec.create_time) < 1.0:
            return rec
    except psutil.NoSuchProcess:
        pass
    # The engine is gone; its group may not be (workers outliving the server): leave the file for stop.
    if group_members(rec.pgid):
        return rec
    path.unlink(missing_ok=True)
    clear_runtime(s)  # found dead: its sockets and temporary files go with it
    return None


def clear_runtime(s: Settings) -> int:
    """Remove the engine's runtime folder (rig/engine.py's runtime_dir) once no process of it is left; how many
    files it held."""
    d = runtime_dir(s)
    if not d.is_dir() or d.is_symlink():
        return 0
    n = sum(1 for _ in d.rglob("*"))
    shutil.rmtree(d, ignore_errors=True)
    return n


def fresh_runtime(s: Settings) -> int:
    """An empty runtime folder for the engine about to start (any start of the rig's command, bare ones too);
    how many files a gone engine had left there."""
    left = clear_runtime(s)
    runtime_dir(s).mkdir(mode=0o700, parents=True, exist_ok=True)
    return left


def server_alive(rec: Record) -> bool:
    """Whether the engine's API server still runs. The group leader is not proof: the log writer outlives a
    killed server while EngineCore keeps its output pipe open, so the server is found by its command line
    (``serve CKPT``) among the group's members; EngineCore and the workers rename themselves ``VLLM::...``."""
    if not rec.ckpt:  # a record of an older rig: the leader is all it knows
        try:
            return abs(psutil.Process(rec.pid).create_time() - rec.create_time) < 1.0
        except psutil.NoSuchProcess:
            return False
    for pid in group_members(rec.pgid):
        try:
            cmd = psutil.Process(pid).cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # [python,] .../vllm serve CKPT ...: the log writer also names them, after its own arguments
        if "serve" in cmd[:3] and rec.ckpt in cmd[cmd.index("serve"):]:
            return True
    return False


def leftovers(rec: Record) -> str:
    """The engine processes left in the group of a dead server, as ``pid (name)`` for a message."""
    names = []
    for pid in group_members(rec.pgid):
        try:
            names.append(f"{pid} ({psutil.Process(pid).name()})")
        except psutil.NoSuchProcess:
            continue
    return ", ".join(names)


def save(s: Settings, rec: Record) -> None:
    head = "# The engine the rig started (nox -s stop reads it).\n"
    atomic.write_text(pid_path(s), head + tomli_w.dumps(asdict(rec)))


def group_members(pgid: int) -> list[int]:
    """Every live process in the process group (zombies excluded: they hold nothing)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


@dataclass(frozen=True)
class Launch:
    """What :func:`start` starts, and how; every hook is given when it is made (rig/start.py)."""

    s: Settings
    v: Serve
    engine: Engine
    foreground: bool
    health: dict = field(default_factory=dict)  # the profile's extra fields of the one-token request
    # Multi-node (rig/start.py, rig/nodes/): run once the engine is spawned, and once it is healthy; a headless
    # worker's health is what ``probe`` says (the head's API answered), not a request of its own.
    on_spawn: Callable[[], None] | None = None
    on_ready: Callable[[], None] | None = None
    probe: Callable[[], tuple[bool, str]] | None = None
    # The head's look at its workers while its engine starts: '' while all is well, else what is wrong (a worker
    # that joined but runs no engine), which ends the start instead of vLLM's init waiting until START_TIMEOUT.
    nodes_check: Callable[[], str] | None = None


def _lock(s: Settings) -> IO[str]:
    return held_alone(s.state_dir / "engine.lock", "the engine lock", "another start",
                      "wait for that start to finish, then nox -s status")


def running_message(rec: Record) -> str:
    return (f"already running: pid {rec.pid}, {rec.host}:{rec.port}, up {ago(rec.started)}; nothing started "
            "(nox -s stop first to restart it)")


def start(launch: Launch) -> int:
    """Start the engine and wait until it is healthy; in the foreground, then wait for it to end."""
    s, v = launch.s, launch.v
    with _lock(s):
        if rec := load(s):
            if launch.foreground:
                raise BadInput(problem("the engine", "not running", f"pid {rec.pid} on {rec.host}:{rec.port}",
                                       "nox -s stop, then start again"))
            say(running_message(rec))
            return 0
        v.cache_root.mkdir(parents=True, exist_ok=True)
        if left := fresh_runtime(s):
            say(f"removed {left} file(s) an engine that is gone left in {runtime_dir(s)}")
        argv, env, offset = launch.engine.argv, sdnotify.engine_env(launch.engine.full_env()), 0
        if s.log:
            with logs.open_log(s.log) as log_fh:
                try:
                    log_fh.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {argv[0]} serve\n".encode())
                except OSError as exc:  # a full disk must not keep the engine down: its log writer copes
                    warn(f"LOG {s.log}: {exc.strerror}: the engine starts anyway; its log writer drops what it "
                         "cannot write and says how much once the disk has room")
                offset = os.fstat(log_fh.fileno()).st_size
            # The pump leads the group and writes the log, following a rotation by rename.
            # Run as a script (standard library only): no PYTHONPATH to the repository reaches the engine, where
            # the tree's folder vllm/ would shadow the installed package as a namespace package.
            argv = [sys.executable, str(REPO_ROOT / "rig" / "logpump.py"), s.log, "--", *argv]
        # A detached engine must not hold the caller's terminal or pipes: with a log, nothing is inherited.
        out = subprocess.DEVNULL if s.log else subprocess.PIPE
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.DEVNULL if s.log else subprocess.STDOUT, env=env, cwd=s.root,
                                start_new_session=True)
        rec = Record(pid=proc.pid, pgid=proc.pid, create_time=_create_time(proc.pid), started=time.time(),
                     host=s.host, port=s.port, model=v.names[0], log=s.log,
                     supervisor=os.getpid() if launch.foreground else 0, health=json.dumps(launch.health),
                     ckpt=str(s.ckpt))
        save(s, rec)
    lines = logs.Lines(Path(s.log) if s.log else None, offset, proc.stdout)
    say(f"engine started: pid {proc.pid}" + (f", log {s.log}" if s.log else ", output below"))
    if launch.on_spawn:
        launch.on_spawn()
    sdnotify.notify(f"STATUS=starting the engine (pid {proc.pid})")
    stopping = _forward_signals(rec) if launch.foreground else threading.Event()
    try:
        _wait_healthy(s, v, rec, proc, lines, quiet=not s.log, stopping=stopping, probe=launch.probe,
                      nodes_check=launch.nodes_check)
        if launch.on_ready and rec.ready:
            launch.on_ready()
    except KeyboardInterrupt:
        if not launch.foreground:
            say(f"stopped waiting; the engine keeps starting (pid {proc.pid}): nox -s status, or nox -s stop")
            return 130
        raise
    except WorkFailed:
        if proc.poll() is None:
            terminate(rec.pgid, v.stop_timeout)
        pid_path(s).unlink(missing_ok=True)
        if not group_members(rec.pgid):
            clear_runtime(s)
        raise
    if not launch.foreground:
        return 0
    if rec.ready:  # healthy, not stopped while starting: systemd's Type=notify start is over
        sdnotify.notify("READY=1", f"STATUS=ready: {v.names[0]} on {s.host}:{s.port}, pid {proc.pid}")
    watch = _watch(s, v, rec, stopping) if v.hang_window and rec.ready else None
    code, orphaned = _wait_engine(s, v, rec, proc, lambda: stopping.is_set() or bool(watch and watch.hang))
    by_rig = not orphaned and _stopped_by_rig(s, rec)  # before this supervisor removes the pid file itself
    if watch:
        watch.stop(v.stop_timeout + 10)  # a hang being handled: its terminate() finishes first
    leftover = terminate(rec.pgid, v.stop_timeout)  # workers the server left behind
    pid_path(s).unlink(missing_ok=True)
    clear_runtime(s)
    if leftover:
        warn(f"the engine left {len(leftover)} process(es) behind; they were stopped")
    if orphaned:
        say(f"engine stopped: its API server was gone (the group's exit {code}); exit 1, so systemd's "
            "Restart=on-failure starts it again")
        return 1
    if watch and watch.hang:
        say(f"engine stopped by the hang watchdog (its exit {code}); exit 1, so systemd's Restart=on-failure "
            "starts it again")
        return 1
    if stopping.is_set():
        say(f"engine stopped (exit {code})")
        return 0
    if by_rig:
        sdnotify.notify("STOPPING=1", "STATUS=stopped by nox -s stop")
        say(f"engine stopped by nox -s stop (exit {code})")
        return 0
    if code == 0:  # vLLM's API server shuts down cleanly, exit 0, when its EngineCore has died: still a crash
        error(problem("the engine", "running until it is stopped", "it ended on its own with exit 0 (vLLM's API "
                      "server does that when its EngineCore has died)", "nothing by hand: the supervisor exits 1, "
                      f"so systemd restarts it; why it died is in {s.log or 'the output above'}"))
        return 1
    if code < 0:  # the leader killed: the log writer (the engine's output has nowhere to go) or the server
        error(problem(f"the engine's {'log writer' if s.log else 'API server'} (pid {rec.pid}, its group's leader)",
                      "running until the engine is stopped", f"killed by {signal.Signals(-code).name}",
                      f"nothing by hand: the rig ended the group and exits {128 - code}, so systemd restarts it"))
    return code if code >= 0 else 128 - code


LEADER_GRACE = 3.0  # seconds the log writer gets to follow a server that exited (its drain is 1 s of quiet)


def _wait_engine(s: Settings, v: Serve, rec: Record, proc: subprocess.Popen,
                 ending: Callable[[], bool]) -> tuple[int, bool]:
    """Until the engine's group leader exits: (its exit code, whether the rig ended the group because the API
    server was gone). With a log the leader is the log writer, which outlives the server while the server's
    children keep writing to the output pipe: a killed API server can leave EngineCore holding it (and its memory),
    so the supervisor would wait on an engine that serves nothing. Each second it looks for the server by its
    command line, unless the group is being ended already (``ending``: a signal's stop, or the hang watchdog's).
    A server found gone gets ``LEADER_GRACE`` for the log writer to follow it out: exit 0 is a server that shut
    down on its own (vLLM's answer to a dead EngineCore, which start reports), anything else a killed one."""
    while True:
        try:
            return proc.wait(timeout=1.0), False
        except subprocess.TimeoutExpired:
            pass
        if ending() or server_alive(rec) or _stopped_by_rig(s, rec):
            continue
        try:  # a server that exited on its own is followed by the log writer within its drain: exit 0 is no kill
            code = proc.wait(timeout=LEADER_GRACE)
        except subprocess.TimeoutExpired:
            code = None
        if code == 0:
            return 0, False
        error(problem("the engine's API server", "running while its engine runs", f"gone, leaving "
                      f"{leftovers(rec) or 'nothing'} in its group (pid {rec.pgid})", "nothing by hand: the rig "
                      "ends the group and exits 1, so systemd restarts it"))
        terminate(rec.pgid, v.stop_timeout)
        return (proc.wait() if code is None else code), True


def _stopped_by_rig(s: Settings, rec: Record) -> bool:
    """Whether ``nox -s stop`` ended this engine (the unit's ExecStop, or a second terminal): it marks the pid
    file before it signals, and removes it when done. Asked before this supervisor removes the file itself
    (only the stop and this supervisor remove it), so an engine that died on its own is not taken for a stop."""
    try:
        data = tomllib.loads(pid_path(s).read_text())
    except FileNotFoundError:
        return True
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return data.get("pid") != rec.pid or bool(data.get("stopping"))


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


def engine_key(rec: Record) -> str:
    """Which engine a watchdog sample is of: a new engine, even on a reused pid, is not compared with the old."""
    return f"{rec.pid}@{rec.started:.3f}"


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


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


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


def stop(s: Settings, v: Serve) -> int:
    """This node's engine group, gracefully first, and no process of it left (``nox -s stop``, a worker's agent)."""
    rec = load(s)
    if rec is None:
        say(f"not running (no live engine in {pid_path(s)}); nothing to stop")
        return 0
    t0 = time.monotonic()
    rec.stopping = os.getpid()
    save(s, rec)  # a foreground supervisor reads it: a stop, not a crash (exit 0, no restart)
    members = group_members(rec.pgid)
    say(f"stopping the engine: pid {rec.pid}, {len(members)} process(es) in its group; SIGTERM, then SIGKILL "
        f"after {v.stop_timeout} s")
    killed = terminate(rec.pgid, v.stop_timeout)
    left = group_members(rec.pgid)
    if left:
        raise WorkFailed(problem(f"processes {', '.join(map(str, left))} of the engine", "none left after SIGKILL",
                                 "they survived it (a GPU driver hang?) and still hold their GPU memory",
                                 "check nvidia-smi"))
    pid_path(s).unlink(missing_ok=True)
    clear_runtime(s)
    if rec.supervisor:  # a foreground supervisor (the unit's main process) exits 0 on its own: let it, first
        end = time.monotonic() + 10
        while alive(rec.supervisor) and time.monotonic() < end:
            time.sleep(0.05)
    how = f"SIGKILL needed for {len(killed)} process(es) that ignored SIGTERM" if killed else "clean SIGTERM"
    say(f"stopped in {time.monotonic() - t0:.1f} s ({how}); no process of it is left")
    return 0


def terminate(pgid: int, timeout: float, extra: Callable[[], list[int]] | None = None) -> list[int]:
    """SIGTERM the group, wait up to ``timeout``, SIGKILL what is left; return the pids it had to kill."""
    members = group_members(pgid)
    if not members:
        return []
    _signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not group_members(pgid):
            return []
        time.sleep(0.1)
    left = group_members(pgid)
    _signal_group(pgid, signal.SIGKILL)
    end = time.monotonic() + 5
    while group_members(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def ago(t: float) -> str:
    """How long ago ``t`` was, as 1h02m or 3m05s: the uptime status and a second start print."""
    sec = int(time.time() - t)
    h, rem = divmod(sec, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
