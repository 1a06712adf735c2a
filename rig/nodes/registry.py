"""The head's node registry; run as a script on purpose (``python -m rig.nodes.registry``, a process of its own).

The head's rig spawns it (:func:`open_registry`) in a session of its own, so that it outlives a detached start:
a small HTTP service on ``HEAD_ADDR:NODES_PORT`` that holds, in memory, which workers joined with the head's
build (:class:`Registry`), their beats, and the head's flags (go, ready, stop). Every call is signed with
``NODES_SECRET`` (rig/nodes/client.py); one that is not is refused with 401 and a line in ``RIG_STATE/registry.log``
naming its address. Its settings come on stdin (the token and the secret among them, so that no other user's
process sees them). The rest of this module is the head's side of it:
waiting for the workers, telling them, and the lines ``status`` prints from their beats.

It faces a network, so what a caller without the secret can make it do is bounded: the signature headers are
checked before the body is read, the body has a cap (``BODY_MAX``) and a declared length, each read or write a
timeout, the connections a cap in all and per address; a signed call is good once (its signature is remembered
for the window), every field has its type, and refusals are logged escaped, short, and counted past a few a
minute. It stays on the standard library's HTTP server: the rig's own Python has no other, and these bounds are
the ones a stack such as uvicorn/h11 would give it (which lives in the engine's venv, not the rig's).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rig.base.console import say, stamped
from rig.base.errors import BadInput, WorkFailed, problem
from rig.facts.config import Serve, Settings
from rig.facts.varparse import digits
from rig.nodes import client
from rig.nodes.client import Role, call

BODY_MAX = 64 * 1024  # bytes: a join (the build's identity) is about 2 KB, a beat about 200 bytes
IO_TIMEOUT = 5.0  # seconds a caller may take for each read or write of its call
CONN_MAX, CONN_PER_ADDR = 64, 8  # open connections in all, and from one address (far under the open-file limit)
LOG_PER_MINUTE = 5  # refusals logged in full from one address a minute; the rest are counted
TEXT_MAX = 2000  # characters of a text field (an address, a beat's detail)


def _shape(body: dict, fields: dict[str, type], optional: dict[str, type] | None = None) -> str:
    """'' when each field has its type (an int never a bool; ``optional`` ones may be missing), else what is
    wrong, naming the field."""
    for name, kind in {**fields, **{k: t for k, t in (optional or {}).items() if k in body}}.items():
        value = body.get(name)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is str and ok:
            ok = len(value) <= TEXT_MAX
        if not ok:
            shown = ascii(value)[:60] if value is not None else "nothing"
            limit = f" (at most {TEXT_MAX} characters)" if kind is str else ""
            return f"{name}: expected a {kind.__name__}{limit}, found {shown}"
    return ""


def _printable(text: str, limit: int = 80) -> str:
    """``text`` for the log: control and non-ASCII characters escaped, at most ``limit`` characters of it."""
    return ascii(text[:limit])[1:-1] + ("..." if len(text) > limit else "")


class Registry:
    """The head's view of the nodes, kept in memory by the registry process."""

    def __init__(self, nodes: int, head: dict, token: str, secret: str) -> None:
        self.nodes, self.head, self.token, self.secret = nodes, head, token, secret
        self.members: dict[int, dict] = {}
        self.refused: dict[int, dict[str, str]] = {}  # rank -> why it was refused and the fix
        self.flags = {"go": False, "ready": False, "stop": False}
        self.lock = threading.Lock()
        self.used: dict[str, float] = {}  # signatures seen, until they would be too old anyway

    def once(self, sig: str) -> bool:
        """True the first time a (good) signature is seen in the window: a captured call cannot be replayed."""
        now = time.monotonic()
        with self.lock:
            if len(self.used) > 1000:
                self.used = {k: t for k, t in self.used.items() if t > now}
            if self.used.get(sig, 0) > now:
                return False
            self.used[sig] = now + 2 * client.SKEW + 1
            return True

    def state(self) -> dict:
        with self.lock:
            return {"nodes": self.nodes, **self.flags, "now": time.time(),
                    "members": {str(r): m for r, m in self.members.items()},
                    "refused": {str(r): m for r, m in self.refused.items()}}

    def join(self, body: dict) -> tuple[int, dict]:
        wrong = _shape(body, {"rank": int, "identity": dict}, {"address": str})
        if wrong:
            return 400, {"error": wrong}
        rank = body["rank"]
        if not 0 < rank < self.nodes:
            return 400, {"error": f"NODE_RANK: expected 1 to {self.nodes - 1} (NODES={self.nodes} at the head), "
                                  f"found {rank}", "fix": client.RANK_FIX}
        node = body.get("identity") or {}
        diff = client.differences(self.head, node)
        with self.lock:
            if diff:
                why, fix = "; ".join(diff), client.fix(self.head, node)
                self.refused[rank] = {"why": why, "fix": fix}
                return 409, {"error": f"node {rank} ({body.get('address')}) differs from the head: {why}",
                             "fix": fix}
            self.refused.pop(rank, None)
            now = time.time()
            self.members[rank] = {"address": body.get("address", ""), "joined": now, "beat": now,
                                  "engine": "waiting", "detail": ""}
            return 200, {"ok": True, **self.flags}

    def beat(self, body: dict) -> tuple[int, dict]:
        wrong = _shape(body, {"rank": int, "engine": str}, {"detail": str})
        if wrong:
            return 400, {"error": wrong}
        with self.lock:
            member = self.members.get(body.get("rank"))
            if member is None:
                return 404, {"error": "not joined"}
            member.update(beat=time.time(), engine=body.get("engine", "?"), detail=body.get("detail", ""))
            return 200, dict(self.flags)

    def control(self, body: dict) -> tuple[int, dict]:
        wrong = _shape(body, {"token": str, "action": str})
        if wrong:
            return 400, {"error": wrong}
        if not secrets.compare_digest(body["token"], self.token) or body["action"] not in self.flags:
            return 403, {"error": "the head's rig only"}
        with self.lock:
            self.flags[body["action"]] = True
        return 200, dict(self.flags)


