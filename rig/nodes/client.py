"""What a node says to the head's registry, and how: its build and checkpoint, its role on disk, its calls.

Every node uses it: a worker joins (:func:`join`), waits for the head's go (:func:`wait_go`) and for the head's
generation (:func:`head_ready`); the head's own rig calls its registry through :func:`call` too
(rig/nodes/registry.py). ``RIG_STATE/nodes.toml`` (:class:`Role`) says which part this node plays and the pid
of its registry or agent, so that stop and status find them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import tomli_w

from rig import REPO_ROOT
from rig.base import atomic, netif
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.gitutil import Git
from rig.facts import series
from rig.facts.config import Serve, Settings
from rig.nodes import raycluster
from rig.plan.box import Check
from rig.running import enginerec

BEAT = 1.0  # seconds between an agent's beats
LOST = 10.0  # a worker with no beat for this long counts as lost; an agent without the head this long stops
WAIT_LINE = 15.0  # seconds between "still waiting" lines
LABELS = {"tree": "tree id", "ops_obj": "OPS_OBJ", "device": "device", "cards": "cards",
          "config": "the checkpoint's config.json sha256", "ray": "Ray"}


# -- what a node is: its build and checkpoint --------------------------------------------------------------------


def identity(s: Settings, cards: int, ray: bool = False) -> dict:
    """This node's build and checkpoint, read from the tree and the files themselves (not from a record that
    could be stale), as the head compares them."""
    from rig.build.steps.tree import ops_obj  # the build's tree step (slow to import): only a multi-node start asks

    repo = Git(s.vllm_dir)
    code, tree, _ = repo.run("rev-parse", "HEAD^{tree}", check=False)
    ops = ops_obj(repo, "HEAD", series.load(s.patches_dir).ops_paths) if code == 0 else "none"
    try:
        config = hashlib.sha256((s.ckpt / "config.json").read_bytes()).hexdigest()
    except OSError:
        config = "none"
    out = {"tree": tree.strip() if code == 0 else "none", "ops_obj": ops, "device": s.device, "cards": cards,
           "config": config}
    if ray:  # every node must run the same Ray
        out["ray"] = raycluster.version(s)
    return out


_BUILD_FIX = "run ./build.sh on the node from the head's commit (the same series)"
#: What makes a node's value the head's, for each value it reports: a build fixes the tree, not the cards.
FIXES = {"tree": _BUILD_FIX, "ops_obj": _BUILD_FIX,
         "device": "set DEVICE as on the head",
         "cards": "give the node as many cards as the head (CUDA_VISIBLE_DEVICES)",
         "config": "point CKPT at the same checkpoint as the head's",
         "ray": "install the head's Ray (./build.sh from the head's commit installs scripts/ray.lock)"}
#: A rank the head has no place for: the two variables that count the places.
RANK_FIX = "set the head's NODES on every node, and on each worker its own NODE_RANK from 1 to NODES-1"


def differences(head: dict, node: dict) -> list[str]:
    """Each value the node reports that is not the head's, as 'what: head X, this node Y'."""
    return [f"{LABELS[k]}: head {head[k]}, this node {node.get(k, 'none')}" for k in LABELS
            if head.get(k) != node.get(k)]


def fix(head: dict, node: dict) -> str:
    """What makes the node's values the head's: one fix for each kind of difference, in the order of LABELS."""
    return "; ".join(dict.fromkeys(FIXES[k] for k in LABELS if head.get(k) != node.get(k)))


# -- talking to the registry ---------------------------------------------------------------------------------------


def url(v: Serve) -> str:
    return f"http://{v.head_addr}:{v.nodes_port}"


STAMP, SIGNATURE = "X-Rig-Time", "X-Rig-Signature"
SKEW = 300.0  # seconds a signed call stays good: a replayed one is refused after that


