"""A worker's agent; run as a script on purpose (``python -m rig.nodes.agent``, a process beside the engine).

A worker's start spawns it (:func:`start`) in a session of its own, with the start's environment: it beats to
the head's registry every second with its engine's state, and stops the engine when the head says so, or when
it has lost the head for ``LOST`` seconds, with the rig's own stop (rig/running/enginerec.py), then leaves. What it says
goes to ``RIG_STATE/agent.log``.
"""

from __future__ import annotations

import threading
import time

from rig.base.console import stamped
from rig.facts import config
from rig.facts.config import Serve, Settings
from rig.nodes import client, raycluster
from rig.nodes.client import Role, call
from rig.running import enginerec


def start(s: Settings, v: Serve, env: dict[str, str]) -> None:
    """The worker's agent, in a session of its own: beats, and stops the engine when the head says so."""
    client.end_helper(s)
    proc = client.spawn("rig.nodes.agent", dict(env), s.state_dir / "agent.log")
    client.save_role(s, Role("worker", proc.pid, client.create_time(proc.pid), client.url(v), v.node_rank, "",
                             v.dist_backend, v.nodes_secret))


def _local(s: Settings, v: Serve) -> tuple[bool, str] | None:
    """(this node's part runs, why not), or None when it has ended here (stopped on this node)."""
    if v.dist_backend == "ray":
        return (True, "") if raycluster.running() else (False, "its raylet is gone")
    rec = enginerec.load(s)
    if rec is None:  # stopped here (nox -s stop on this node), or its whole group has ended
        return None
    return (True, "") if enginerec.server_alive(rec) else \
        (False, f"its vllm serve --headless (group {rec.pgid}) is gone")


def _beat_until(base: str, rank: int, secret: str, done: threading.Event) -> None:
    while not done.wait(client.BEAT):
        call(base, "/beat", {"rank": rank, "engine": "stopping"}, secret=secret, timeout=client.BEAT * 2)


def _stop(s: Settings, v: Serve) -> None:
    """This node's engine, then its Ray (with Ray) and its role: what ``nox -s stop`` does on a worker."""
    role = client.load_role(s)
    try:
        enginerec.stop(s, v)
    finally:
        if role:
            client.close(s, role)


def main() -> None:
    """The agent process: beat until the engine has ended here, or stop it when the head says so (or is gone)."""
    s, v = config.settings(), config.serve_settings()
    base, lost_since = client.url(v), None
    stamped(f"agent of worker {v.node_rank}: beating to {base}")
    while True:
        local = _local(s, v)
        if local is None:
            call(base, "/beat", {"rank": v.node_rank, "engine": "left"}, secret=v.nodes_secret)
            stamped("the engine has ended here: left")
            return
        running, detail = local
        code, flags = call(base, "/beat", {"rank": v.node_rank, "engine": "running" if running else "gone",
                                           "detail": detail}, secret=v.nodes_secret, timeout=client.BEAT * 2)
        now = time.monotonic()
        lost_since = None if code == 200 else (lost_since or now)
        if (code == 200 and flags.get("stop")) or (lost_since and now - lost_since > client.LOST):
            stamped(f"stopping the engine: {'the head said so' if code == 200 else f'no head for {client.LOST:.0f} s'}")
            done = threading.Event()  # beats go on while the stop waits for SIGTERM: the head waits for "left"
            threading.Thread(target=_beat_until, args=(base, v.node_rank, v.nodes_secret, done), daemon=True).start()
            try:
                _stop(s, v)  # with Ray, it runs ray stop too
            finally:
                done.set()
                call(base, "/beat", {"rank": v.node_rank, "engine": "left"}, secret=v.nodes_secret)
            return
        time.sleep(client.BEAT)


if __name__ == "__main__":
    main()