class Refusals:
    """The log's account of refused calls: the first few a minute from an address in full (escaped, short), then
    one line counting the rest, so that calls without the secret cannot flood or poison the log."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.minute = 0
        self.seen: Counter[str] = Counter()

    def note(self, addr: str, line: str) -> None:
        now = int(time.monotonic() // 60)
        with self.lock:
            if now != self.minute:
                for a, n in sorted(self.seen.items()):
                    if n > LOG_PER_MINUTE:
                        stamped(f"refused {n - LOG_PER_MINUTE} more call(s) from {a} in the minute before")
                self.minute, self.seen = now, Counter()
            self.seen[addr] += 1
            if self.seen[addr] <= LOG_PER_MINUTE:
                stamped(line)


class Server(ThreadingHTTPServer):
    """The standard library's threading server with a cap on open connections, in all and from one address: a
    flood of idle clients is turned away at the door instead of taking every thread and file."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (5 by default): turned away fast, not left to SYN retries

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(addr, handler)
        self.open: Counter[str] = Counter()  # connections held, by the caller's address
        self.held: dict[int, str] = {}  # each connection let in (its socket's id), and its address
        self.count_lock = threading.Lock()

    def verify_request(self, request, client_address) -> bool:  # noqa: ANN001 - socketserver's signature
        addr = client_address[0]
        with self.count_lock:
            if len(self.held) >= CONN_MAX or self.open[addr] >= CONN_PER_ADDR:
                return False
            self.open[addr] += 1
            self.held[id(request)] = addr
        return True

    def shutdown_request(self, request) -> None:  # noqa: ANN001
        with self.count_lock:
            addr = self.held.pop(id(request), None)  # None: turned away at the door, never counted
            if addr is not None:
                self.open[addr] -= 1
        super().shutdown_request(request)


