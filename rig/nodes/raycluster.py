"""A Ray cluster for ``DIST_BACKEND=ray``: the head's ``ray start --head``, each worker's ``ray start --address``.

Ray left vLLM's requirements in 0.18, so the rig pins it apart: ``scripts/ray.lock`` (``nox -s lock`` makes it,
constrained by the runtime lock, so the packages both need keep one version), installed hash-checked into the
serving venv on each node that serves with Ray. Every node must run the same Ray: its version is part of what
the head's registry compares (rig/nodes/). Start order and stop ride on the registry like the mp path: the
head starts Ray first, the workers join when the head says go, and ``nox -s stop`` on the head ends every
node's Ray through the workers' agents.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import psutil

from rig.base import venvs
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.build.steps.runtime import RAY, install, read_lock
from rig.build.steps.runtime import ray_lock_path as lock_path
from rig.facts import uv
from rig.facts.config import Serve, Settings


def version(s: Settings) -> str:
    """The Ray installed in the serving venv, or 'none'."""
    return venvs.installed(s.venv_dir).get("ray", "none")


def ensure(s: Settings) -> None:
    """Install ``scripts/ray.lock`` into the serving venv when its Ray is not there (hash-checked, no deps)."""
    want = RAY.split("==", 1)[1]
    if version(s) == want:
        return
    path = lock_path(s)
    if not path.is_file():
        raise BadInput(problem(str(path), f"the Ray lock ({RAY})", "no such file", "nox -s lock writes it"))
    say(f"ray: installing {RAY} from {path.name} into {s.venv_dir} (hash-checked)")
    install(s, uv.resolve(s), read_lock(path), reinstall=[])
    if version(s) != want:
        raise WorkFailed(problem(f"Ray in {s.venv_dir}", f"{want} after the install of {path}", version(s),
                                 f"remove {s.venv_dir} and run ./build.sh, then start again"))


def _ray(s: Settings, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(s.venv_dir / "bin" / "ray"), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def start_head(s: Settings, v: Serve, address: str) -> None:
    r = _ray(s, "start", "--head", "--port", str(v.head_port), "--node-ip-address", address,
             "--disable-usage-stats")
    if r.returncode != 0:
        raise WorkFailed(problem(f"ray start --head on {address}:{v.head_port}", "exit 0",
                                 f"exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}",
                                 "free HEAD_PORT (or set another on every node), then start again"))
    say(f"ray: head started on {address}:{v.head_port} (Ray {version(s)})")


def join(s: Settings, v: Serve, address: str) -> None:
    r = _ray(s, "start", "--address", f"{v.head_addr}:{v.head_port}", "--node-ip-address", address)
    if r.returncode != 0:
        raise WorkFailed(problem(f"ray start --address {v.head_addr}:{v.head_port}", "exit 0",
                                 f"exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}",
                                 "check that the head's Ray is up (nox -s ray -- status on the head) and reachable"))
    say(f"ray: this node ({address}) joined the cluster at {v.head_addr}:{v.head_port}")


def active_nodes(s: Settings, v: Serve) -> int | None:
    """How many nodes ``ray status`` lists as active (None when it does not answer)."""
    r = _ray(s, "status", "--address", f"{v.head_addr}:{v.head_port}", timeout=60)
    if r.returncode != 0:
        return None
    block = r.stdout.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in r.stdout else ""
    return sum(int(m[1]) for m in re.finditer(r"^\s*(\d+)\s+node_", block, re.M))


def wait_for_nodes(s: Settings, v: Serve) -> None:
    t0 = time.monotonic()
    while True:
        n = active_nodes(s, v)
        if n is not None and n >= v.nodes:
            say(f"ray: {n} nodes active in {time.monotonic() - t0:.0f} s (ray status)")
            return
        if time.monotonic() - t0 > v.start_timeout:
            found = f"{n} in ray status" if n is not None else "no answer from ray status"
            raise WorkFailed(problem("the Ray cluster", f"{v.nodes} active nodes (NODES) within START_TIMEOUT="
                                     f"{v.start_timeout} s", found, "start the workers that are missing, and check "
                                     "that they reach HEAD_ADDR:HEAD_PORT"))
        time.sleep(1)


def running() -> bool:
    """Whether a raylet runs on this machine (one node's part of the cluster)."""
    return any(p.info["name"] == "raylet" for p in psutil.process_iter(["name"]))


def stop(s: Settings) -> str:
    """``ray stop`` on this node; its last line, without Ray's log prefix."""
    r = _ray(s, "stop", timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    return lines[-1].split(" -- ", 1)[-1] if lines else "ray stop: nothing said"
