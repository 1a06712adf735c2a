"""Start, stop, status and health through the real supervise code, with an engine test double.

The double (tests/engine_double.py) stands where ``.venv/bin/vllm`` would: it takes vLLM's
flags, writes vLLM-format log lines and answers the OpenAI routes; ``DOUBLE_*`` variables make
it misbehave the ways a real engine does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, free_port, run_rig

from rig.base.errors import BadInput, Busy
from rig.control import start as starting
from rig.facts import config, slots
from rig.plan import box
from rig.plan.engine import runtime_dir
from rig.running import enginerec, metrics, supervise
from rig.running import health as health_mod

DOUBLE = ROOT / "tests" / "engine_double.py"


@pytest.fixture
def rig_env(tmp_path):
    """An environment whose venv's ``vllm`` is the double, with a checkpoint, a log and a state folder."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{DOUBLE}" "$@"\n')
    (venv / "bin" / "vllm").chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "qsa_kv_scales.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOUBLE_", "VLLM_", "MAX_", "GUARD"))}
    env.update(VENV_DIR=str(venv), CKPT=str(ckpt), PORT=str(free_port()), RIG_STATE=str(tmp_path / "state"),
               LOG=str(tmp_path / "vllm.log"), CACHE_ROOT=str(tmp_path / "cache"), START_TIMEOUT="30",
               STOP_TIMEOUT="3", DOUBLE_RECORD=str(tmp_path / "record.json"), CUDA_VISIBLE_DEVICES="0,1,2,3")
    yield env
    # Leave nothing running, whatever the test did.
    rec_file = Path(env["RIG_STATE"]) / "engine.toml"
    if rec_file.exists():
        run_rig(env, "stop")
    rec = tmp_path / "record.json"
    if rec.exists():
        pgid = json.loads(rec.read_text())["pgid"]
        enginerec.terminate(pgid, 1)


def start(env, *args, timeout=120):
    return run_rig(env, "start", "--no-build", "--skip-box-check", *args, timeout=timeout)


