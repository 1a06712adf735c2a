"""This node's part of a multi-node engine, taking the plan and returning the outcome (rig/control/start.py calls it
once).

The head opens the registry (rig/nodes/registry.py), waits for every worker with its own build, then starts its
engine and tells the workers to start theirs; a worker joins, waits for the head's go, and starts headless beside
its agent (rig/nodes/agent.py). With ``DIST_BACKEND=ray`` the Ray cluster comes first (rig/nodes/raycluster.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.facts.config import Serve, Settings
from rig.nodes import agent, client, raycluster, registry
from rig.plan import serve
from rig.running import enginerec, supervise


def worker_engine(s: Settings, v: Serve, rec: enginerec.Record) -> bool:
    """A worker's start that finds an engine of the rig running here: True (nothing to start) only when it is this
    rank's part of the head's engine, which the head's registry sees running; anything else is refused (exit 2)
    before the join, naming it: the head would otherwise wait in vLLM's init for an engine that never comes."""
    role, base = client.load_role(s), client.url(v)
    what = f"pid {rec.pid}, up {enginerec.ago(rec.started)}"
    if role and role.role == "worker":
        what += f", worker {role.rank} of the head at {role.url}"
        if role.rank == v.node_rank and role.url == base:
            code, st = client.call(base, "/state", secret=v.nodes_secret, timeout=3)
            m = st.get("members", {}).get(str(v.node_rank)) if code == 200 else None
            if m and m["engine"] == "running" and st["now"] - m["beat"] < client.LOST:
                say(f"already running: worker {v.node_rank} of the head at {base} ({what}), part of its engine; "
                    "nothing started (nox -s stop on the head stops every node)")
                return True
            what += " (the head's registry does not see it running: it is an earlier head's)"
    elif role:
        what += f", the head of {role.url}"
    else:
        what += f", a one-node engine on {rec.host}:{rec.port}"
    raise BadInput(problem("this node's engine", f"none running, for worker {v.node_rank} to join the head at {base}",
                           f"an engine of the rig already runs here ({what})", "nox -s stop on this node, then start "
                           "it again (the head waits for it)"))





def run(plan: serve.Plan, env: Mapping[str, str]) -> int:
    """One node of a multi-node engine: the head opens the registry, waits for every worker with its own build,
    then starts; a worker joins, waits for the head's engine, then starts headless beside its agent."""
    s, v = plan.s, plan.v
    ray = v.dist_backend == "ray"
    address = plan.iface.address if plan.iface else v.head_addr
    if ray:
        raycluster.ensure(s)
    ident = client.identity(s, len(plan.cards), ray=ray)
    if v.node_rank:
        return _worker(plan, env, ident, address)
    return _head(plan, ident, address)


def _worker(plan: serve.Plan, env: Mapping[str, str], ident: dict, address: str) -> int:
    s, v = plan.s, plan.v
    client.join(v, ident, address)
    client.wait_go(v)
    if v.dist_backend == "ray":  # Ray places this node's ranks from the head's engine: no vllm serve here
        raycluster.join(s, v, address)
        agent.start(s, v, dict(env))
        say("ray: this node serves through the head's engine; nox -s stop on the head stops it")
        return 0
    return supervise.start(supervise.Launch.of(plan, on_spawn=lambda: agent.start(s, v, dict(env)),
                                   probe=lambda: client.head_ready(v)))


def _head(plan: serve.Plan, ident: dict, address: str) -> int:
    s, v = plan.s, plan.v
    role = registry.open_registry(s, v, ident, v.head_addr)
    went: list[float] = []  # when the workers were told to start their engines

    def go() -> None:
        registry.tell(role, "go")
        went.append(time.time())

    def check() -> str:
        return registry.missing_engine(role, went[0]) if went else ""

    try:
        registry.wait_for_workers(v, role)
        if v.dist_backend == "ray":  # the Ray head first, then the workers join it, then the engine places its ranks
            raycluster.start_head(s, v, address)
            go()
            raycluster.wait_for_nodes(s, v)
            launch = supervise.Launch.of(plan, on_ready=lambda: registry.tell(role, "ready"), nodes_check=check)
        else:
            launch = supervise.Launch.of(plan, on_spawn=go, on_ready=lambda: registry.tell(role, "ready"),
                                         nodes_check=check)
        code = supervise.start(launch)
    except BaseException:  # the workers that joined stop too: their agents see the stop, or lose the head
        _release(s, v, role)
        raise
    if launch.foreground:  # the engine has ended (a stop, a signal, a crash): the workers' engines end with it
        _release(s, v, role)
    return code


def _release(s: Settings, v: Serve, role: client.Role) -> None:
    """The head's engine has ended, or never started: the workers stop, then this node's Ray and registry."""
    for line in registry.stop_workers(role, v.stop_timeout):
        say(line)
    client.close(s, role)
