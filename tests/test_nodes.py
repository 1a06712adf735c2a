"""Beyond one box, without an engine: the settings, the interface, the engine's switches, and the node registry
(its real HTTP service, on the loopback) that checks every node's build and carries start and stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import psutil
import pytest
from conftest import run_rig

from rig.base import netif
from rig.base.errors import BadInput
from rig.facts import config
from rig.nodes import client
from rig.nodes import registry as nodes_registry
from rig.plan import engine
from rig.running import enginerec

HEAD = {"tree": "t" * 40, "ops_obj": "o" * 64, "device": "cpu", "cards": 1, "config": "c" * 64}
SECRET = "s" * 64


def serve(**env: str) -> config.Serve:
    return config.serve_settings({"HEAD_ADDR": "127.0.0.1", "NODES_SECRET": SECRET, **env})


def call(base: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A node's call, signed with the nodes' secret."""
    return client.call(base, path, body, secret=SECRET)


# -- settings ------------------------------------------------------------------------------------------------------


def test_one_node_is_the_default_and_changes_nothing():
    v = config.serve_settings({})
    assert (v.nodes, v.node_rank, v.head_addr, v.dist_backend, v.net_iface) == (1, 0, "", "mp", "auto")
    assert engine.node_args(v) == []


@pytest.mark.parametrize("env,want", [
    ({"NODES": "2", "NODE_RANK": "2", "HEAD_ADDR": "10.0.0.1"}, "NODE_RANK: expected 0 to NODES-1 = 1"),
    ({"NODES": "2", "HEAD_ADDR": "10.0.0.1"}, "NODES_SECRET: expected a shared secret of at least 32 characters, "
                                              "with NODES=2"),
    ({"NODES": "2", "HEAD_ADDR": "10.0.0.1", "NODES_SECRET": "short"}, "found 5 characters"),
    ({"NODES": "2"}, "HEAD_ADDR: expected the head's address, with NODES=2, found unset"),
    ({"NODES": "0"}, "NODES: expected a whole number >= 1"),
    ({"NODES": "2", "HEAD_ADDR": "-x"}, "HEAD_ADDR: expected an IP address"),
    ({"DIST_BACKEND": "slurm"}, "DIST_BACKEND: expected mp or ray, found 'slurm'"),
])
def test_bad_node_settings_name_the_variable_and_the_fix(env, want):
    with pytest.raises(BadInput) as e:
        config.serve_settings(env)
    assert e.value.code == 2 and want in e.value.message and "Fix:" in e.value.message


def test_the_head_and_a_worker_get_vllms_own_multi_node_switches():
    head = serve(NODES="2", NODE_RANK="0", HEAD_PORT="29601")
    assert engine.node_args(head) == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                      "--master-port", "29601"]
    worker = serve(NODES="2", NODE_RANK="1", HEAD_PORT="29601")
    assert engine.node_args(worker)[-1] == "--headless" and "--node-rank" in engine.node_args(worker)
    assert engine.node_args(serve(NODES="2", DIST_BACKEND="ray")) == ["--distributed-executor-backend", "ray"]


# -- the interface ---------------------------------------------------------------------------------------------------


