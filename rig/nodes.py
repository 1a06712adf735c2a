"""Serving one model across nodes: the head's node registry, each worker's agent, and the build every node proves.

vLLM's own multi-node engine does the serving (``--nnodes``/``--node-rank``/``--headless``, or Ray); the rig
adds what users trip over around it:

* *One build everywhere.* Each node reports its tree id, OPS_OBJ, device, card count and the checkpoint's
  ``config.json`` hash; the head compares every report with its own values and refuses a node that differs,
  naming the node and the value, before anything starts.
* *Start order.* The head's registry (a small HTTP service on ``HEAD_ADDR:NODES_PORT``, in its own session)
  comes up first; workers wait for it and retry; the head starts its engine once every worker has joined,
  and only then tells the workers to start theirs.
* *One stop.* Each worker runs an agent beside its engine: it beats to the registry every second with its
  engine's state, stops the engine when the head says so (or when the head is gone), and leaves. ``status``
  on the head lists every node from those beats.

``RIG_STATE/nodes.toml`` says which role this node plays and the pid of its registry or agent.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rig import REPO_ROOT, atomic
from rig.config import Serve, Settings
from rig.console import say, warn
from rig.errors import BadInput, WorkFailed, problem

BEAT = 1.0  # seconds between an agent's beats
LOST = 10.0  # a worker with no beat for this long counts as lost; an agent without the head this long stops
WAIT_LINE = 15.0  # seconds between "still waiting" lines
LABELS = {"tree": "tree id", "ops_obj": "OPS_OBJ", "device": "device", "cards": "cards",
          "config": "the checkpoint's config.json sha256", "ray": "Ray"}


# -- what a node is: its build and checkpoint --------------------------------------------------------------------


def identity(s: Settings, cards: int, ray: bool = False) -> dict:
    """This node's build and checkpoint, read from the tree and the files themselves (not from a record that
    could be stale), as the head compares them."""
    from rig import series
    from rig.gitutil import Git
    from rig.steps.tree import ops_obj

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
        from rig import raycluster

        out["ray"] = raycluster.version(s)
    return out


def differences(head: dict, node: dict) -> list[str]:
    """Each value the node reports that is not the head's, as 'what: head X, this node Y'."""
    return [f"{LABELS[k]}: head {head[k]}, this node {node.get(k, 'none')}" for k in LABELS
            if head.get(k) != node.get(k)]


# -- the registry (on the head) -----------------------------------------------------------------------------------


