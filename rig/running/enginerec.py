"""The running engine as the rig knows it: its record (the pid file), its process group, its runtime folder, and
the stop.

The engine runs in its own session, so its process group holds the API server, EngineCore and the workers; the
pid file (``RIG_STATE/engine.toml``) names the group. Stop (:func:`stop`, what ``nox -s stop`` and a worker's agent
run) is SIGTERM to the whole group, a wait, SIGKILL, and then a check that no process of it is left: vLLM's
EngineCore and workers outlive a SIGKILL of the server. Each engine has a runtime folder of its own, so nothing a
gone engine left there (or its late cleanup) reaches the next one.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import stat
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import tomli_w

from rig.base import atomic
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.proc import alive
from rig.facts.config import Serve, Settings
from rig.plan.engine import OWN_FOLDER, runtime_dir
from rig.running.health import ENGINE_RECORD

#: An engine's own runtime folder is named by random bytes in hex, as many as rig/plan/engine.py leaves room for.
OWN_BYTES = (OWN_FOLDER - 1) // 2
OWN_NAME = re.compile(rf"[0-9a-f]{{{2 * OWN_BYTES}}}")
#: Seconds after the drain's bound for the engine to end its processes before the rest of the group is signalled.
DRAIN_TEARDOWN = 3.0


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
    runtime: str = ""  # the engine's own runtime folder (TMPDIR, VLLM_RPC_BASE_PATH), in runtime_dir


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
    clear_runtime(s, rec.runtime)  # found dead: its sockets and temporary files go with it
    return None


def runtime_base(s: Settings) -> Path:
    """rig/plan/engine.py's runtime_dir, made when missing and checked: a folder of this user's, mode 0700, never a
    link (its fallback lies in /tmp, where anyone may have made the name first)."""
    d = runtime_dir(s)
    try:
        d.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) else \
            f"a folder of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
        raise BadInput(problem(f"the engines' runtime folder {d}", f"a folder of uid {os.geteuid()}, mode 0700, "
                               "not a link", kind, f"remove {d} (the rig makes it again), or give RIG_STATE a "
                               "shorter path: its run/ folder is used then"))
    return d


def _runs_from(base: Path) -> list[int]:
    """The processes whose engine runs from a folder in ``base`` (their ``VLLM_RPC_BASE_PATH``), this one and its
    parent aside: what an engine that is gone left running there."""
    mine, root = {os.getpid(), os.getppid()}, str(base)
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            rpc = p.environ().get("VLLM_RPC_BASE_PATH", "") if p.pid not in mine else ""
        except (psutil.Error, OSError):
            continue
        if rpc == root or rpc.startswith(root + "/"):
            out.append(p.pid)
    return out


def clear_runtime(s: Settings, folder: str | Path = "") -> int:
    """Remove an engine's own runtime folder (``folder``, its record's) or, with none named, the whole runtime
    folder once no process runs from it (a bare start's, a record of an older rig); how many files went."""
    base = runtime_dir(s)
    d = Path(folder) if folder else base
    if d != base and d.parent != base or not d.is_dir() or d.is_symlink() or (d == base and _runs_from(base)):
        return 0  # never a folder outside the rig's runtime folder, whatever a record says
    n = sum(1 for _ in d.rglob("*"))
    shutil.rmtree(d, ignore_errors=True)
    if d != base and not _runs_from(base):
        # Nothing runs from the runtime folder any more: what a bare start left in it goes too (its TMPDIR's files
        # and folders), and the folder with it once empty. An engine's own folder may be a start's that is about to
        # spawn: it stays.
        try:  # the supervisor and a stop may both clear it: what the other removed first is gone already
            for loose in list(base.iterdir()):
                if not (loose.is_dir() and not loose.is_symlink() and OWN_NAME.fullmatch(loose.name)):
                    n += _remove(loose)
        except FileNotFoundError:
            return n
        try:
            base.rmdir()
        except OSError:
            pass
    return n


def fresh_runtime(s: Settings) -> int:
    """An empty runtime folder for a bare start of the rig's command (the benchmarks); how many files a gone
    engine had left there."""
    left = clear_runtime(s)
    runtime_base(s)
    return left


def own_runtime(s: Settings, timeout: float) -> tuple[Path, int, int]:
    """A new runtime folder of its own for the engine about to start (called under the engine lock with no live
    engine): whatever an engine that is gone left running from the runtime folder is ended first, its files
    removed, so no cleanup of a failed engine can overlap this one's start; (the folder, processes ended, files
    removed)."""
    base = runtime_base(s)
    ended = _end(_runs_from(base), timeout)
    files = 0
    for old in base.iterdir():
        files += _remove(old)
    own = base / secrets.token_hex(OWN_BYTES)
    own.mkdir(mode=0o700)
    return own, ended, files


def _remove(entry: Path) -> int:
    """Remove one entry of the runtime folder (a folder with what it holds, never through a link); how many
    entries went."""
    if entry.is_dir() and not entry.is_symlink():
        n = 1 + sum(1 for _ in entry.rglob("*"))
        shutil.rmtree(entry, ignore_errors=True)
        return n
    entry.unlink(missing_ok=True)
    return 1


def _end(pids: list[int], timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout``, to these processes; how many there were."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            continue
    _, alive_ = psutil.wait_procs(procs, timeout=timeout)
    for p in alive_:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive_, timeout=5)
    return len(procs)


def server_alive(rec: Record) -> bool:
    """Whether the engine's API server still runs. The group leader is not proof: the log writer outlives a
    killed server while EngineCore keeps its output pipe open, so the server is found by its command line
    (``serve CKPT``) among the group's members; EngineCore and the workers rename themselves ``VLLM::...``."""
    if not rec.ckpt:  # a record of an older rig: the leader is all it knows
        try:
            return abs(psutil.Process(rec.pid).create_time() - rec.create_time) < 1.0
        except psutil.NoSuchProcess:
            return False
    return server_pid(rec) is not None


def server_pid(rec: Record) -> int | None:
    """The API server's pid among the group's members (``serve CKPT`` in its command line), or None."""
    for pid in group_members(rec.pgid):
        try:
            cmd = psutil.Process(pid).cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # [python,] .../vllm serve CKPT ...: the log writer also names them, after its own arguments
        if "serve" in cmd[:3] and rec.ckpt and rec.ckpt in cmd[cmd.index("serve"):]:
            return pid
    return None


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



def running_message(rec: Record) -> str:
    return (f"already running: pid {rec.pid}, {rec.host}:{rec.port}, up {ago(rec.started)}; nothing started "
            "(nox -s stop first to restart it)")


def already_running(rec: Record, attached: bool) -> None:
    """A start that finds an engine of the rig running: said (nothing to start), or refused when the start would
    attach to it (the foreground, a terminal's output: it cannot have both engines)."""
    if attached:
        raise BadInput(problem("the engine", "not running", f"pid {rec.pid} on {rec.host}:{rec.port}",
                               "nox -s stop, then start again"))
    say(running_message(rec))


def create_time(pid: int) -> float:
    """psutil's start time of ``pid`` (0.0 when it is gone): with the pid, what names a process for good."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


def stopped_by_rig(s: Settings, rec: Record) -> bool:
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


def engine_key(rec: Record) -> str:
    """Which engine a watchdog sample is of: a new engine, even on a reused pid, is not compared with the old."""
    return f"{rec.pid}@{rec.started:.3f}"



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
    say(f"stopping the engine: pid {rec.pid}, {len(members)} process(es) in its group; "
        + (f"its API server first, letting the requests in flight finish (up to DRAIN_TIMEOUT={v.drain_timeout} s), "
           "then " if v.drain_timeout else "") + f"SIGTERM, then SIGKILL after {v.stop_timeout} s")
    drained = drain(rec, v.drain_timeout) if v.drain_timeout else 0.0
    killed = terminate(rec.pgid, max(1.0, v.stop_timeout - drained))
    left = group_members(rec.pgid)
    if left:
        raise WorkFailed(problem(f"processes {', '.join(map(str, left))} of the engine", "none left after SIGKILL",
                                 "they survived it (a GPU driver hang?) and still hold their GPU memory",
                                 "check nvidia-smi"))
    pid_path(s).unlink(missing_ok=True)
    clear_runtime(s, rec.runtime)
    if rec.supervisor:  # a foreground supervisor (the unit's main process) exits 0 on its own: let it, first
        end = time.monotonic() + 10
        while alive(rec.supervisor) and time.monotonic() < end:
            time.sleep(0.05)
    how = f"SIGKILL needed for {len(killed)} process(es) that ignored SIGTERM" if killed else "clean SIGTERM"
    say(f"stopped in {time.monotonic() - t0:.1f} s ({how}); no process of it is left")
    return 0


def drain(rec: Record, timeout: int) -> float:
    """SIGTERM to the API server alone: with ``--shutdown-timeout`` it refuses new requests, lets those in flight
    finish for up to ``timeout`` seconds, and ends its engine. The seconds it took until the group was gone (or
    the bound, when it was not: :func:`terminate` then ends the rest). A signal to the whole group at once would
    end the engine's workers under the requests instead."""
    t0 = time.monotonic()
    server = server_pid(rec)
    if server is None:  # gone already, or an older rig's record: the group's SIGTERM ends what is left
        return 0.0
    try:
        os.kill(server, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return 0.0
    end = t0 + timeout + DRAIN_TEARDOWN
    while (members := group_members(rec.pgid)) and time.monotonic() < end:
        if server not in members:  # the server has drained and ended: the rest of its engine gets a moment more
            end = min(end, time.monotonic() + DRAIN_TEARDOWN)
        time.sleep(0.1)
    return time.monotonic() - t0


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
