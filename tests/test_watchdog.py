"""The hang watchdog (rig/running/watchdog.py): the /metrics parser and the decision on samples with a fake clock (no
test sleeps for it), then the foreground supervisor and ``nox -s status`` on the engine double.

The double hangs on demand (``DOUBLE_HANG_AFTER``): it accepts requests and never answers them, the token
counter frozen, while /health and /v1/models answer. The real engine cannot be made to hang on demand, so
this one fault is the double's; everything else here runs the rig's real supervision code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import test_serve
from conftest import ROOT, run_rig

from rig.base.errors import BadInput
from rig.facts import config
from rig.running import enginerec, sdnotify, watchdog
from rig.running.watchdog import Sample, Tracker

rig_env = test_serve.rig_env  # the start path's fixture: the double as .venv/bin/vllm

# What vLLM's /metrics looks like (cut): HELP/TYPE lines, one label set per engine and model, the counter's
# _created sample, a waiting_by_reason gauge and a histogram whose names contain the ones read.
METRICS = r"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen38-flash-next"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen38-flash-next"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen38-flash-next"} 2.0
vllm:num_requests_waiting{engine="1",model_name="qwen38-flash-next"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="qwen38-flash-next",reason="capacity"} 2.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="qwen38-flash-next"} 81234.0
vllm:generation_tokens_total{engine="1",model_name="qwen38-flash-next"} 1000.0 1767225600000
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="qwen38-flash-next"} 1.7672256e+09
# HELP vllm:request_generation_tokens Number of generation tokens processed.
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_bucket{engine="0",le="1.0",model_name="qwen38-flash-next"} 10.0
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="qwen38-flash-next"} 52.0
vllm:request_generation_tokens_count{engine="0",model_name="qwen38-flash-next"} 52.0
vllm:request_generation_tokens_sum{engine="0",model_name="qwen38-flash-next"} 81234.0
vllm:kv_cache_usage_perc{engine="0",model_name="a} b \"c\""} NaN
vllm:cache_config_info{block_size="2048",cache_dtype="fp8",engine="0"} 1.0
"""


# --- the parser -------------------------------------------------------------------------------------------------

def test_parse_sums_label_sets_and_skips_comments():
    v = watchdog.parse(METRICS)
    assert v[watchdog.RUNNING] == 4.0 and v[watchdog.WAITING] == 2.0
    assert v[watchdog.TOKENS] == 82234.0  # both engines; a trailing timestamp is not the value
    assert v["vllm:num_requests_waiting_by_reason"] == 2.0  # its own name: not added to the waiting gauge
    assert v["vllm:request_generation_tokens_bucket"] == 62.0 and v["vllm:request_generation_tokens_sum"] == 81234.0
    assert "vllm:kv_cache_usage_perc" not in v  # NaN, and a label value with a brace, spaces and quotes
    assert v["vllm:cache_config_info"] == 1.0
    assert not any(k.startswith("#") or k in ("HELP", "TYPE") for k in v)
    s = watchdog.sample(v, 5.0)
    assert s == Sample(5.0, 6, 82234.0)


def test_a_missing_metric_is_no_sample_and_no_hang():
    text = "\n".join(ln for ln in METRICS.splitlines() if not ln.startswith("vllm:generation_tokens_total"))
    got = watchdog.sample(watchdog.parse(text), 1.0)
    assert isinstance(got, str) and "vllm:generation_tokens_total" in got
    assert isinstance(watchdog.sample({}, 1.0), str)


# --- the decision, over sequences of samples ------------------------------------------------------------------

def run(window: int, samples: list[tuple[float, int, float]]) -> list[watchdog.Verdict]:
    t = Tracker(window)
    return [t.observe(Sample(*s)) for s in samples]


def states(verdicts: list[watchdog.Verdict]) -> list[str]:
    return [v.state for v in verdicts]


def test_idle_engine_is_never_hung():
    v = run(10, [(0, 0, 100), (5, 0, 100), (500, 0, 100), (5000, 0, 100)])
    assert states(v) == ["idle"] * 4 and not any(x.hung for x in v)
    assert v[-1].line().startswith("idle (no request pending; 100 tokens")


def test_generating_and_pending_but_progressing():
    v = run(10, [(0, 2, 100), (5, 2, 140), (10, 4, 150), (15, 4, 151), (20, 3, 400), (25, 0, 420)])
    assert states(v) == ["unknown", "generating", "generating", "generating", "generating", "idle"]
    assert v[3].progress == 15 and v[3].line().startswith("generating (4 requests pending, 151 tokens")


