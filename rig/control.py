"""``nox -s stop`` and ``nox -s status``: acting on, and reporting, an engine the rig started.

Both read the pid file (rig/supervise.py) and find the engine by its process group; status adds the one-token
health check, the hang watchdog's reading (rig/watchdog.py) and the KV cache line from the log.
"""

from __future__ import annotations

import json
import os
import time

from rig import logs, nodes, watchdog
from rig.config import Serve, Settings
from rig.console import error, say
from rig.errors import WorkFailed
from rig.health import health
from rig.proc import alive
from rig.supervise import (
    ago,
    engine_key,
    group_members,
    leftovers,
    load,
    pid_path,
    save,
    server_alive,
    terminate,
)


def stop(s: Settings, v: Serve) -> int:
    """``nox -s stop``: the whole engine group, gracefully first; on a multi-node head, every worker's first."""
    role = nodes.load_role(s)
    if role and role.role == "head":
        say(f"stopping the workers through the node registry ({role.url})")
        for line in nodes.stop_workers(role, v.stop_timeout + 10):
            say(line)
    try:
        return _stop_engine(s, v)
    finally:
        if role:
            nodes.close(s, role)  # the head's registry, or this worker's agent


def _stop_engine(s: Settings, v: Serve) -> int:
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
        raise WorkFailed(f"processes {', '.join(map(str, left))} of the engine survived SIGKILL (a GPU driver "
                         "hang?); they still hold their GPU memory: check nvidia-smi")
    pid_path(s).unlink(missing_ok=True)
    if rec.supervisor:  # a foreground supervisor (the unit's main process) exits 0 on its own: let it, first
        end = time.monotonic() + 10
        while alive(rec.supervisor) and time.monotonic() < end:
            time.sleep(0.05)
    how = f"SIGKILL needed for {len(killed)} process(es) that ignored SIGTERM" if killed else "clean SIGTERM"
    say(f"stopped in {time.monotonic() - t0:.1f} s ({how}); no process of it is left")
    return 0


def _capacity_from_log(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - (4 << 20)))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    found = list(logs.CAPACITY.finditer(text))
    return found[-1][0] if found else ""


def status(s: Settings, v: Serve) -> int:
    """``nox -s status``: 0 healthy, 1 running but not healthy, 3 not running."""
    rec = load(s)
    if rec is None:
        say(f"not running (no live engine in {pid_path(s)})")
        return 3
    if not server_alive(rec):
        say(f"the engine's server (pid {rec.pid}) is gone, but processes of its group are left: {leftovers(rec)}")
        error("they still hold their memory (and GPU memory on a GPU box); nox -s stop ends them, then ./start.sh")
        return 1
    role = nodes.load_role(s)
    if role and role.role == "worker":
        answers = nodes.call(role.url, "/state")[0] == 200
        beating = alive(role.pid)
        say(f"pid {rec.pid}: worker {role.rank}, headless, up {ago(rec.started)}; the head's registry at {role.url}: "
            + ("answers" if answers else "does NOT answer"))
        say(f"engine: running; agent: {'beating' if beating else 'GONE'}")  # a gone server returned 1 above
        return 0 if beating else 1
    node_ok, lines = nodes.node_lines(role) if role else (True, [])
    look = watchdog.Look(s.state_dir, engine_key(rec), rec.host, rec.port, v.hang_window, rec.supervisor).take()
    checked = not (look.hung or rec.hang) and node_ok
    ok, detail = False, "one more request would only join those that hang"
    if not node_ok:
        detail = "a worker node is down: a generation would hang (see the nodes below)"
    if checked:  # an answer later than the hang window is what the watchdog looks for: no need to wait longer
        ok, detail = health(rec.host, rec.port, rec.model, v.api_key, timeout=min(30, v.hang_window or 30),
                            extra=json.loads(rec.health))
        look.take()  # a sample after the check: a check that waited spans the two
    hung = look.hung or bool(rec.hang)
    capacity = rec.capacity or (_capacity_from_log(rec.log) if rec.log else "")
    mode = f"foreground under pid {rec.supervisor}" if rec.supervisor else "detached"
    say(f"pid {rec.pid} ({mode}), up {ago(rec.started)}, {rec.host}:{rec.port}, model {rec.model}")
    say(f"health: {'ok' if ok else 'FAILING' if checked else 'not checked'} ({detail})")
    say(f"watchdog: {look.line()}" + (f"; the supervisor is ending it: {rec.hang}" if rec.hang else ""))
    if role:
        say(f"node 0 ({rec.host}): the head, API and rank 0")
        for line in lines:
            say(line)
    say(capacity or "KV cache line: not in the log yet")
    if rec.log:
        say(f"log: {rec.log}")
    if hung:
        error("the engine is hung (requests pending, no token for HANG_WINDOW): see its log; a foreground "
              "supervisor (systemd) restarts it, else nox -s stop, then ./start.sh")
    elif not node_ok:
        error("a worker node's engine is down, so the engine cannot generate: nox -s stop on the head stops "
              "every node; then ./start.sh on each")
    elif not ok:
        error("the engine runs but does not generate: see its log; nox -s stop, then ./start.sh")
    return 0 if ok and not hung else 1