def record(env) -> dict:
    return json.loads(Path(env["DOUBLE_RECORD"]).read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_detached_start_status_stop(rig_env):
    env = {**rig_env, "VLLM_API_KEY": "sekrit-key", "MODEL_NAME": "qwen38 Hinata", "NODES_SECRET": "n" * 40}
    r = start(env)
    assert r.code == 0, r.text
    assert "ready in" in r.out and "model qwen38, Hinata" in r.out
    assert "GPU KV cache size: 924,993 tokens" in r.out
    rec = record(env)
    leader = enginerec.load(config.settings(env))
    assert alive(rec["pid"]) and rec["pgid"] == leader.pgid != os.getpgid(0)  # its own process group
    # The key reaches the engine through its environment, never its command line.
    assert "sekrit-key" not in " ".join(rec["argv"]) and rec["env"]["VLLM_API_KEY"] == "sekrit-key"
    assert "NODES_SECRET" not in rec["env"]  # the rigs' secret, not vLLM's
    assert rec["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and rec["env"]["NCCL_P2P_DISABLE"] == "1"
    assert rec["env"]["TRITON_CACHE_DIR"].startswith(env["CACHE_ROOT"])
    argv = rec["argv"]
    assert argv[argv.index("--served-model-name") + 1: argv.index("--served-model-name") + 3] == ["qwen38", "Hinata"]
    assert "Loading weights took" in Path(env["LOG"]).read_text()

    st = run_rig(env, "status")
    assert st.code == 0, st.text
    assert f"pid {leader.pid} (detached)" in st.out and "health: ok" in st.out and "924,993 tokens" in st.out

    again = start(env)
    assert again.code == 0 and "already running" in again.out
    assert record(env)["pid"] == rec["pid"]  # no second engine

    sp = run_rig(env, "stop")
    assert sp.code == 0, sp.text
    assert "clean SIGTERM" in sp.out and "no process of it is left" in sp.out
    assert not alive(rec["pid"]) and not enginerec.group_members(rec["pgid"])
    assert "Shutting down" in Path(env["LOG"]).read_text()
    assert run_rig(env, "status").code == 3
    assert "nothing to stop" in run_rig(env, "stop").out


def test_models_answering_is_not_healthy(rig_env):
    env = {**rig_env, "DOUBLE_MODE": "no-generate", "START_TIMEOUT": "4"}
    r = start(env)
    assert r.code == 1, r.text
    assert "not healthy within START_TIMEOUT=4 s" in r.err and "HTTP 500" in r.err
    rec = record(env)
    assert not enginerec.group_members(rec["pgid"])  # the failed engine was stopped
    assert not (Path(env["RIG_STATE"]) / "engine.toml").exists()


def test_an_engine_computing_nan_is_not_healthy_naming_it(rig_env):
    """A model that computes NaN answers the one-token request with 200 all the same; the check asks for the
    token's logprob and calls a non-finite one unhealthy."""
    r = start({**rig_env, "DOUBLE_MODE": "nan", "START_TIMEOUT": "4"})
    assert r.code == 1, r.text
    assert "logprob is nan, not a finite number" in r.err, r.err


def slow_server(body: bytes, gap: float, length: int | None = None) -> tuple[int, threading.Event]:
    """A server that answers every connection with a 200 whose body comes ``gap`` seconds per byte."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            srv.settimeout(0.2)
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(length or len(body)).encode() + b"\r\n\r\n")
                try:
                    for i in range(0, len(body), 1 if gap else len(body)):
                        conn.sendall(body[i:i + (1 if gap else len(body))])
                        if done.wait(gap):
                            break
                    conn.settimeout(5)
                    while conn.recv(65536):  # the client closes first: closing with its bytes unread resets it
                        pass
                except OSError:
                    pass
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], done


def test_the_health_check_has_one_deadline_and_a_cap_on_the_body():
    """The 30 s timeout was per socket read: a server sending a byte every 5 s was waited on for 391 s and called
    healthy. One deadline bounds the whole check, and an answer over the cap is refused unread."""
    answer = json.dumps({"choices": [{"logprobs": {"content": [{"logprob": -0.1}]}}],
                         "usage": {"completion_tokens": 1}}).encode()
    port, done = slow_server(answer, gap=0.3)
    t0 = time.monotonic()
    ok, detail = supervise.health("127.0.0.1", port, "m", timeout=2)
    took = time.monotonic() - t0
    done.set()
    assert not ok and took < 4, (ok, detail, took)
    port, done = slow_server(answer, gap=0)
    assert supervise.health("127.0.0.1", port, "m", timeout=5) == (True, "one token generated")  # the same, at once
    done.set()
    port, done = slow_server(b"x" * (health_mod.BODY_CAP + 10), gap=0)
    ok, detail = supervise.health("127.0.0.1", port, "m", timeout=5)
    done.set()
    assert not ok and f"over {health_mod.BODY_CAP} bytes" in detail, detail


def test_an_engine_that_dies_while_loading_shows_its_last_lines(rig_env):
    r = start({**rig_env, "DOUBLE_MODE": "crash"})
    assert r.code == 1
    assert "exited with code 3" in r.err and "CUDA out of memory" in r.err and rig_env["LOG"] in r.err


def test_sigkill_after_the_timeout_for_an_engine_that_ignores_sigterm(rig_env):
    env = {**rig_env, "DOUBLE_MODE": "ignore-term", "STOP_TIMEOUT": "2"}
    assert start(env).code == 0
    rec = record(env)
    t0 = time.monotonic()
    sp = run_rig(env, "stop")
    assert sp.code == 0, sp.text
    assert time.monotonic() - t0 >= 2 and "SIGKILL needed for" in sp.out
    assert not alive(rec["pid"])


def test_a_child_that_outlives_the_server_is_not_left_behind(rig_env):
    env = {**rig_env, "DOUBLE_CHILD": "1"}
    assert start(env).code == 0
    rec = record(env)
    members = enginerec.group_members(rec["pgid"])
    leader = enginerec.load(config.settings(env)).pid
    child = next(p for p in members if p not in (rec["pid"], leader))
    os.kill(rec["pid"], signal.SIGKILL)  # the server alone, as a careless kill would
    time.sleep(0.3)
    assert alive(child)  # like vLLM's EngineCore: still there, still holding its GPU memory
    st = run_rig(env, "status")
    assert st.code == 1 and "is gone, but processes of its group are left" in st.out and str(child) in st.out
    sp = run_rig(env, "stop")
    assert sp.code == 0, sp.text
    assert not alive(child) and not enginerec.group_members(rec["pgid"])


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    seen = ""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        seen += line
        if text in line:
            return seen
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{text!r} not seen; output so far:\n{seen}")


@pytest.mark.parametrize("via", ["rig.cli", "start.sh"])
def test_foreground_stops_cleanly_on_sigterm(rig_env, via):
    cmd = ([sys.executable, "-m", "rig.cli", "start"] if via == "rig.cli" else [str(ROOT / "start.sh")])
    proc = subprocess.Popen([*cmd, "--no-build", "--skip-box-check", "--foreground"], cwd=ROOT, env=rig_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(proc, "ready in")
        rec = record(rig_env)
        saved = enginerec.load(config.settings(rig_env))
        assert saved and saved.supervisor and saved.pgid == rec["pgid"]
        proc.send_signal(signal.SIGTERM)  # what systemd's stop sends (KillMode=control-group: to every process)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "engine stopped" in out
    assert not enginerec.group_members(rec["pgid"])
    assert not (Path(rig_env["RIG_STATE"]) / "engine.toml").exists()


def _foreground_then(rig_env: dict[str, str], act) -> tuple[subprocess.Popen, str, dict]:
    """A foreground start of the double; once it is ready, ``act(record)``; then its output and exit."""
    proc = subprocess.Popen([sys.executable, "-m", "rig.cli", "start", "--no-build", "--skip-box-check",
                             "--foreground"], cwd=ROOT, env=rig_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(proc, "ready in")
        rec = record(rig_env)
        act(rec)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc, out, rec


def test_a_foreground_engine_stopped_by_nox_stop_is_a_stop_not_a_crash(rig_env):
    """The unit's ExecStop (or a second terminal) runs nox -s stop: the supervisor exits 0, so systemd's
    Restart=on-failure does not start it again."""
    def stop(_rec: dict) -> None:
        r = run_rig(rig_env, "stop")
        assert r.code == 0 and "no process of it is left" in r.out, r.text

    proc, out, rec = _foreground_then(rig_env, stop)
    assert proc.returncode == 0 and "engine stopped by nox -s stop" in out, out
    assert not enginerec.group_members(rec["pgid"])
    said = (Path(rig_env["RIG_STATE"]) / metrics.FOLDER / metrics.FILE).read_text()  # rig/running/metrics.py
    assert "rig_engine_starts_total 1\n" in said and 'rig_engine_ends_total{cause="stopped"} 1\n' in said, said
    assert re.search(r"^rig_engine_start_seconds [\d.]+$", said, re.M) and 'rig_build_info{' in said, said


def test_a_foreground_engine_that_dies_on_its_own_exits_non_zero(rig_env):
    """An engine killed after it was healthy (the OOM killer, a crash): not a stop, so the supervisor's exit is
    not 0 and systemd's Restart=on-failure starts it again."""
    proc, out, _ = _foreground_then(rig_env, lambda rec: os.killpg(rec["pgid"], signal.SIGKILL))
    assert proc.returncode != 0, out
    assert "stopped by nox -s stop" not in out and "engine stopped" not in out, out
    said = (Path(rig_env["RIG_STATE"]) / metrics.FOLDER / metrics.FILE).read_text()
    assert re.search(r'^rig_engine_ends_total\{cause="(killed|leader)"\} 1$', said, re.M), said


def test_empty_log_keeps_the_output_on_the_terminal_and_warns_when_open(rig_env):
    env = {**rig_env, "LOG": "", "HOST": "0.0.0.0"}
    proc = subprocess.Popen([sys.executable, "-m", "rig.cli", "start", "--no-build", "--skip-box-check"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = _wait_for(proc, "ready in")
        assert "API is OPEN to the network" in seen
        assert "Application startup complete" in seen  # the engine's own lines, on the terminal
        assert proc.poll() is None  # LOG= runs in the foreground
        ok, detail = supervise.health("0.0.0.0", int(env["PORT"]), "qwen38-flash-next")
        assert ok, detail
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0


def test_dry_run_prints_the_command_and_masks_the_key(rig_env):
    r = run_rig({**rig_env, "VLLM_API_KEY": "sekrit-key"}, "start", "--dry-run", "--no-build", "--skip-box-check")
    assert r.code == 0, r.text
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 2 --enable-expert-parallel" in r.out
    assert "VLLM_API_KEY=<set, 10 characters>" in r.out and "sekrit" not in r.out
    assert "nothing started" in r.out and not Path(rig_env["DOUBLE_RECORD"]).exists()
    assert not (Path(rig_env["RIG_STATE"]) / "engine.toml").exists()


def test_first_start_builds_first(rig_env, tmp_path):
    env = {**rig_env, "PATCHES_DIR": str(tmp_path / "no-patches")}
    r = run_rig(env, "start", "--skip-box-check")
    assert "running ./build.sh first" in r.out
    assert r.code == 2 and "series.toml" in r.err  # the build's own clear error, and no engine
    assert not Path(env["DOUBLE_RECORD"]).exists()


def test_a_ple_home_outside_the_engines_cards_exits_2(rig_env):
    r = start({**rig_env, "PLE_OFFLOAD": "1", "PLE_HOME": "7"})
    assert r.code == 2, r.text
    assert "PLE_HOME: expected one of the cards the engine gets, CUDA_VISIBLE_DEVICES=" in r.err and "found 7" in r.err
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()


def test_unwritable_log_is_bad_input(rig_env, tmp_path):
    (tmp_path / "a-file").write_text("")  # a folder that is a file: no user, root included, can log there
    r = start({**rig_env, "LOG": str(tmp_path / "a-file" / "vllm.log")})
    assert r.code == 2, r.text
    assert "LOG: expected a file this user can append to" in r.err and "LOG=" in r.err
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()


@pytest.mark.parametrize("name,value,want", [
    ("MAX_BATCHED_TOKENS", "2", "MAX_BATCHED_TOKENS: expected >= MAX_SEQS (4)"),
    ("GUARD", "loud", "GUARD: expected warn or off or raise, found 'loud'"),
    ("PORT", "eighty", "PORT: expected a port number from 1 to 65535, found 'eighty'"),
    ("COUNTERS", "yes", "COUNTERS: expected 0 or 1"),
    ("PLE_HOME", "first", "PLE_HOME: expected a card index"),
    ("PLE_OFFLOAD", "yes", "PLE_OFFLOAD: expected 0 or 1"),
])
def test_bad_serve_variables_exit_2(rig_env, name, value, want):
    r = start({**rig_env, name: value})
    assert r.code == 2, r.text
    assert want in r.err and "Fix:" in r.err
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()


# --- the box check on the start path, with recorded NVML readings behind read_nvml ---------------------

def reading(n=4, changes=None) -> box.Reading:
    from test_box import three090s

    return box.reading_from_json(three090s(n, changes))


@pytest.fixture
def roomy(monkeypatch):
    """This machine's RAM and /dev/shm are smaller than the reference box's: only the GPU facts are tested."""
    import dataclasses

    from rig.facts import profiles

    ref = profiles.load("reference")
    roomy_ref = dataclasses.replace(ref, box=dataclasses.replace(ref.box, ram_gib=0.1, shm_gb=0.0, disk_gb=0.0))
    monkeypatch.setattr(profiles, "load", lambda name, *a: roomy_ref if name == "reference" else ref)


def dry_start(env: dict) -> int:
    """``./start.sh --dry-run`` in this process, the front door's way: the current build resolved first."""
    return starting.run(slots.settings(env), env, foreground=False, dry_run=True, build=False, box_check=True,
                        clear_cache=False)


def test_a_taken_port_is_a_busy_box_exit_75_and_the_unit_restarts_that_not_exit_2(rig_env, monkeypatch, roomy):
    """The unit did not tell a configuration to fix from a box busy for now: exit 2 restarted every 30 s until
    the start limit. A taken port is exit 75 (restarted); the unit does not restart exit 2."""
    monkeypatch.setattr(box, "read_nvml", lambda: reading())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = {**rig_env, "HOST": "127.0.0.1", "PORT": str(held.getsockname()[1])}
        with pytest.raises(Busy) as e:
            starting.run(slots.settings(env), env, foreground=False, dry_run=False, build=False, box_check=True,
                         clear_cache=False)
    assert e.value.code == 75 and "the box check" in e.value.message
    unit = (ROOT / "systemd" / "vllm.service").read_text()
    assert "\nRestartPreventExitStatus=2\n" in unit and "\nRestart=on-failure\n" in unit


def test_a_variable_of_vllms_name_that_the_rig_does_not_read_is_named_with_what_does(rig_env, monkeypatch, capsys,
                                                                                       roomy):
    """GPU_MEMORY_UTILIZATION=0.5 was silently ignored: the start warns, naming the profile key that does it."""
    monkeypatch.setattr(box, "read_nvml", lambda: reading())
    assert dry_start({**rig_env, "GPU_MEMORY_UTILIZATION": "0.5", "MAX_NUM_SEQS": "8"}) == 0
    err = capsys.readouterr().err
    assert "GPU_MEMORY_UTILIZATION=0.5 is not read by the rig" in err and "memory_utilization" in err, err
    assert "MAX_NUM_SEQS=8 is not read by the rig" in err and "use MAX_SEQS" in err, err
    assert dry_start(rig_env) == 0 and "is not read by the rig" not in capsys.readouterr().err


def start_in_process(env, monkeypatch, capsys, read):
    monkeypatch.setattr(box, "read_nvml", read)
    with pytest.raises(BadInput) as e:
        dry_start(env)
    return e.value, capsys.readouterr().err


def test_reference_box_reading_passes_and_chooses_tp2_pp2(rig_env, monkeypatch, capsys, roomy):
    monkeypatch.setattr(box, "read_nvml", lambda: reading())
    assert dry_start(rig_env) == 0
    out = capsys.readouterr().out
    assert "box: " in out and "checks passed" in out and "topology: TP2 x PP2 + EP" in out
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in out and "SCALES=" in out


def no_driver():
    raise box.NoDriver("NVMLError_LibraryNotFound: NVML Shared Library Not Found")


@pytest.mark.parametrize("read,want", [
    (no_driver, "NVIDIA driver: expected NVML"),
    (lambda: reading(2), "GPUs: expected 4 cards"),
    (lambda: reading(4, {3: {"name": "NVIDIA GeForce RTX 3080"}}), "card models: expected one model"),
    (lambda: reading(4, {1: {"compute_processes": [4242]}}), "GPU 1 free: expected no compute process, found pids"),
])
def test_bad_boxes_exit_2_naming_the_check(rig_env, monkeypatch, capsys, roomy, read, want):
    # GPU_WAIT=0: with the free-GPU gate on, a busy card only warns (tests/test_gpugate.py)
    err, text = start_in_process({**rig_env, "GPU_WAIT": "0"}, monkeypatch, capsys, read)
    assert err.code == 2 and "1 of" in err.message
    assert want in text and "Fix:" in text


@pytest.mark.parametrize("change,want", [
    ("no-ckpt", "checkpoint: expected a folder at CKPT="),
    ("no-config", "config.json"),
    ("no-scales", "KV scales: expected qsa_kv_scales.json"),
    ("port", "port: expected 127.0.0.1:"),
])
def test_bad_checkpoint_scales_and_port_exit_2(rig_env, monkeypatch, capsys, roomy, change, want):
    ckpt = Path(rig_env["CKPT"])
    held = None
    if change == "no-ckpt":
        rig_env = {**rig_env, "CKPT": str(ckpt / "missing")}
    elif change == "no-config":
        (ckpt / "config.json").unlink()
    elif change == "no-scales":
        (ckpt / "qsa_kv_scales.json").unlink()
    else:
        held = socket.socket()
        held.bind(("127.0.0.1", int(rig_env["PORT"])))
        held.listen()
    try:
        err, text = start_in_process(rig_env, monkeypatch, capsys, lambda: reading())
    finally:
        if held:
            held.close()
    assert err.code == 2 and want in text


def test_the_older_scales_name_is_accepted_saying_so(rig_env, monkeypatch, capsys, roomy):
    ckpt = Path(rig_env["CKPT"])
    (ckpt / "qsa_kv_scales.json").rename(ckpt / "qsa_kv_scales_swift.json")
    monkeypatch.setattr(box, "read_nvml", lambda: reading())
    assert dry_start(rig_env) == 0
    cap = capsys.readouterr()
    assert "the older name qsa_kv_scales_swift.json" in cap.err and "qsa_kv_scales_swift.json" in cap.out


# --- --clear-cache removes the rig's caches and nothing else ----------------------------------------------------

def test_clear_cache_refuses_a_root_that_holds_anything_else(rig_env, tmp_path):
    """CACHE_ROOT pointed at a folder of model weights must lose nothing."""
    root = tmp_path / "models"
    (root / "vllm").mkdir(parents=True)
    (root / "weights.safetensors").write_bytes(b"weights")
    r = start({**rig_env, "CACHE_ROOT": str(root)}, "--clear-cache")
    assert r.code == 2, r.text
    assert f"CACHE_ROOT={root}" in r.err and "weights.safetensors" in r.err and "nothing was removed" in r.err
    assert (root / "weights.safetensors").read_bytes() == b"weights" and (root / "vllm").is_dir()
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()  # no engine was started


def test_clear_cache_removes_only_the_rig_subfolders_and_never_through_a_link(tmp_path):
    from rig.plan import engine

    root = tmp_path / "cache"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"keep")
    for name in ("vllm", "triton", "inductor"):
        (root / name / "sub").mkdir(parents=True)
        (root / name / "sub" / "f").write_text("x")
    (root / "flashinfer").symlink_to(outside)
    assert engine.clear_cache(root) == ["flashinfer", "inductor", "triton", "vllm"]
    assert root.is_dir() and not any(root.iterdir())
    assert (outside / "keep.bin").read_bytes() == b"keep"
    assert engine.clear_cache(tmp_path / "absent") == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="not a folder"):
        engine.clear_cache(tmp_path / "file")


# --- bad serve input: each one line, exit 2, nothing started -------------------------------------------------

@pytest.mark.parametrize("name,value,want", [
    ("HOST", "--x", "an IP address"), ("HOST", "a b", "an IP address"), ("HOST", "host_name", "an IP address"),
    ("MODEL_NAME", "--trust-remote-code", "names of letters"), ("MODEL_NAME", "ok -x", "names of letters"),
    ("CUDA_VISIBLE_DEVICES", "a,b", "card indices"), ("CUDA_VISIBLE_DEVICES", "0,0,0,0", "each card once"),
    ("CUDA_VISIBLE_DEVICES", "GPU-0d3e5b1c-8a9f-4c2e-9b7d-1e2f3a4b5c6d", "GPU UUIDs are not supported"),
    ("CUDA_VISIBLE_DEVICES", "0,,1", "card indices"),
])
def test_bad_serve_variables_stop_before_anything_starts(rig_env, name, value, want):
    r = run_rig({**rig_env, name: value}, "start", "--dry-run", "--no-build", "--skip-box-check")
    assert r.code == 2, r.text
    assert f"{name}: expected" in r.err and repr(value.split()[-1] if name == "MODEL_NAME" else value) in r.err
    assert want in r.err and "Fix:" in r.err
    assert "command:" not in r.out and not Path(rig_env["DOUBLE_RECORD"]).exists()


@pytest.mark.parametrize("value", ["127.0.0.1", "0.0.0.0", "::1", "localhost", "gpu-box.lan"])
def test_good_hosts_pass(value):
    assert config.settings({"HOST": value}).host == value


def test_dry_run_checks_log_and_still_prints_the_command(rig_env, tmp_path):
    (tmp_path / "a-file").write_text("")
    r = run_rig({**rig_env, "LOG": str(tmp_path / "a-file" / "vllm.log")}, "start", "--dry-run", "--no-build",
                "--skip-box-check")
    assert r.code == 2, r.text
    assert "command: " in r.out and "LOG: expected a file this user can append to" in r.err
    assert not (tmp_path / "a-file").is_dir()


def test_dry_run_shows_the_command_when_the_box_check_fails_then_exits_2(rig_env, monkeypatch, capsys):
    monkeypatch.setattr(box, "read_nvml", no_driver)
    with pytest.raises(BadInput) as e:
        dry_start(rig_env)
    out = capsys.readouterr().out
    assert "command: " in out and "vllm serve" in out and "environment:" in out
    assert "the box check" in e.value.message and e.value.code == 2


def test_the_engine_log_is_created_readable_by_its_owner_and_group_only(rig_env, tmp_path):
    log = tmp_path / "new" / "vllm.log"
    r = start({**rig_env, "LOG": str(log)})
    try:
        assert r.code == 0, r.text
        assert log.stat().st_mode & 0o777 == 0o640
    finally:
        run_rig(rig_env, "stop")


def test_a_key_on_an_open_host_says_what_the_key_does_not_guard(rig_env):
    r = run_rig({**rig_env, "HOST": "0.0.0.0", "VLLM_API_KEY": "k"}, "start", "--dry-run", "--no-build",
                "--skip-box-check")
    assert r.code == 0, r.text
    assert "guards only vLLM's /v1 routes" in r.err and "/metrics" in r.err and r.err.count("guards only") == 1


def test_the_next_start_finds_the_leftovers_of_a_killed_server_and_ends_them(rig_env):
    env = {**rig_env, "DOUBLE_CHILD": "1"}
    assert start(env).code == 0
    rec = record(env)
    leader = enginerec.load(config.settings(env)).pid
    child = next(p for p in enginerec.group_members(rec["pgid"]) if p not in (rec["pid"], leader))
    os.kill(rec["pid"], signal.SIGKILL)
    time.sleep(0.3)
    again = start({**env, "DOUBLE_CHILD": "0"})
    try:
        assert again.code == 0, again.text
        assert "is gone, but processes of its group are left" in again.err and str(child) in again.err
        assert "ending them before the start" in again.err and not alive(child)
        assert "ready in" in again.out
    finally:
        run_rig(env, "stop")


def test_a_failed_start_leaves_no_process_of_its_group_and_no_runtime_folder(rig_env):
    """The server exits while its child (EngineCore's stand-in, ignoring SIGTERM) stays: the whole group is ended
    and its runtime folder removed before the start returns, so nothing of it can overlap the next start."""
    env = {**rig_env, "DOUBLE_MODE": "crash", "DOUBLE_CHILD": "1", "LOG": ""}
    r = start(env)
    assert r.code == 1 and "exited with code 3" in r.err, r.text
    rec = record(env)
    assert not enginerec.group_members(rec["pgid"]), "the failed engine's child is left running"
    run = runtime_dir(config.settings(env))
    assert not run.exists(), sorted(p.name for p in run.rglob("*"))
    assert Path(rec["env"]["VLLM_RPC_BASE_PATH"]).parent == run  # it had a runtime folder of its own


def test_each_start_has_its_own_runtime_folder_and_ends_what_a_gone_engine_left_running_there(rig_env):
    base = runtime_dir(config.settings(rig_env))
    (base / "gone").mkdir(parents=True, mode=0o700)
    base.chmod(0o700)
    (base / "gone" / "socket-of-a-gone-engine").write_text("")
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                            env={**os.environ, "VLLM_RPC_BASE_PATH": str(base / "gone")})
    try:
        r = start(rig_env)
        assert r.code == 0, r.text
        assert "left 1 process(es) running and 2 file(s)" in r.out and "ended and removed" in r.out, r.out
        assert left.wait(10) is not None
        own = Path(record(rig_env)["env"]["TMPDIR"])
        assert own.parent == base and own.name != "gone" and [p.name for p in base.iterdir()] == [own.name]
        assert enginerec.load(config.settings(rig_env)).runtime == str(own)
        (base / "vllm_dist_of_a_bare_start").write_text("")  # what a bare vllm serve of the plan leaves there
        (base / "torchinductor_root").mkdir()
        assert run_rig(rig_env, "stop").code == 0
        assert not base.exists()
    finally:
        left.kill()


def test_a_runtime_folder_planted_as_a_link_in_tmp_is_refused_and_removing_it_clears_it(rig_env, tmp_path):
    """A state path too long for a socket's name has its runtime folder in /tmp, where anyone can make the name
    first: a link there is never followed."""
    state = tmp_path / ("state-with-a-long-name-" + "x" * 60)
    env = {**rig_env, "RIG_STATE": str(state)}
    base = runtime_dir(config.settings(env))
    assert str(base).startswith("/tmp/rig-run-")
    target = tmp_path / "elsewhere"
    target.mkdir()
    base.symlink_to(target)
    try:
        r = start(env)
        assert r.code == 2 and str(base) in r.err and "a link" in r.err and f"remove {base}" in r.err, r.text
        assert not list(target.iterdir())
        base.unlink()  # the fix the refusal names
        r = start(env)
        assert r.code == 0, r.text
        assert stat.S_IMODE(base.stat().st_mode) == 0o700 and not base.is_symlink()
    finally:
        run_rig(env, "stop")
        if base.is_symlink():
            base.unlink()


@pytest.mark.parametrize("cards,want", [(1, "topology: TP1 x PP1 on cards 0: one card"),
                                        (2, "topology: TP2 x PP1 + EP on cards 0,1"),
                                        (4, "topology: TP2 x PP2 + EP on cards 0,1,2,3")])
def test_the_tiny_reference_shape_dry_runs_on_1_2_and_4_cards(rig_env, monkeypatch, capsys, cards, want):
    """The reference's settings on its tiny shape (models/reference-tiny.toml), on recorded box readings."""
    env = {**rig_env, "PROFILE": "reference-tiny", "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(cards)))}
    monkeypatch.setattr(box, "read_nvml", lambda: reading(cards))
    assert dry_start(env) == 0
    out = capsys.readouterr().out
    assert "profile: reference-tiny" in out and want in out, out
    assert "--kv-cache-dtype fp8" in out and '"method": "mtp", "num_speculative_tokens": 3' in out, out
    assert f'"max_cudagraph_capture_size": {4 * 4}' in out and "--max-model-len 262144" in out, out
    assert ("--enable-expert-parallel" in out) == (cards > 1), out


TINY_CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "num_experts": 8,
               "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}


def test_the_tiny_reference_shape_on_the_cpu_build_stops_before_the_engine_naming_what_it_lacks(rig_env):
    (Path(rig_env["CKPT"]) / "config.json").write_text(json.dumps(TINY_CONFIG))
    r = run_rig({**rig_env, "PROFILE": "reference-tiny", "DEVICE": "cpu"}, "start", "--no-build")
    assert r.code == 2, r.text
    assert "CPU engine: expected speculative decoding ([speculative] method 'mtp')" in r.err, r.err
    assert "spec-decode Triton kernels" in r.err and "serve reference-tiny on the CUDA build" in r.err, r.err
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()  # no engine was started


def test_following_the_cpu_engines_fix_clears_it(tmp_path):
    """The fix: a profile of one's own on the same base without [speculative]."""
    import shutil

    from rig.facts import profiles

    for name in ("reference", "reference-tiny"):
        shutil.copy(profiles.MODELS_DIR / f"{name}.toml", tmp_path)
    (tmp_path / "tiny-no-mtp.toml").write_text('base = "reference-tiny"\nspeculative = {}\n')
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_CONFIG))
    with_mtp, without = (box.cpu_engine_checks(ckpt, profiles.load(n, tmp_path)) for n in ("reference-tiny",
                                                                                         "tiny-no-mtp"))
    assert [c.name for c in with_mtp] == ["CPU engine"] and without == []