def test_pending_and_frozen_past_the_window_is_hung():
    v = run(10, [(0, 0, 100), (5, 3, 100), (10, 3, 100), (14, 3, 100), (15, 3, 100), (20, 3, 100)])
    assert states(v) == ["idle", "unknown", "stalled", "stalled", "hung", "hung"]
    # quiet from the first sample that saw them pending (5), not from the last token: never called early
    assert v[4].stall == 5 and v[4].quiet == 10 and v[5].quiet == 15
    assert v[2].line().startswith("no tokens for 5 s with 3 requests pending (window 10 s; none since")
    assert v[5].line().startswith("hung: no tokens for 15 s with 3 requests pending (window 10 s")
    assert v[5].line().endswith(f"hung since {watchdog._hms(15)})")


def test_a_request_after_a_long_idle_time_is_not_a_hang_at_once():
    v = run(10, [(0, 0, 100), (3600, 1, 100), (3605, 1, 101)])
    assert states(v) == ["idle", "unknown", "generating"]


def test_one_token_resets_the_stall():
    v = run(10, [(0, 2, 100), (8, 2, 100), (9, 2, 101), (18, 2, 101), (19, 2, 101), (20, 2, 101)])
    assert states(v) == ["unknown", "stalled", "generating", "stalled", "hung", "hung"]
    assert v[4].stall == 9


def test_requests_gone_ends_the_stall():
    v = run(10, [(0, 2, 100), (8, 2, 100), (9, 0, 100), (10, 2, 100), (19, 2, 100), (20, 2, 100)])
    assert states(v) == ["unknown", "stalled", "idle", "unknown", "stalled", "hung"]


def test_window_0_never_calls_a_hang():
    v = run(0, [(0, 3, 100), (100, 3, 100), (100_000, 3, 100)])
    assert states(v) == ["unknown", "stalled", "stalled"] and not any(x.hung for x in v)
    assert "HANG_WINDOW=0" in v[-1].line()


def test_a_counter_that_goes_back_is_a_new_engine():
    v = run(10, [(0, 2, 500), (8, 2, 500), (9, 2, 3), (18, 2, 3)])
    assert states(v) == ["unknown", "stalled", "unknown", "stalled"] and v[2].progress == 9


def test_the_sampling_interval():
    assert watchdog.interval(300) == 5.0 and watchdog.interval(20) == 2.0 and watchdog.interval(2) == 0.5


# --- the supervisor's thread and status, with a fake /metrics and a fake clock -------------------------------------