class Handler(BaseHTTPRequestHandler):
    """One call to the registry; ``reg`` and ``said`` are set by :func:`_handler` on a subclass."""

    reg: Registry
    said: Refusals
    timeout = IO_TIMEOUT  # each read and write of the call (socketserver sets it on the socket)

    def _send(self, code: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(raw)

    def _refuse(self, code: int, why: str) -> None:
        self.said.note(self.client_address[0], f"refused {self.command} {_printable(self.path)} from "
                                               f"{self.client_address[0]}: {why}")
        self._send(code, {"error": f"refused: {why}"})

    def _signed(self, raw: bytes) -> bool:
        """Whether the call carries a good signature not seen before; else a 401 and a line naming the caller."""
        sig = self.headers.get(client.SIGNATURE)
        why = client.refusal(self.reg.secret, self.command, self.path, self.headers.get(client.STAMP), sig, raw)
        if not why and not self.reg.once(sig or ""):
            why = "a call made before (a replay: a signed call is good once)"
        if why:
            self._refuse(401, why)
        return not why

    def _body(self) -> bytes | None:
        """The body, read only after the headers are checked: its declared length, at most BODY_MAX."""
        stamp, sig = self.headers.get(client.STAMP), self.headers.get(client.SIGNATURE)
        if not stamp or not sig:  # nothing is read for a call that cannot be good
            self._refuse(401, "no signature (a node without NODES_SECRET, or not a node of this rig)")
            return None
        length = self.headers.get("Content-Length")
        if length is None or not digits(length):
            self._refuse(400, f"Content-Length: expected a number of bytes, found {ascii(length)[:40]}")
            return None
        if int(length) > BODY_MAX:
            self._refuse(413, f"a body of {length[:20]} bytes (at most {BODY_MAX})")
            return None
        try:
            raw = self.rfile.read(int(length))
        except OSError:  # a timeout among them
            return None
        return raw if len(raw) == int(length) else None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self._signed(b""):
            self._send(*((200, self.reg.state()) if self.path == "/state" else (404, {"error": self.path[:80]})))

    def do_POST(self) -> None:  # noqa: N802
        raw = self._body()
        if raw is None or not self._signed(raw):
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._send(400, {"error": "the body: expected JSON"})
        route = {"/join": self.reg.join, "/beat": self.reg.beat, "/control": self.reg.control}.get(self.path)
        if route is None:
            return self._send(404, {"error": self.path[:80]})
        self._send(*(route(body) if isinstance(body, dict) else (400, {"error": "the body: expected an object"})))

    def log_message(self, *args: object) -> None:  # the registry's own log stays quiet
        pass


def _handler(reg: Registry, refusals: Refusals | None = None) -> type[BaseHTTPRequestHandler]:
    """The handler class of one registry (http.server makes an instance per call)."""
    return type("RegistryHandler", (Handler,), {"reg": reg, "said": refusals or Refusals()})


LOG_MAX = 10 * 1024 * 1024  # bytes of registry.log before a head's start moves it to registry.log.1


def main() -> None:
    """The registry process: its settings from stdin (what :func:`open_registry` wrote), then serve forever."""
    conf = json.loads(sys.stdin.read())
    reg = Registry(conf["nodes"], conf["identity"], conf["token"], conf["secret"])
    Server((conf["bind"], conf["port"]), _handler(reg)).serve_forever()


def _rotate(log: Path) -> None:
    """One older registry.log kept: refusals are counted, not each logged, but a long life still adds up."""
    try:
        if log.stat().st_size > LOG_MAX:
            os.replace(log, log.with_name(log.name + ".1"))
    except FileNotFoundError:
        pass


# -- the head's side -------------------------------------------------------------------------------------------------


def open_registry(s: Settings, v: Serve, ident: dict, bind: str) -> Role:
    """Start the registry for this head's engine, and wait until it answers."""
    client.end_helper(s)  # an earlier head's, left by a crash
    token = secrets.token_hex(16)
    conf = {"nodes": v.nodes, "identity": ident, "token": token, "secret": v.nodes_secret, "bind": bind,
            "port": v.nodes_port}
    _rotate(s.state_dir / "registry.log")
    proc = client.spawn("rig.nodes.registry", dict(os.environ), s.state_dir / "registry.log",
                        json.dumps(conf).encode())
    base = f"http://{bind}:{v.nodes_port}"
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if call(base, "/state", secret=v.nodes_secret, timeout=1)[0] == 200:
            role = Role("head", proc.pid, client.create_time(proc.pid), base, 0, token, v.dist_backend, v.nodes_secret)
            client.save_role(s, role)
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
        code, st = call(role.url, "/state", secret=role.secret)
        if code == 200:
            if st["refused"]:
                raise BadInput("; ".join(problem(f"node {r}", "the head's build and checkpoint", m["why"], m["fix"])
                                         for r, m in sorted(st["refused"].items())))
            joined = {int(r) for r in st["members"]}
            if want <= joined:
                say(f"nodes: all {v.nodes - 1} worker(s) joined in {time.monotonic() - t0:.0f} s, each with this "
                    "node's build and checkpoint")
                return
        now = time.monotonic()
        if now - t0 > v.start_timeout:
            missing = sorted(want - (joined if code == 200 else set()))
            raise WorkFailed(problem(f"worker(s) {', '.join(map(str, missing))}", f"a join within START_TIMEOUT="
                                     f"{v.start_timeout} s", "none", "start them (./start.sh with NODE_RANK set) and "
                                     f"check that they reach {role.url}"))
        if now - last_line >= client.WAIT_LINE:
            last_line = now
            have = sorted(joined) if code == 200 else []
            say(f"nodes: waiting for workers: {now - t0:.0f} s, joined {have or 'none yet'} of "
                f"{sorted(want)}")
        time.sleep(0.5)


def tell(role: Role, action: str) -> None:
    call(role.url, "/control", {"token": role.token, "action": action}, secret=role.secret)


def stop_workers(role: Role, timeout: float) -> list[str]:
    """Tell every worker to stop, and wait until each has left (or is lost); lines saying how each ended."""
    tell(role, "stop")
    end = time.monotonic() + timeout
    while True:
        code, st = call(role.url, "/state", secret=role.secret)
        if code != 200:
            return ["the registry did not answer: each worker's agent stops its engine when the head is gone"]
        lost = client.LOST
        pending = {r: m for r, m in st["members"].items() if m["engine"] != "left" and st["now"] - m["beat"] < lost}
        if not pending or time.monotonic() > end:
            return [f"node {r}: " + ("stopped" if m["engine"] == "left" else
                                     "still stopping" if r in pending else f"lost (no beat for {lost:.0f} s)")
                    for r, m in sorted(st["members"].items())]
        time.sleep(0.2)


def missing_engine(role: Role, go: float) -> str:
    """What the head's start looks at while its engine starts (``go``: when it told the workers to start theirs):
    '' while every worker that joined runs or starts its engine, else what is wrong, naming the worker: its agent
    reports the engine gone, or it has not beaten for ``LOST`` seconds since the go (it joined, then started no
    engine: vLLM's init on the head would wait for it until START_TIMEOUT)."""
    code, st = call(role.url, "/state", secret=role.secret, timeout=2)
    if code != 200:
        return ""  # the registry's own trouble: status reports it; the engine's health decides the start
    for r, m in sorted(st["members"].items()):
        quiet = st["now"] - max(m["beat"], go)
        if m["engine"] in ("gone", "left"):
            return f"worker {r} ({m['address']}): its engine is {m['engine']}" + (f" ({m['detail']})" if m["detail"]
                                                                                   else "")
        if quiet > client.LOST:
            return (f"worker {r} ({m['address']}): joined, then no beat for {quiet:.0f} s since the head's go: no "
                    "engine of this start runs there")
    return ""


def node_lines(role: Role) -> tuple[bool, list[str]]:
    """(every worker's engine runs, a line per node) from the registry's beats."""
    code, st = call(role.url, "/state", secret=role.secret)
    if code != 200:
        return False, [f"the node registry at {role.url} does not answer ({st.get('error')})"]
    ok, lines = True, []
    for r in range(1, st["nodes"]):
        m = st["members"].get(str(r))
        if m is None:
            ok = False
            lines.append(f"node {r}: not joined" + (f" (refused: {st['refused'][str(r)]['why']})" if str(r) in
                                                     st["refused"] else ""))
            continue
        age = st["now"] - m["beat"]
        if age > client.LOST:
            ok = False
            lines.append(f"node {r} ({m['address']}): LOST, no beat for {age:.0f} s (its agent is gone)")
        elif m["engine"] != "running":
            ok = False
            lines.append(f"node {r} ({m['address']}): engine {m['engine'].upper()}"
                         + (f" ({m['detail']})" if m["detail"] else "") + f", reported {age:.1f} s ago")
        else:
            lines.append(f"node {r} ({m['address']}): engine running, beat {age:.1f} s ago")
    return ok, lines


if __name__ == "__main__":
    main()
