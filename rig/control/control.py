"""``nox -s stop``, ``nox -s status``, ``nox -s doctor`` and ``nox -s fit``: acting on, and reporting, an engine
and its box.

Stop and status read the pid file (rig/running/enginerec.py) and find the engine by its process group; stop is
enginerec's own (what a worker's agent runs too), with a multi-node head's workers first. Status adds the
one-token health check, the hang watchdog's reading (rig/running/watchdog.py), the KV cache line from the log and, on a
head, each node from the registry's beats (rig/nodes/). Doctor is the box report (rig/plan/box.py) with a multi-node
setting's checks. Fit is rig/plan/fit.py's verdict on the plan a start would make (``--cards N``: on N cards).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from rig.base.console import error, plain, say
from rig.base.errors import BadInput, problem
from rig.base.proc import alive
from rig.facts import slots
from rig.facts.config import Serve, Settings
from rig.facts.profiles import Profile
from rig.nodes import client, registry
from rig.plan import box, fit, serve
from rig.running import enginerec, logs, watchdog
from rig.running.enginerec import ago, engine_key, leftovers, load, pid_path, server_alive
from rig.running.health import health


def stop(s: Settings, v: Serve) -> int:
    """``nox -s stop``: the whole engine group, gracefully first; on a multi-node head, every worker's first."""
    role = client.load_role(s)
    if role and role.role == "head":
        say(f"stopping the workers through the node registry ({role.url})")
        for line in registry.stop_workers(role, v.stop_timeout + 10):
            say(line)
    try:
        return enginerec.stop(s, v)
    finally:
        if role:
            client.close(s, role)  # the head's registry, or this worker's agent


def doctor(s: Settings, p: Profile, v: Serve) -> list[str]:
    """``nox -s doctor``: the box report (rig/plan/box.py), with what this node needs of the others on a multi-node
    setting (run it on each)."""
    return box.doctor(s, p, v, client.doctor_checks(s, v) if v.nodes > 1 else ())


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
    role = client.load_role(s)
    if role and role.role == "worker":
        answers = client.call(role.url, "/state", secret=role.secret)[0] == 200
        beating = alive(role.pid)
        say(f"pid {rec.pid}: worker {role.rank}, headless, up {ago(rec.started)}; the head's registry at {role.url}: "
            + ("answers" if answers else "does NOT answer"))
        say(f"engine: running; agent: {'beating' if beating else 'GONE'}")  # a gone server returned 1 above
        return 0 if beating else 1
    node_ok, lines = registry.node_lines(role) if role else (True, [])
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
    capacity = rec.capacity or (logs.last_capacity(rec.log) if rec.log else "")
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


def fit_report(env: Mapping[str, str], cards: int = 0, card_mib: float = 0.0) -> int:
    """The verdict for the plan a start would make here (``cards``: on that many cards instead, each of
    ``card_mib``, the memory torch sees); exit 2 when it does not fit."""
    env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(cards)))} if cards else dict(env)
    s = slots.settings(env)
    v, p = serve.inputs(s, env)
    report = serve.BoxReport(None, checked=False) if cards else serve.check_box(s, v, p, check=False)
    pl = serve.plan(s, v, p, report)
    card_mib = card_mib or fit.card_mib(report.reading)
    if s.device == "cuda" and not card_mib:
        raise BadInput(problem("--card-memory", "each card's memory, read by NVML or given", "no card read here "
                               "(no NVIDIA driver)", "give it, e.g. scripts/nox.sh -s fit -- --card-memory 24GiB"))
    f = fit.estimate(pl.engine.argv, pl.engine.full_env(env), s.device, s.ckpt, card_mib)
    t = pl.topology
    where = f"TP{t.tp} x PP{t.pp}{' + EP' if t.ep else ''}" if s.device == "cuda" else "the CPU build"
    plain(f"fit: profile {p.name} ({p.path}), {where}, checkpoint {s.ckpt}")
    for line in fit.lines(f):
        plain(f"  {line}")
    if why := fit.refusal(f):
        error(why)
        return 2
    return 0