class FakeEngine:
    """A /metrics whose numbers the test sets, and a clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.pending, self.tokens = 0, 10.0
        self.up = True
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def get(self, host: str, port: int) -> str:
        self.calls += 1
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        return (f'vllm:num_requests_running{{engine="0"}} {self.pending}\nvllm:num_requests_waiting{{engine="0"}} 0\n'
                f'vllm:generation_tokens_total{{engine="0"}} {self.tokens}\n')


def test_the_watcher_calls_a_hang_once_and_saves_what_it_saw(tmp_path):
    eng, hangs, said = FakeEngine(), [], []
    w = watchdog.Watcher("127.0.0.1", 1, 10, tmp_path, "42@1.000", hangs.append, clock=eng.clock, get=eng.get,
                         say=said.append)
    assert w.poll().state == "idle"
    eng.up = False
    eng.now += 5
    assert "did not answer" in w.poll() and not hangs  # no sample is not a hang
    assert "a missing sample is not a hang" in said[0]
    eng.up, eng.pending = True, 2
    for _ in range(3):
        eng.now += 5
        w.poll()
    assert len(hangs) == 1 and hangs[0].hung and hangs[0].quiet == 10 and hangs[0].pending == 2
    eng.now += 5
    w.poll()
    assert len(hangs) == 1  # called once
    saved = watchdog.load(tmp_path, "42@1.000")
    assert saved.by == "supervisor" and saved.tracker.stall == hangs[0].stall and saved.checked == eng.now
    assert watchdog.load(tmp_path, "43@2.000") is None  # another engine's samples are not this one's


def test_a_stop_in_progress_is_not_called_a_hang(tmp_path):
    import threading

    eng, hangs, stopping = FakeEngine(), [], threading.Event()
    w = watchdog.Watcher("127.0.0.1", 1, 10, tmp_path, "e", hangs.append, stopping, clock=eng.clock, get=eng.get,
                         say=lambda _: None)
    eng.pending = 2
    w.poll()
    stopping.set()  # SIGTERM: the engine drains, requests still pending, no tokens
    eng.now += 60
    assert w.poll().hung and not hangs


def test_status_of_a_detached_engine_compares_with_the_last_sample_saved(tmp_path):
    """Nobody samples a detached engine: two status calls a window apart see the hang, one does not."""
    eng = FakeEngine()
    eng.pending = 3

    def look() -> watchdog.Look:
        return watchdog.Look(tmp_path, "7@1.000", "127.0.0.1", 1, 300, 0, clock=eng.clock, get=eng.get).take()

    first = look()
    assert first.verdict.state == "unknown" and not first.hung
    assert "the first sample of this engine" in first.line() and "3 requests pending" in first.line()
    eng.now += 42
    second = look()
    assert second.verdict.state == "stalled" and not second.hung
    assert second.line().startswith("no tokens for 42 s with 3 requests pending (window 300 s")
    assert "this sample against the one status saved 42 s ago" in second.line()
    eng.now += 300
    third = look()
    assert third.hung and third.line().startswith("hung: no tokens for 342 s with 3 requests pending")
    eng.tokens += 1
    eng.now += 5
    assert look().verdict.state == "generating"


def test_status_reads_a_fresh_supervisor_state_and_samples_itself_when_it_is_stale(tmp_path):
    eng = FakeEngine()
    eng.pending = 1
    w = watchdog.Watcher("127.0.0.1", 1, 20, tmp_path, "e", lambda v: None, clock=eng.clock, get=eng.get,
                         say=lambda _: None)
    w.poll()
    eng.now += 2
    w.poll()
    calls = eng.calls
    fresh = watchdog.Look(tmp_path, "e", "127.0.0.1", 1, 300, 555, clock=eng.clock, get=eng.get).take()
    assert eng.calls == calls  # read, not sampled
    assert fresh.verdict.state == "stalled" and "window 20 s" in fresh.line()  # the supervisor's window
    assert "the supervisor (pid 555) samples /metrics every 2 s, the last 0 s ago" in fresh.line()
    eng.now += 60  # the supervisor stopped sampling (killed, or HANG_WINDOW=0)
    stale = watchdog.Look(tmp_path, "e", "127.0.0.1", 1, 30, 555, clock=eng.clock, get=eng.get).take()
    assert eng.calls == calls + 1 and stale.hung and "saved no recent sample" in stale.line()


def test_status_with_the_watchdog_off_says_so(tmp_path):
    eng = FakeEngine()
    off = watchdog.Look(tmp_path, "e", "127.0.0.1", 1, 0, 0, clock=eng.clock, get=eng.get).take()
    assert off.line() == "off (HANG_WINDOW=0)" and not off.hung and eng.calls == 0


# --- the variable, the pid file, the notify socket ------------------------------------------------------------------

def test_hang_window_variable():
    assert config.serve_settings({}).hang_window == 300
    assert config.serve_settings({"HANG_WINDOW": "0"}).hang_window == 0
    with pytest.raises(BadInput) as e:
        config.serve_settings({"HANG_WINDOW": "5m"})
    assert "HANG_WINDOW: expected a whole number >= 0 (0 turns it off), found '5m'" in e.value.message
    assert "Fix:" in e.value.message


def test_pid_files_of_older_and_newer_rigs_still_load(tmp_path):
    s = config.settings({"RIG_STATE": str(tmp_path)})
    me = psutil.Process()
    old = (f'pid = {me.pid}\npgid = {os.getpgid(0)}\ncreate_time = {me.create_time()}\nstarted = 1.0\n'
           'host = "127.0.0.1"\nport = 8000\nmodel = "m"\nlog = ""\n')
    enginerec.pid_path(s).write_text(old)  # before the hang field (and before supervisor, ckpt, ...)
    rec = enginerec.load(s)
    assert rec and rec.pid == me.pid and rec.hang == ""
    enginerec.pid_path(s).write_text(old + 'hang = "x"\nsomething_newer = 1\n')
    rec = enginerec.load(s)
    assert rec and rec.hang == "x" and enginerec.pid_path(s).exists()  # an unknown field is not a stale file


@pytest.mark.parametrize("abstract", [True, False])
def test_notify_sends_one_datagram_to_the_socket(tmp_path, abstract):
    addr = f"@rig-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + addr[1:] if abstract else addr)
        sock.settimeout(5)
        assert sdnotify.notify("READY=1", "STATUS=ready", env={"NOTIFY_SOCKET": addr})
        assert sock.recv(4096) == b"READY=1\nSTATUS=ready"
    assert not sdnotify.notify("READY=1", env={})
    assert sdnotify.engine_env({"NOTIFY_SOCKET": addr, "A": "1"}) == {"A": "1"}


# --- on the engine double -------------------------------------------------------------------------------------------

def pend(port: int, n: int) -> list[socket.socket]:
    """``n`` chat completions sent and left waiting (the caller closes them)."""
    body = json.dumps({"model": "qwen38-flash-next", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 64}).encode()
    out = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        out.append(c)
    return out


def pending(port: int) -> int:
    got = watchdog.probe("127.0.0.1", port)
    return -1 if isinstance(got, str) else got.pending


def wait_until(cond, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def engine_left(ckpt: str) -> list[str]:
    """Processes of the double still running: the server, or its VLLM::EngineCore-like child."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ckpt in cmd and ("VLLM::" in cmd or "engine_double.py" in cmd):
            left.append(f"{p.pid} {cmd}")
    return left