def test_auto_picks_the_interface_whose_address_routes_to_the_head_and_sets_the_three_variables():
    i = netif.choose("auto", "127.0.0.1", 29501)
    assert (i.name, i.address, i.how) == ("lo", "127.0.0.1", "the route to HEAD_ADDR")
    assert i.env() == {"VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert netif.choose("lo", "10.9.9.9", 1).address == "127.0.0.1"


def test_a_named_interface_that_is_not_there_lists_those_that_are():
    with pytest.raises(BadInput) as e:
        netif.choose("eth99", "127.0.0.1", 1)
    assert "NET_IFACE=eth99" in e.value.message and "no such interface" in e.value.message and "lo (127.0.0.1" \
        in e.value.message


@pytest.mark.parametrize("addr,private", [("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.9", True),
                                          ("172.16.0.1", True), ("169.254.1.1", True), ("8.8.8.8", False),
                                          ("1.1.1.1", False)])
def test_a_public_node_to_node_address_is_told_apart(addr, private):
    assert netif.private(addr) is private


def test_start_warns_when_the_node_to_node_address_is_public(capsys):
    netif.warn_if_public("8.8.8.8", "the node-to-node address")
    assert "not a private address" in capsys.readouterr().err
    netif.warn_if_public("10.0.0.2", "the node-to-node address")
    assert capsys.readouterr().err == ""


# -- the registry ---------------------------------------------------------------------------------------------------


@pytest.fixture
def registry():
    reg = nodes_registry.Registry(3, HEAD, "token", SECRET)
    server = ThreadingHTTPServer(("127.0.0.1", 0), nodes_registry._handler(reg))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield base, client.Role("head", os.getpid(), 0.0, base, 0, "token", secret=SECRET)
    server.shutdown()


def test_a_worker_with_the_heads_build_joins_and_one_that_differs_is_named_with_the_value(registry):
    base, role = registry
    assert call(base, "/join", {"rank": 1, "identity": HEAD, "address": "10.0.0.2"})[0] == 200
    code, body = call(base, "/join", {"rank": 2, "identity": {**HEAD, "ops_obj": "x" * 64},
                                            "address": "10.0.0.3"})
    assert code == 409 and body["error"] == f"node 2 (10.0.0.3) differs from the head: OPS_OBJ: head {'o' * 64}, " \
                                            f"this node {'x' * 64}"
    assert body["fix"] == "run ./build.sh on the node from the head's commit (the same series)"
    code, body = call(base, "/join", {"rank": 3, "identity": HEAD})
    assert code == 400 and "NODE_RANK: expected 1 to 2 (NODES=3 at the head), found 3" in body["error"]
    assert "NODE_RANK from 1 to NODES-1" in body["fix"]  # a build would not change the rank
    with pytest.raises(BadInput, match="node 2: expected the head's build and checkpoint, found OPS_OBJ") as e:
        nodes_registry.wait_for_workers(serve(NODES="3"), role)
    assert "Fix: run ./build.sh on the node from the head's commit" in e.value.message
    # the fix followed: the node's build is now the head's, and it joins
    assert call(base, "/join", {"rank": 2, "identity": HEAD, "address": "10.0.0.3"})[0] == 200
    assert "2" not in call(base, "/state")[1]["refused"]


def test_every_difference_is_named():
    node = {**HEAD, "tree": "u" * 40, "device": "cuda", "cards": 4, "config": "d" * 64}
    assert [d.split(":")[0] for d in client.differences(HEAD, node)] == [
        "tree id", "device", "cards", "the checkpoint's config.json sha256"]
    assert client.differences(HEAD, dict(HEAD)) == []
    # each kind of difference its own fix: no build changes the cards or the checkpoint
    assert client.fix(HEAD, node).split("; ") == [
        "run ./build.sh on the node from the head's commit (the same series)", "set DEVICE as on the head",
        "give the node as many cards as the head (CUDA_VISIBLE_DEVICES)", "point CKPT at the same checkpoint as the "
        "head's"]
    assert client.fix(HEAD, {**HEAD, "tree": "u" * 40, "ops_obj": "x" * 64}).count("./build.sh") == 1


def test_start_stop_and_health_flow_through_the_registry(registry):
    base, role = registry
    for rank in (1, 2):
        call(base, "/join", {"rank": rank, "identity": HEAD, "address": f"10.0.0.{rank + 1}"})
    nodes_registry.wait_for_workers(serve(NODES="3"), role)  # both joined: returns at once
    assert call(base, "/control", {"token": "wrong", "action": "stop"})[0] == 403  # the head's rig only
    nodes_registry.tell(role, "go")
    assert call(base, "/beat", {"rank": 1, "engine": "running"})[1]["go"] is True
    call(base, "/beat", {"rank": 2, "engine": "gone", "detail": "its server (pid 9) is gone"})
    ok, lines = nodes_registry.node_lines(role)
    assert not ok and lines[0].startswith("node 1 (10.0.0.2): engine running, beat")
    assert lines[1].startswith("node 2 (10.0.0.3): engine GONE (its server (pid 9) is gone), reported")

    def leave(rank: int) -> None:  # what an agent does when the head says stop
        while not call(base, "/beat", {"rank": rank, "engine": "running"})[1].get("stop"):
            time.sleep(0.05)
        call(base, "/beat", {"rank": rank, "engine": "left"})

    threads = [threading.Thread(target=leave, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert nodes_registry.stop_workers(role, timeout=10) == ["node 1: stopped", "node 2: stopped"]


def test_a_worker_that_stops_beating_is_reported_lost(registry, monkeypatch):
    base, role = registry
    call(base, "/join", {"rank": 1, "identity": HEAD, "address": "10.0.0.2"})
    monkeypatch.setattr(client, "LOST", 0.2)
    time.sleep(0.3)
    ok, lines = nodes_registry.node_lines(role)
    assert not ok and "node 1 (10.0.0.2): LOST, no beat for" in lines[0] and lines[1] == "node 2: not joined"


def test_every_call_is_signed_and_an_unsigned_one_is_refused_with_401_and_a_line_naming_its_address(registry,
                                                                                                     capsys):
    base, role = registry
    join = {"rank": 1, "identity": HEAD, "address": "10.0.0.2"}
    req = urllib.request.Request(base + "/join", data=json.dumps(join).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    code, body = client.call(base, "/join", join, secret="x" * 64)
    assert code == 401 and "a wrong signature (another NODES_SECRET)" in body["error"]
    assert client.call(base, "/state", secret="x" * 64)[0] == 401  # reads too
    stamp = f"{time.time() - 3600:.3f}"  # a replay of an hour-old call, signed with the right secret
    raw = json.dumps(join).encode()
    old = urllib.request.Request(base + "/join", data=raw, headers={
        client.STAMP: stamp, client.SIGNATURE: client.signature(SECRET, "POST", "/join", stamp, raw)})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(old, timeout=5)
    assert e.value.code == 401 and "s old" in json.loads(e.value.read())["error"]
    log = capsys.readouterr().out
    assert "refused POST /join from 127.0.0.1: no signature" in log
    assert "refused GET /state from 127.0.0.1: a wrong signature" in log
    assert call(base, "/state")[1]["members"] == {}  # none of them joined
    assert call(base, "/join", join)[0] == 200


def test_a_worker_with_another_secret_is_refused_naming_the_variable(registry):
    base, _ = registry
    port = base.rsplit(":", 1)[1]
    v = serve(NODES="3", NODE_RANK="1", NODES_PORT=port, NODES_SECRET="y" * 64)
    with pytest.raises(BadInput) as e:
        client.join(v, HEAD, "127.0.0.1")
    assert "worker 1's NODES_SECRET: expected the head's" in e.value.message and "a wrong signature" in \
        e.value.message and "set the same NODES_SECRET on every node" in e.value.message


def test_the_head_names_a_worker_that_joined_but_runs_no_engine(registry, monkeypatch):
    base, role = registry
    call(base, "/join", {"rank": 1, "identity": HEAD, "address": "10.0.0.2"})
    monkeypatch.setattr(client, "LOST", 0.3)
    go = time.time()
    assert nodes_registry.missing_engine(role, go) == ""  # just told to start
    call(base, "/beat", {"rank": 1, "engine": "running"})
    time.sleep(0.2)
    assert nodes_registry.missing_engine(role, go) == ""
    time.sleep(0.3)
    assert nodes_registry.missing_engine(role, go).startswith("worker 1 (10.0.0.2): joined, then no beat for")
    call(base, "/beat", {"rank": 1, "engine": "gone", "detail": "its vllm serve --headless (group 9) is gone"})
    assert nodes_registry.missing_engine(role, go) == "worker 1 (10.0.0.2): its engine is gone (its vllm serve " \
                                                      "--headless (group 9) is gone)"


@pytest.fixture
def stand_in(tmp_path):
    """A process the pid file names as this node's running engine (``vllm serve CKPT`` by its command line)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\nsleep 120\n")
    exe.chmod(0o755)
    proc = subprocess.Popen(["/bin/sh", str(exe), "serve", str(ckpt)], start_new_session=True)
    state = tmp_path / "state"
    s = config.settings({"RIG_STATE": str(state)})
    enginerec.save(s, enginerec.Record(pid=proc.pid, pgid=proc.pid, create_time=psutil.Process(proc.pid).create_time(),
                                       started=time.time(), host="127.0.0.1", port=8000, model="demo", log="",
                                       ckpt=str(ckpt)))
    yield s, ckpt, proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def worker_start(s: config.Settings, ckpt, port: str) -> object:
    env = {**os.environ, "NODES": "3", "NODE_RANK": "1", "HEAD_ADDR": "127.0.0.1", "NODES_PORT": port,
           "NODES_SECRET": SECRET, "RIG_STATE": str(s.state_dir), "CKPT": str(ckpt), "LOG": "", "START_TIMEOUT": "5"}
    return run_rig(env, "start", "--demo", "--no-build", "--skip-box-check")


def test_a_worker_that_finds_an_engine_running_refuses_before_it_joins_naming_it(registry, stand_in):
    base, _ = registry
    s, ckpt, proc = stand_in
    r = worker_start(s, ckpt, base.rsplit(":", 1)[1])
    assert r.code == 2, r.out + r.err
    assert f"this node's engine: expected none running, for worker 1 to join the head at {base}" in r.err
    assert f"pid {proc.pid}, up " in r.err and "a one-node engine on 127.0.0.1:8000" in r.err
    assert "nox -s stop on this node" in r.err
    assert call(base, "/state")[1]["members"] == {}  # it never joined: the head is not kept waiting for it
    assert proc.poll() is None  # and what runs here is left alone


def test_a_worker_that_is_already_this_heads_part_says_so_and_one_of_an_earlier_head_is_refused(registry, stand_in):
    base, _ = registry
    s, ckpt, proc = stand_in
    client.save_role(s, client.Role("worker", proc.pid, psutil.Process(proc.pid).create_time(), base, 1, "",
                                    secret=SECRET))
    r = worker_start(s, ckpt, base.rsplit(":", 1)[1])
    assert r.code == 2 and "worker 1 of the head at " + base in r.err, r.out + r.err
    assert "the head's registry does not see it running: it is an earlier head's" in r.err
    call(base, "/join", {"rank": 1, "identity": HEAD, "address": "127.0.0.1"})
    call(base, "/beat", {"rank": 1, "engine": "running"})
    r = worker_start(s, ckpt, base.rsplit(":", 1)[1])
    assert r.code == 0, r.out + r.err
    assert f"already running: worker 1 of the head at {base} (pid {proc.pid}" in r.out and "part of its engine" \
        in r.out


def test_a_worker_waits_for_the_head_then_gives_up_naming_it(monkeypatch):
    v = serve(NODES="2", NODE_RANK="1", NODES_PORT="1", START_TIMEOUT="1")
    with pytest.raises(Exception, match="did not answer within START_TIMEOUT=1 s"):
        client.join(v, HEAD, "127.0.0.1")


# -- the topology through start --------------------------------------------------------------------------------------


def dry_start(tmp_path, **env: str):
    """``./start.sh --demo --dry-run`` as a node of the demo on the loopback, in a state folder of its own."""
    env = {**os.environ, "HEAD_ADDR": "127.0.0.1", "NODES_SECRET": SECRET, "RIG_STATE": str(tmp_path), "LOG": "",
           **env}
    return run_rig(env, "start", "--demo", "--dry-run", "--no-build", "--skip-box-check")


def test_a_node_count_that_does_not_divide_the_demos_layers_exits_2_with_counts_that_would(tmp_path):
    r = dry_start(tmp_path, NODES="4", NODE_RANK="0")
    assert r.code == 2, r.out + r.err
    assert "NODES=4: expected a node count that divides the model's 2 layers" in r.err
    assert "NODES=1 or 2 would do" in r.err


def test_the_dry_run_of_a_worker_shows_the_headless_command_and_the_interface(tmp_path):
    r = dry_start(tmp_path, NODES="2", NODE_RANK="1")
    assert r.code == 0, r.out + r.err
    assert "topology: TP1 x PP2 on cards 0: 2 nodes of 1 card(s)" in r.out
    assert "nodes: worker 1 of 2 (mp), head 127.0.0.1:29501; interface lo 127.0.0.1" in r.out
    assert "--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29501 --headless" in r.out
    assert "NCCL_SOCKET_IFNAME=lo" in r.out and "VLLM_HOST_IP=127.0.0.1" in r.out


def test_ray_with_the_cpu_build_is_refused_before_anything_starts(tmp_path):
    r = dry_start(tmp_path, NODES="2", NODE_RANK="0", DIST_BACKEND="ray")
    assert r.code == 2 and "DIST_BACKEND=ray: expected mp with the CPU build" in r.err, r.out + r.err
    assert "current platform cpu does not support ray" in r.err and "nox -s ray -- up" in r.err