def signature(secret: str, method: str, path: str, stamp: str, body: bytes) -> str:
    """HMAC-SHA256 of the call (method, path, time, body) with NODES_SECRET: what the registry checks."""
    msg = b"\n".join([method.encode(), path.encode(), stamp.encode(), body])
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def refusal(secret: str, method: str, path: str, stamp: str | None, sig: str | None, body: bytes,
            now: float | None = None) -> str:
    """Why a call's signature is not good ('' when it is): what the registry logs with the caller's address."""
    if not stamp or not sig:
        return "no signature (a node without NODES_SECRET, or not a node of this rig)"
    try:
        age = abs((time.time() if now is None else now) - float(stamp))
    except ValueError:
        age = math.nan
    if not math.isfinite(age):
        return f"a bad time stamp {ascii(stamp[:40])} (expected seconds since the epoch)"
    if not hmac.compare_digest(sig, signature(secret, method, path, stamp, body)):
        return "a wrong signature (another NODES_SECRET)"
    if age > SKEW:
        return f"a signature {age:.0f} s old (clocks apart, or a replay; at most {SKEW:.0f} s)"
    return ""


def call(base: str, path: str, body: dict | None = None, *, secret: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a call signed with ``secret``; status 0 when the registry cannot be reached."""
    data = json.dumps(body).encode() if body is not None else None
    stamp = f"{time.time():.6f}"  # a call is good once: two of the same body need two stamps
    sig = signature(secret, "POST" if data is not None else "GET", path, stamp, data or b"")
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                  STAMP: stamp, SIGNATURE: sig})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError) as exc:
        return 0, {"error": str(getattr(exc, "reason", exc))}


# -- this node's role, on disk -------------------------------------------------------------------------------------


@dataclass
class Role:
    role: str  # head | worker
    pid: int  # the registry's (head) or the agent's (worker)
    create_time: float
    url: str
    rank: int
    token: str = ""
    backend: str = "mp"  # ray: this node's Ray is stopped with it
    secret: str = ""  # NODES_SECRET, so that a later stop or status (maybe without it in its environment) can call


def role_path(s: Settings) -> Path:
    return s.state_dir / "nodes.toml"


def load_role(s: Settings) -> Role | None:
    try:
        data = tomllib.loads(role_path(s).read_text())
        return Role(**{k: data[k] for k in Role.__dataclass_fields__ if k in data})
    except (FileNotFoundError, tomllib.TOMLDecodeError, TypeError):
        return None


def save_role(s: Settings, role: Role) -> None:
    atomic.write_text(role_path(s), "# This node's part in a multi-node engine (rig/nodes/).\n"
                      + tomli_w.dumps(asdict(role)), perms=0o600)  # 0600: the token and the secret


def _alive(pid: int, create_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 1.0
    except psutil.NoSuchProcess:
        return False


def end_helper(s: Settings, timeout: float = 5.0) -> None:
    """End this node's registry or agent, and forget the role."""
    role = load_role(s)
    if role and role.pid != os.getpid() and _alive(role.pid, role.create_time):
        enginerec.terminate(role.pid, timeout)  # each runs in a session of its own: its pid is its group
    role_path(s).unlink(missing_ok=True)


def close(s: Settings, role: Role) -> None:
    """After this node's engine has ended: its Ray (with Ray), then its registry or agent."""
    if role.backend == "ray":
        say(f"ray: {raycluster.stop(s)}")
    end_helper(s)


def spawn(module: str, env: dict[str, str], log: Path, stdin: bytes = b"") -> subprocess.Popen:
    """``python -m module`` (the registry or the agent) in a session of its own, given ``stdin``; what it says
    goes to ``log`` (RIG_STATE)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdin
    with proc.stdin:
        proc.stdin.write(stdin)
    return proc


def create_time(pid: int) -> float:
    return psutil.Process(pid).create_time()


# -- a worker ------------------------------------------------------------------------------------------------------


def join(v: Serve, ident: dict, address: str) -> None:
    """Report this node's build to the head, waiting for the head and retrying; a refusal is exit 2."""
    base, t0 = url(v), time.monotonic()
    last_line = t0
    say(f"nodes: worker {v.node_rank} of {v.nodes}: joining the head at {base}")
    while True:
        code, body = call(base, "/join", {"rank": v.node_rank, "identity": ident, "address": address},
                          secret=v.nodes_secret)
        if code == 200:
            say(f"nodes: joined the head in {time.monotonic() - t0:.0f} s (same build and checkpoint)")
            return
        if code == 401:
            raise BadInput(problem(f"worker {v.node_rank}'s NODES_SECRET", "the head's", f"a refusal by the head at "
                                   f"{base}: {body.get('error')}", "set the same NODES_SECRET on every node"))
        if code in (400, 409):
            raise BadInput(problem(f"worker {v.node_rank} at the head {base}", "a place among the head's nodes, with "
                                   "its build and checkpoint", f"a refusal: {body.get('error')}", body.get("fix") or
                                   "make this node's build, checkpoint and settings the head's"))
        now = time.monotonic()
        if now - t0 > v.start_timeout:
            raise WorkFailed(problem(f"the head's registry at {base}", "an answer", f"none: it did not answer within "
                                     f"START_TIMEOUT={v.start_timeout} s (last: {body.get('error') or code})",
                                     "start the head (NODE_RANK=0) first, or check HEAD_ADDR and NODES_PORT"))
        if now - last_line >= WAIT_LINE:
            last_line = now
            say(f"nodes: waiting for the head at {base}: {now - t0:.0f} s ({body.get('error') or code})")
        time.sleep(1.0)


def wait_go(v: Serve) -> None:
    """Until the head has started its engine (the workers' engines connect to it)."""
    base, t0 = url(v), time.monotonic()
    while True:
        code, st = call(base, "/state", secret=v.nodes_secret)
        if code == 200 and st["stop"]:
            raise WorkFailed(_head_stopped("before"))
        if code == 200 and st["go"]:
            return
        if time.monotonic() - t0 > v.start_timeout:
            raise WorkFailed(problem("the head's engine", f"started within START_TIMEOUT={v.start_timeout} s",
                                     "not started", "see the head's start: it says what it waits for"))
        time.sleep(0.5)


def head_ready(v: Serve) -> tuple[bool, str]:
    """The worker's health while it starts: the head's API answered a generation through every node."""
    code, st = call(url(v), "/state", secret=v.nodes_secret, timeout=2)
    if code != 200:
        return False, f"the head's registry does not answer ({st.get('error')})"
    if st["stop"]:
        raise WorkFailed(_head_stopped("while"))
    return (True, "the head's API generated through every node") if st["ready"] else \
        (False, "waiting for the head's API to answer a generation")


def _head_stopped(when: str) -> str:
    return problem("the head", "its engine running, for this node's to join it", f"a stop {when} this node's engine "
                   "started", "start the head again, then this node")


# -- nox -s doctor ---------------------------------------------------------------------------------------------------


def doctor_checks(s: Settings, v: Serve) -> list[Check]:
    """``nox -s doctor`` on a multi-node setting: what this node needs of the others (run it on each)."""
    role = "the head" if v.node_rank == 0 else f"worker {v.node_rank}"
    out = [Check("nodes", "pass", f"NODES={v.nodes}, NODE_RANK 0 to {v.nodes - 1}",
                 f"this node is {role} ({v.dist_backend})")]
    try:
        iface = netif.choose(v.net_iface, v.head_addr, v.head_port)
        public = not netif.private(iface.address)
        out.append(Check("interface", "warn" if public else "pass", "a private address on the way to the head",
                         f"{iface.name} {iface.address} ({iface.how})", "keep the nodes on a private network: "
                         "their traffic is unencrypted"))
    except BadInput as exc:
        out.append(Check("interface", "fail", f"an interface that reaches HEAD_ADDR={v.head_addr}", "none",
                         exc.message))
    if v.node_rank:
        code, body = call(url(v), "/state", secret=v.nodes_secret, timeout=3)
        if code == 401:
            out.append(Check("head", "fail", f"the head's registry at {url(v)} to accept this node's calls",
                             f"refused: {body.get('error')}", "set the same NODES_SECRET on every node"))
        else:
            out.append(Check("head", "pass" if code == 200 else "warn", f"the head's registry at {url(v)}",
                             "answers" if code == 200 else f"no answer ({body.get('error')})",
                             "start the head (a worker waits for it, so this is only a warning before it is up)"))
    else:
        with socket.socket() as sock:
            try:
                sock.bind((v.head_addr, v.head_port))
                free, found = True, "free"
            except OSError as exc:
                free, found = False, f"in use or not this node's address ({exc.strerror})"
        out.append(Check("master port", "pass" if free else "fail", f"{v.head_addr}:{v.head_port} free for vLLM's "
                         "master (HEAD_PORT)", found, "stop what listens there, or set HEAD_PORT on every node"))
    if v.dist_backend == "ray":
        have, want = raycluster.version(s), raycluster.RAY.split("==", 1)[1]
        out.append(Check("ray", "pass" if have == want else "warn", f"Ray {want} (scripts/ray.lock) on every node",
                         have, "./start.sh installs it; every node must run the same version"))
    return out