def test_the_double_serves_vllm_metrics(rig_env):
    assert test_serve.start(rig_env).code == 0
    port = int(rig_env["PORT"])
    got = watchdog.probe("127.0.0.1", port)
    assert isinstance(got, Sample) and got.pending == 0 and got.tokens == 1  # the start's one-token check


def test_the_foreground_supervisor_ends_a_hung_engine_and_exits_1(rig_env):
    """The double hangs after the start's one-token check (the real engine cannot hang on demand); its child
    ignores SIGTERM like EngineCore, so ending the group needs the SIGKILL after STOP_TIMEOUT."""
    env = {**rig_env, "HANG_WINDOW": "2", "DOUBLE_HANG_AFTER": "1", "DOUBLE_CHILD": "1", "STOP_TIMEOUT": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "rig.cli", "start", "--no-build", "--skip-box-check",
                             "--foreground"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    held = []
    try:
        test_serve._wait_for(proc, "ready in")
        rec = test_serve.record(env)
        held = pend(int(env["PORT"]), 2)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for c in held:
            c.close()
    assert proc.returncode == 1, out
    assert "error: the engine: expected a token within HANG_WINDOW=2 s while requests are pending" in out
    assert "found 2 request(s) pending and no token for" in out and "engine stopped by the hang watchdog" in out
    assert not enginerec.group_members(rec["pgid"]) and not engine_left(env["CKPT"])
    assert not (Path(env["RIG_STATE"]) / "engine.toml").exists()
    assert "hang watchdog: hung: no tokens for" in Path(env["LOG"]).read_text()
    assert run_rig(env, "status").code == 3


def test_status_reads_the_supervisor_and_a_sigterm_stop_still_exits_0(rig_env):
    env = {**rig_env, "HANG_WINDOW": "20"}  # a sample every 2 s
    proc = subprocess.Popen([sys.executable, "-m", "rig.cli", "start", "--no-build", "--skip-box-check",
                             "--foreground"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        test_serve._wait_for(proc, "ready in")
        wait_until(lambda: (watchdog.state_path(Path(env["RIG_STATE"]))).exists())
        st = run_rig(env, "status")
        assert st.code == 0, st.text
        assert "watchdog: idle (no request pending; 1 tokens generated so far, the last by " in st.out
        assert f"; the supervisor (pid {proc.pid}) samples /metrics every 2 s, the last " in st.out
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "engine stopped" in out and "hang" not in out


def test_status_sees_a_detached_engine_hang_in_two_calls(rig_env):
    """The double hangs after two answers (the real engine cannot hang on demand). The first status after the
    hang waits its one-token check out (the window, 2 s) and sees the hang across it; the second compares
    with the sample the first saved and does not send a request that would only hang too."""
    env = {**rig_env, "HANG_WINDOW": "2", "DOUBLE_HANG_AFTER": "2"}  # the start's check and status's first
    assert test_serve.start(env).code == 0
    port = int(env["PORT"])
    ok = run_rig(env, "status")
    assert ok.code == 0 and "watchdog: idle" in ok.out and "nobody samples a detached engine" in ok.out, ok.text
    held = pend(port, 2)
    try:
        wait_until(lambda: pending(port) == 2)
        first = run_rig(env, "status")
        assert first.code == 1, first.text
        assert "health: FAILING" in first.out  # its one-token check waited the window (2 s) in vain
        t0 = time.monotonic()
        second = run_rig(env, "status")
        took = time.monotonic() - t0
    finally:
        for c in held:
            c.close()
    assert second.code == 1, second.text
    assert "watchdog: hung: no tokens for" in second.out and "with 3 requests pending (window 2 s" in second.out
    assert "this sample against the one status saved" in second.out
    assert "health: not checked" in second.out and took < 10  # no second wait on a hung engine
    assert "error: the engine is hung" in second.err
    assert run_rig(env, "stop").code == 0