class Registry:
    """The head's view of the nodes, kept in memory by the registry process."""

    def __init__(self, nodes: int, head: dict, token: str) -> None:
        self.nodes, self.head, self.token = nodes, head, token
        self.members: dict[int, dict] = {}
        self.refused: dict[int, str] = {}
        self.flags = {"go": False, "ready": False, "stop": False}
        self.lock = threading.Lock()

    def state(self) -> dict:
        with self.lock:
            return {"nodes": self.nodes, **self.flags, "now": time.time(),
                    "members": {str(r): m for r, m in self.members.items()},
                    "refused": {str(r): m for r, m in self.refused.items()}}

    def join(self, body: dict) -> tuple[int, dict]:
        rank = body.get("rank")
        if not isinstance(rank, int) or not 0 < rank < self.nodes:
            return 400, {"error": f"NODE_RANK: expected 1 to {self.nodes - 1} (NODES={self.nodes} at the head), "
                                  f"found {rank}"}
        diff = differences(self.head, body.get("identity") or {})
        with self.lock:
            if diff:
                self.refused[rank] = "; ".join(diff)
                return 409, {"error": f"node {rank} ({body.get('address')}) differs from the head: "
                                      f"{'; '.join(diff)}"}
            self.refused.pop(rank, None)
            now = time.time()
            self.members[rank] = {"address": body.get("address", ""), "joined": now, "beat": now,
                                  "engine": "waiting", "detail": ""}
            return 200, {"ok": True, **self.flags}

    def beat(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            member = self.members.get(body.get("rank"))
            if member is None:
                return 404, {"error": "not joined"}
            member.update(beat=time.time(), engine=body.get("engine", "?"), detail=body.get("detail", ""))
            return 200, dict(self.flags)

    def control(self, body: dict) -> tuple[int, dict]:
        if body.get("token") != self.token or body.get("action") not in self.flags:
            return 403, {"error": "the head's rig only"}
        with self.lock:
            self.flags[body["action"]] = True
        return 200, dict(self.flags)


def _handler(reg: Registry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._send(*((200, reg.state()) if self.path == "/state" else (404, {"error": self.path})))

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                body = {}
            route = {"/join": reg.join, "/beat": reg.beat, "/control": reg.control}.get(self.path)
            self._send(*(route(body) if route and isinstance(body, dict) else (404, {"error": self.path})))

        def log_message(self, *args: object) -> None:  # the registry's own log stays quiet
            pass

    return Handler


def _serve_registry() -> None:
    conf = json.loads(os.environ.pop("RIG_REGISTRY"))
    reg = Registry(conf["nodes"], conf["identity"], conf["token"])
    ThreadingHTTPServer((conf["bind"], conf["port"]), _handler(reg)).serve_forever()


# -- talking to the registry ---------------------------------------------------------------------------------------


def url(v: Serve) -> str:
    return f"http://{v.head_addr}:{v.nodes_port}"


def call(base: str, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    """(HTTP status, JSON body); status 0 when the registry cannot be reached."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
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


def role_path(s: Settings) -> Path:
    return s.state_dir / "nodes.toml"


def load_role(s: Settings) -> Role | None:
    try:
        data = tomllib.loads(role_path(s).read_text())
        return Role(**{k: data[k] for k in Role.__dataclass_fields__ if k in data})
    except (FileNotFoundError, tomllib.TOMLDecodeError, TypeError):
        return None


def _save_role(s: Settings, role: Role) -> None:
    import tomli_w

    atomic.write_text(role_path(s), "# This node's part in a multi-node engine (rig/nodes.py).\n"
                      + tomli_w.dumps(asdict(role)), perms=0o600)  # 0600: the registry's token


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 1.0
    except psutil.NoSuchProcess:
        return False


def end_helper(s: Settings, timeout: float = 5.0) -> None:
    """End this node's registry or agent, and forget the role."""
    from rig.supervise import terminate

    role = load_role(s)
    if role and role.pid != os.getpid() and _alive(role.pid, role.create_time):
        terminate(role.pid, timeout)  # each runs in a session of its own: its pid is its group
    role_path(s).unlink(missing_ok=True)


def close(s: Settings, role: Role) -> None:
    """After this node's engine has ended: its Ray (with Ray), then its registry or agent."""
    if role.backend == "ray":
        from rig import raycluster

        say(f"ray: {raycluster.stop(s)}")
    end_helper(s)


def _spawn(kind: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """The registry or the agent, in a session of its own; what it says goes to ``log`` (RIG_STATE)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rig.nodes", kind], cwd=REPO_ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# -- the head ------------------------------------------------------------------------------------------------------


def open_registry(s: Settings, v: Serve, ident: dict, bind: str) -> Role:
    """Start the registry for this head's engine, and wait until it answers."""
    import psutil

    end_helper(s)  # an earlier head's, left by a crash
    token = secrets.token_hex(16)
    conf = {"nodes": v.nodes, "identity": ident, "token": token, "bind": bind, "port": v.nodes_port}
    proc = _spawn("registry", {**os.environ, "RIG_REGISTRY": json.dumps(conf)}, s.state_dir / "registry.log")
    base = f"http://{bind}:{v.nodes_port}"
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if call(base, "/state", timeout=1)[0] == 200:
            role = Role("head", proc.pid, psutil.Process(proc.pid).create_time(), base, 0, token, v.dist_backend)
            _save_role(s, role)
            say(f"nodes: registry on {bind}:{v.nodes_port} (pid {proc.pid}); waiting for {v.nodes - 1} worker(s)")
            return role
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise BadInput(problem(f"NODES_PORT={v.nodes_port} on {bind}", "free, for the rig's node registry",
                           "in use, or the address is not this node's", "set NODES_PORT to a free port on every "
                           "node, or HEAD_ADDR to this node's own address"))


def wait_for_workers(v: Serve, role: Role) -> None:
    """Until every worker has joined with the head's build; a node that differs ends the start (exit 2)."""
    t0 = time.monotonic()
    last_line = t0
    want = set(range(1, v.nodes))
    while True:
        code, st = call(role.url, "/state")
        if code == 200:
            if st["refused"]:
                raise BadInput("; ".join(f"node {r}: expected the head's build and checkpoint, found {m}. Fix: "
                                         "run ./build.sh on that node from the same commit, with the same "
                                         "checkpoint (nox -s verify installs the head's artifacts/)"
                                         for r, m in sorted(st["refused"].items())))
            joined = {int(r) for r in st["members"]}
            if want <= joined:
                say(f"nodes: all {v.nodes - 1} worker(s) joined in {time.monotonic() - t0:.0f} s, each with this "
                    "node's build and checkpoint")
                return
        now = time.monotonic()
        if now - t0 > v.start_timeout:
            missing = sorted(want - (joined if code == 200 else set()))
            raise WorkFailed(f"worker(s) {', '.join(map(str, missing))} did not join within START_TIMEOUT="
                             f"{v.start_timeout} s: start them (./start.sh with NODE_RANK set) and check that they "
                             f"reach {role.url}")
        if now - last_line >= WAIT_LINE:
            last_line = now
            have = sorted(joined) if code == 200 else []
            say(f"nodes: waiting for workers: {now - t0:.0f} s, joined {have or 'none yet'} of "
                f"{sorted(want)}")
        time.sleep(0.5)


def tell(role: Role, action: str) -> None:
    call(role.url, "/control", {"token": role.token, "action": action})


def stop_workers(role: Role, timeout: float) -> list[str]:
    """Tell every worker to stop, and wait until each has left (or is lost); lines saying how each ended."""
    tell(role, "stop")
    end = time.monotonic() + timeout
    while True:
        code, st = call(role.url, "/state")
        if code != 200:
            return ["the registry did not answer: each worker's agent stops its engine when the head is gone"]
        pending = {r: m for r, m in st["members"].items() if m["engine"] != "left" and st["now"] - m["beat"] < LOST}
        if not pending or time.monotonic() > end:
            return [f"node {r}: " + ("stopped" if m["engine"] == "left" else
                                     "still stopping" if r in pending else f"lost (no beat for {LOST:.0f} s)")
                    for r, m in sorted(st["members"].items())]
        time.sleep(0.2)


def node_lines(role: Role) -> tuple[bool, list[str]]:
    """(every worker's engine runs, a line per node) from the registry's beats."""
    code, st = call(role.url, "/state")
    if code != 200:
        return False, [f"the node registry at {role.url} does not answer ({st.get('error')})"]
    ok, lines = True, []
    for r in range(1, st["nodes"]):
        m = st["members"].get(str(r))
        if m is None:
            ok = False
            lines.append(f"node {r}: not joined" + (f" (refused: {st['refused'][str(r)]})" if str(r) in
                                                     st["refused"] else ""))
            continue
        age = st["now"] - m["beat"]
        if age > LOST:
            ok = False
            lines.append(f"node {r} ({m['address']}): LOST, no beat for {age:.0f} s (its agent is gone)")
        elif m["engine"] != "running":
            ok = False
            lines.append(f"node {r} ({m['address']}): engine {m['engine'].upper()}"
                         + (f" ({m['detail']})" if m["detail"] else "") + f", reported {age:.1f} s ago")
        else:
            lines.append(f"node {r} ({m['address']}): engine running, beat {age:.1f} s ago")
    return ok, lines


# -- a worker ------------------------------------------------------------------------------------------------------


def join(v: Serve, ident: dict, address: str) -> None:
    """Report this node's build to the head, waiting for the head and retrying; a refusal is exit 2."""
    base, t0 = url(v), time.monotonic()
    last_line = t0
    say(f"nodes: worker {v.node_rank} of {v.nodes}: joining the head at {base}")
    while True:
        code, body = call(base, "/join", {"rank": v.node_rank, "identity": ident, "address": address})
        if code == 200:
            say(f"nodes: joined the head in {time.monotonic() - t0:.0f} s (same build and checkpoint)")
            return
        if code in (400, 409):
            raise BadInput(f"the head refused this node: {body.get('error')}. Fix: run ./build.sh here from the "
                           "head's commit, with its checkpoint and settings")
        now = time.monotonic()
        if now - t0 > v.start_timeout:
            raise WorkFailed(f"the head's registry at {base} did not answer within START_TIMEOUT={v.start_timeout}"
                             f" s (last: {body.get('error') or code}): start the head (NODE_RANK=0) first, or check "
                             "HEAD_ADDR and NODES_PORT")
        if now - last_line >= WAIT_LINE:
            last_line = now
            say(f"nodes: waiting for the head at {base}: {now - t0:.0f} s ({body.get('error') or code})")
        time.sleep(1.0)


def wait_go(v: Serve) -> None:
    """Until the head has started its engine (the workers' engines connect to it)."""
    base, t0 = url(v), time.monotonic()
    while True:
        code, st = call(base, "/state")
        if code == 200 and st["stop"]:
            raise WorkFailed("the head stopped before this node's engine started")
        if code == 200 and st["go"]:
            return
        if time.monotonic() - t0 > v.start_timeout:
            raise WorkFailed(f"the head did not start its engine within START_TIMEOUT={v.start_timeout} s")
        time.sleep(0.5)


def head_ready(v: Serve) -> tuple[bool, str]:
    """The worker's health while it starts: the head's API answered a generation through every node."""
    code, st = call(url(v), "/state", timeout=2)
    if code != 200:
        return False, f"the head's registry does not answer ({st.get('error')})"
    if st["stop"]:
        raise WorkFailed("the head stopped while this node's engine started")
    return (True, "the head's API generated through every node") if st["ready"] else \
        (False, "waiting for the head's API to answer a generation")


def start_agent(s: Settings, v: Serve, env: dict[str, str]) -> None:
    """The worker's agent, in a session of its own: beats, and stops the engine when the head says so."""
    import psutil

    end_helper(s)
    proc = _spawn("agent", dict(env), s.state_dir / "agent.log")
    _save_role(s, Role("worker", proc.pid, psutil.Process(proc.pid).create_time(), url(v), v.node_rank, "",
                       v.dist_backend))


def _local(s: Settings, v: Serve) -> tuple[bool, str] | None:
    """(this node's part runs, why not), or None when it has ended here (stopped on this node)."""
    from rig.supervise import load, server_alive

    if v.dist_backend == "ray":
        from rig import raycluster

        return (True, "") if raycluster.running() else (False, "its raylet is gone")
    rec = load(s)
    if rec is None:  # stopped here (nox -s stop on this node), or its whole group has ended
        return None
    return (True, "") if server_alive(rec) else (False, f"its vllm serve --headless (group {rec.pgid}) is gone")


def _agent() -> None:
    from rig import config, control

    s, v = config.settings(), config.serve_settings()
    base, lost_since = url(v), None
    print(f"{time.strftime('%F %T')} agent of worker {v.node_rank}: beating to {base}", flush=True)
    while True:
        local = _local(s, v)
        if local is None:
            call(base, "/beat", {"rank": v.node_rank, "engine": "left"})
            print(f"{time.strftime('%F %T')} the engine has ended here: left", flush=True)
            return
        running, detail = local
        code, flags = call(base, "/beat", {"rank": v.node_rank, "engine": "running" if running else "gone",
                                           "detail": detail}, timeout=BEAT * 2)
        now = time.monotonic()
        lost_since = None if code == 200 else (lost_since or now)
        if (code == 200 and flags.get("stop")) or (lost_since and now - lost_since > LOST):
            print(f"{time.strftime('%F %T')} stopping the engine: "
                  f"{'the head said so' if code == 200 else f'no head for {LOST:.0f} s'}", flush=True)
            done = threading.Event()  # beats go on while the stop waits for SIGTERM: the head waits for "left"
            threading.Thread(target=_beat_until, args=(base, v.node_rank, done), daemon=True).start()
            try:
                control.stop(s, v)  # with Ray, it runs ray stop too
            finally:
                done.set()
                call(base, "/beat", {"rank": v.node_rank, "engine": "left"})
            return
        time.sleep(BEAT)


def doctor_checks(s: Settings, v: Serve) -> list:
    """``nox -s doctor`` on a multi-node setting: what this node needs of the others (run it on each)."""
    import socket

    from rig import netif, raycluster
    from rig.box import Check

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
        code, body = call(url(v), "/state", timeout=3)
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


def _beat_until(base: str, rank: int, done: threading.Event) -> None:
    while not done.wait(BEAT):
        call(base, "/beat", {"rank": rank, "engine": "stopping"}, timeout=BEAT * 2)


def warn_if_public(address: str, what: str) -> None:
    from rig.netif import private

    if not private(address):
        warn(f"{what} {address} is not a private address: the traffic between nodes is unencrypted and can run "
             "code (vLLM's own docs say so); keep it on a private network, or firewall the ports")


if __name__ == "__main__":
    {"registry": _serve_registry, "agent": _agent}[sys.argv[1]]()
