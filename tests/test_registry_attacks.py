"""The head's node registry under attack, on the loopback: the real process (``python -m rig.nodes.registry``, as a
head's start spawns it), called by a client without the secret, by one replaying captured calls, and by one with the
secret and a body of the wrong shape."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import psutil
import pytest
from conftest import free_port

from rig.facts import config
from rig.nodes import client
from rig.nodes import registry as nodes_registry

SECRET = "r" * 64
HEAD = {"tree": "t" * 40, "ops_obj": "o" * 64, "device": "cpu", "cards": 1, "config": "c" * 64}


@pytest.fixture
def head(tmp_path):
    """The registry process of a head of three nodes, its pid, and its log."""
    env = {"RIG_STATE": str(tmp_path / "state"), "NODES": "3", "HEAD_ADDR": "127.0.0.1", "NODES_SECRET": SECRET,
           "NODES_PORT": str(free_port())}
    s, v = config.settings(env), config.serve_settings(env)
    role = nodes_registry.open_registry(s, v, HEAD, "127.0.0.1")
    yield role, psutil.Process(role.pid), s.state_dir / "registry.log"
    client.end_helper(s)


def raw(role: client.Role, method: str, path: str, headers: dict[str, str], body: bytes = b"",
        timeout: float = 10) -> tuple[int, dict]:
    host, port = role.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def signed(method: str, path: str, body: bytes, stamp: str | None = None) -> dict[str, str]:
    stamp = stamp or f"{time.time():.6f}"
    return {client.STAMP: stamp, client.SIGNATURE: client.signature(SECRET, method, path, stamp, body),
            "Content-Length": str(len(body))}


@pytest.mark.parametrize("length,code", [("-1", 400), ("abc", 400), (None, 400), ("\u0661\u0662", 400),
                                         (str(300 << 20), 413)])
def test_a_body_is_read_only_after_its_headers_are_checked_and_never_over_the_cap(head, length, code):
    """An unsigned POST streamed 300 MiB took the registry to 617 MiB before its 401. The signature headers and
    the declared length are checked first: nothing is read past BODY_MAX, a length that is missing, negative or
    not ASCII digits is 400 (with an answer, no traceback)."""
    role, proc, log = head
    headers = {k: v for k, v in signed("POST", "/beat", b"{}").items() if k != "Content-Length"}
    if length is not None:
        headers["Content-Length"] = length.encode("utf-8").decode("latin-1")
    got, body = raw(role, "POST", "/beat", headers)
    assert got == code and "Content-Length" in body["error"] or f"at most {nodes_registry.BODY_MAX}" in body["error"]
    host, port = role.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # unsigned, declared 300 MiB, then streamed
        sock.sendall(f"POST /join HTTP/1.1\r\nHost: x\r\nContent-Length: {300 << 20}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < 300 << 20:
                sock.sendall(b"\0" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass  # the registry answered and closed: it read none of it
    assert sent < 64 << 20, f"{sent >> 20} MiB went in before the registry closed"
    assert proc.memory_info().rss < 150 << 20, proc.memory_info().rss
    assert client.call(role.url, "/state", secret=SECRET)[0] == 200
    assert "Traceback" not in log.read_text()


def test_a_flood_of_idle_connections_does_not_stop_a_signed_call(head):
    """Idle sockets up to the open-file limit made signed calls time out and the registry spin: the connections
    from one address have a cap, each read a timeout, so a flood from elsewhere (127.0.0.2) leaves room."""
    role, proc, _ = head
    host, port = role.url.removeprefix("http://").split(":")
    flood = []
    for _ in range(300):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        try:
            s.connect((host, int(port)))
        except OSError:
            s.close()
            continue
        flood.append(s)
    try:
        proc.cpu_percent()
        t0 = time.monotonic()
        code, st = client.call(role.url, "/state", secret=SECRET, timeout=5)
        assert code == 200 and time.monotonic() - t0 < 3, (code, st)
        time.sleep(2)
        assert proc.cpu_percent() < 50
        assert len(proc.threads()) < nodes_registry.CONN_MAX + 8
        time.sleep(nodes_registry.IO_TIMEOUT + 1)  # the held ones are closed by their read's timeout
        held = 0
        for s in flood:
            s.settimeout(0.1)
            try:
                if s.recv(1):  # b"": closed by the registry
                    held += 1
            except TimeoutError:
                held += 1  # still open, waiting
            except OSError:
                pass  # reset by the registry
        assert held == 0, f"{held} idle connections still held"
    finally:
        for s in flood:
            s.close()


def test_a_captured_signed_call_is_good_once(head):
    """A replayed beat set a worker that reported its engine gone back to running: each signature is remembered
    for the window, and its second use is refused."""
    role, _, log = head
    join = json.dumps({"rank": 1, "identity": HEAD, "address": "10.0.0.2"}).encode()
    assert raw(role, "POST", "/join", signed("POST", "/join", join), join)[0] == 200
    beat = json.dumps({"rank": 1, "engine": "running"}).encode()
    captured = signed("POST", "/beat", beat)
    assert raw(role, "POST", "/beat", captured, beat)[0] == 200
    gone = json.dumps({"rank": 1, "engine": "gone", "detail": "killed"}).encode()
    assert raw(role, "POST", "/beat", signed("POST", "/beat", gone), gone)[0] == 200
    code, body = raw(role, "POST", "/beat", captured, beat)  # the replay
    assert code == 401 and "replay" in body["error"], body
    st = client.call(role.url, "/state", secret=SECRET)[1]
    assert st["members"]["1"]["engine"] == "gone"
    assert raw(role, "POST", "/join", signed("POST", "/join", join), join)[0] == 200  # a new call: a new stamp


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf", "1e400"])
def test_a_stamp_that_is_not_a_finite_number_is_refused(head, stamp):
    role, _, _ = head
    body = json.dumps({"rank": 1, "engine": "running"}).encode()
    code, answer = raw(role, "POST", "/beat", signed("POST", "/beat", body, stamp=stamp), body)
    assert code == 401 and "a bad time stamp" in answer["error"], answer


@pytest.mark.parametrize("path,body,field", [
    ("/join", {"rank": "1", "identity": HEAD}, "rank"), ("/join", {"rank": [1], "identity": HEAD}, "rank"),
    ("/join", {"rank": True, "identity": HEAD}, "rank"), ("/join", {"rank": 1, "identity": "x"}, "identity"),
    ("/join", {"rank": 1, "identity": HEAD, "address": ["x"]}, "address"),
    ("/beat", {"rank": 1, "engine": 5}, "engine"), ("/beat", {"rank": None, "engine": "running"}, "rank"),
    ("/control", {"token": ["t"], "action": "go"}, "token"), ("/join", "a string", "the body"),
    ("/beat", [1, 2], "the body"),
])
def test_a_signed_body_of_the_wrong_shape_is_400_naming_the_field(head, path, body, field):
    role, _, log = head
    data = json.dumps(body).encode()
    code, answer = raw(role, "POST", path, signed("POST", path, data), data)
    assert code == 400 and answer["error"].startswith(field), answer
    assert client.call(role.url, "/state", secret=SECRET)[0] == 200 and "Traceback" not in log.read_text()


def test_refusals_are_logged_escaped_short_and_counted_not_each(head):
    """200 calls with long paths added 12.7 MB to the log in under a second, escape bytes as they came."""
    role, _, log = head
    before = log.stat().st_size
    host, port = role.url.removeprefix("http://").split(":")
    for i in range(200):
        path = b"/join/\x1b[31m" + b"A" * 4000 + str(i).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            assert b" 401 " in sock.recv(4096)
    text = log.read_text()
    grown = log.stat().st_size - before
    assert grown < 4000, f"{grown} bytes for 200 refusals"
    assert "\x1b" not in text and "\\x1b[31m" in text and "refused POST" in text


def test_a_long_registry_log_is_moved_aside_at_the_next_heads_start(tmp_path):
    log = tmp_path / "registry.log"
    log.write_bytes(b"x" * (nodes_registry.LOG_MAX + 1))
    nodes_registry._rotate(log)
    assert not log.exists() and Path(str(log) + ".1").stat().st_size == nodes_registry.LOG_MAX + 1