def test_the_int4_moe_needs_amx_on_the_cpu():
    from rig.base import cpuinfo

    gaps = cpuinfo.engine_gaps(TINY_CONFIG, {}, ["avx2", "avx512f"])
    assert len(gaps) == 1 and "needs AMX" in gaps[0][1] and "8 experts" in gaps[0][0]
    assert cpuinfo.engine_gaps(TINY_CONFIG, {}, ["avx512f", "amx_tile"]) == []
    assert cpuinfo.engine_gaps({"num_experts": 8}, {}, ["avx2"]) == []  # BF16 experts: vLLM's CPU MoE runs them


def test_a_profile_for_the_cpu_starts_the_cpu_build_without_device_and_a_set_device_wins_saying_so(rig_env):
    """PROFILE=demo-ple (device = "cpu") took the CUDA build unless DEVICE=cpu was set too."""
    env = {k: v for k, v in rig_env.items() if k != "DEVICE"}
    r = run_rig({**env, "PROFILE": "demo-ple"}, "start", "--dry-run", "--no-build")
    assert "DEVICE: cpu, the build profile demo-ple is for" in r.out and "; the cpu build\n" in r.out, r.text
    r = run_rig({**env, "PROFILE": "demo-ple", "DEVICE": "cuda"}, "start", "--dry-run", "--no-build")
    assert "the cuda build (DEVICE=cuda; the profile is for the cpu build" in r.out, r.text
    r = run_rig({**env, "PROFILE": "reference-tiny"}, "start", "--dry-run", "--no-build")
    assert "DEVICE: " not in r.out and "; the cuda build\n" in r.out, r.text  # the default build: nothing to say
