"""The free-GPU gate (rig/running/gpugate.py) on recorded NVML readings, with a fake clock: no test sleeps for real."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import psutil
import pytest
import test_serve
from conftest import ROOT, run_rig

from rig.base.errors import BadInput, WorkFailed
from rig.control import start as starting
from rig.facts import config, slots
from rig.plan import box
from rig.running import gpugate, supervise

rig_env, roomy = test_serve.rig_env, test_serve.roomy  # the start path's fixtures

GIB = 2**30
REFERENCE = ROOT.parent / "shared" / "reference" / "nvml-h200.json"
# The recorded one-H200 reading (its shape and values), for a checkout without shared/reference.
RECORDED = {"driver": "580.159.04", "cuda_driver": 13000, "devices": [{
    "index": 0, "name": "NVIDIA H200", "pci_bus_id": "00000000:00:06.0", "memory_total": 150754820096,
    "memory_used": 644939776, "memory_free": 150109880320, "compute_capability": [9, 0], "pcie_gen_cur": 5,
    "pcie_gen_max": 5, "pcie_width_cur": 16, "pcie_width_max": 16, "power_limit_mw": 700000,
    "enforced_power_limit_mw": 700000, "compute_processes": []}]}
H200 = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else RECORDED
GONE = 4_000_000_000  # a pid no PID namespace here has: like the host pid of another container's process
ME = os.getpid()
MY_NAME = psutil.Process(ME).name()


def h200s(n: int = 4, changes: dict | None = None) -> box.Reading:
    """``n`` recorded H200s; ``changes`` maps a card to the fields that differ (memory_used in GiB as a float)."""
    data = copy.deepcopy(H200)
    dev = data["devices"][0]
    data["devices"] = []
    for i in range(n):
        d = {**dev, "index": i, "pci_bus_id": f"00000000:{i + 6:02x}:00.0"}
        d.update((changes or {}).get(i, {}))
        if isinstance(d["memory_used"], float):
            d["memory_used"] = int(d["memory_used"] * GIB)
        data["devices"].append(d)
    return box.reading_from_json(data)


def busy_card(*pids: int, each: float | None = 20.0) -> dict:
    """A card an engine holds: its processes (each ``each`` GiB; None: NVML does not say) and 0.6 GiB more."""
    procs = [{"pid": p, "used_gpu_memory": None if each is None else int(each * GIB)} for p in pids]
    return {"compute_processes": procs, "memory_used": 0.6 + (each or 20.0) * len(pids)}


class Clock:
    """A monotonic clock that only sleep() moves."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s > 0
        self.t += s
        self.slept += s


class Reader:
    """NVML as a schedule: ``schedule(seconds since the first read)`` is what the cards show then."""

    def __init__(self, clock: Clock, schedule) -> None:
        self.clock, self.schedule, self.reads, self.t0 = clock, schedule, 0, clock()

    def __call__(self) -> box.Reading:
        self.reads += 1
        return self.schedule(self.clock() - self.t0)


def gate(schedule, cards=(0, 1, 2, 3), timeout=60.0):
    clock = Clock()
    read = Reader(clock, schedule)
    waited = gpugate.wait_free(read, list(cards), timeout, clock=clock, sleep=clock.sleep)
    return waited, read, clock


def lines(capsys) -> list[str]:
    return [ln.strip() for ln in capsys.readouterr().out.splitlines()]


def test_free_cards_cost_one_read_and_one_short_line(capsys):
    waited, read, clock = gate(lambda t: h200s())
    out = lines(capsys)
    assert waited == 0.0 and read.reads == 1 and clock.slept == 0
    assert out == ["GPUs: cards 0, 1, 2, 3 free (0.6 GiB used at most)"]


def test_busy_then_free_within_the_window_prints_progress_and_succeeds(capsys):
    waited, read, clock = gate(lambda t: h200s(4, {1: busy_card(ME)} if t < 12 else {}))
    out = lines(capsys)
    assert out[0] == (f"waiting up to GPU_WAIT=60 s for card 1 to be free: 1 compute process (pid {ME} {MY_NAME}, "
                      "20.0 GiB), 20.6 GiB used of 140.4 GiB")
    progress = [ln for ln in out if ln.startswith("still waiting")]
    assert [ln.split(")")[0] for ln in progress] == ["still waiting (5 s of 60", "still waiting (10 s of 60"]
    assert out[-1] == "GPUs: card 1 free after 12.0 s" and len(out) == 4
    assert waited == 12.0 and read.reads == 13 and clock.slept == 12.0


def test_still_busy_at_the_deadline_fails_naming_pid_name_and_memory(capsys):
    with pytest.raises(WorkFailed) as e:
        gate(lambda t: h200s(4, {2: busy_card(ME, GONE, each=10.0)}), timeout=30)
    msg = e.value.message
    assert e.value.code == 1 and "\n" not in msg
    assert msg.startswith("card 2: expected free within GPU_WAIT=30 s (no compute process, at most 2 GiB used)")
    assert (f"found 2 compute processes (pid {ME} {MY_NAME}, 10.0 GiB; pid {GONE}, not in this PID namespace, "
            "10.0 GiB), 20.6 GiB used of 140.4 GiB") in msg
    assert "Fix: stop what holds the card" in msg and "GPU_WAIT=0 to start anyway" in msg
    assert "still being released" not in msg  # a process is listed: no memory-lag hint
    out = lines(capsys)
    assert len([ln for ln in out if ln.startswith("still waiting")]) == 6 and "free after" not in "".join(out)


def test_per_process_memory_unknown_to_nvml_is_left_out_and_several_cards_are_named(capsys):
    with pytest.raises(WorkFailed) as e:
        gate(lambda t: h200s(4, {0: busy_card(GONE, each=None), 3: busy_card(ME)}), timeout=5)
    msg = e.value.message
    assert msg.startswith("cards 0, 3: expected")
    assert f"card 0: 1 compute process (pid {GONE}, not in this PID namespace), 20.6 GiB used" in msg
    assert f"card 3: 1 compute process (pid {ME} {MY_NAME}, 20.0 GiB)" in msg


def test_memory_high_with_no_process_listed_waits_for_the_release(capsys):
    waited, read, clock = gate(lambda t: h200s(4, {0: {"memory_used": 30.0}} if t < 7 else {}))
    out = lines(capsys)
    assert out[0].endswith("for card 0 to be free: no compute process, 30.0 GiB used of 140.4 GiB")
    assert out[-1] == "GPUs: card 0 free after 7.0 s" and waited == 7.0


def test_memory_that_is_never_released_fails_with_the_lag_hint(capsys):
    with pytest.raises(WorkFailed) as e:
        gate(lambda t: h200s(4, {1: {"memory_used": 30.0}}), timeout=10)
    assert "found no compute process, 30.0 GiB used of 140.4 GiB (memory without a listed process" in e.value.message


def test_a_little_memory_in_use_is_an_idle_card(capsys):
    """The driver's reservation and a display server stay under IDLE_USED: no wait for them."""
    waited, read, _ = gate(lambda t: h200s(4, {0: {"memory_used": 1.9}}))
    assert waited == 0.0 and read.reads == 1 and gpugate.IDLE_USED == 2 * GIB


def test_cards_not_chosen_are_ignored(capsys):
    reading = h200s(4, {0: busy_card(ME), 2: {"memory_used": 50.0}})
    assert box.positions(reading, "1,3") == [1, 3] and box.positions(reading, "") == [0, 1, 2, 3]
    waited, read, _ = gate(lambda t: reading, cards=[1, 3])
    assert waited == 0.0 and read.reads == 1
    assert lines(capsys) == ["GPUs: cards 1, 3 free (0.6 GiB used at most)"]
    with pytest.raises(WorkFailed, match=r"^card 0: "):  # the same reading, card 0 chosen: it is waited for
        gate(lambda t: reading, cards=[0, 1], timeout=1)


def test_zero_timeout_checks_once_and_fails_at_once(capsys):
    with pytest.raises(WorkFailed, match="GPU_WAIT=0 s"):
        gate(lambda t: h200s(1, {0: busy_card(ME)}), cards=[0], timeout=0)


def test_nvml_process_records_give_per_process_memory():
    r = h200s(1, {0: {"compute_processes": [{"pid": 7, "used_gpu_memory": 5 * GIB}, {"pid": 8,
                                                                                    "used_gpu_memory": None}, 9]}})
    g = r.gpus[0]
    assert g.compute_processes == [7, 8, 9] and g.process_memory == {7: 5 * GIB}
    plain = h200s(1, {0: {"compute_processes": [4242]}}).gpus[0]
    assert plain.compute_processes == [4242] and plain.process_memory == {}
    assert box.reading_from_json(H200).gpus[0].process_memory == {}


@pytest.mark.parametrize("value", ["soon", "-5", "1.5"])
def test_bad_gpu_wait_is_bad_input_naming_the_variable(value):
    with pytest.raises(BadInput) as e:
        config.serve_settings({"GPU_WAIT": value})
    assert e.value.code == 2
    assert f"GPU_WAIT: expected a whole number >= 0 (0 turns it off), found {value!r}" in e.value.message
    assert "Fix: set GPU_WAIT=60 or unset it" in e.value.message


def test_gpu_wait_default_and_off():
    assert config.serve_settings({}).gpu_wait == 60 and config.serve_settings({"GPU_WAIT": "0"}).gpu_wait == 0


def test_bad_gpu_wait_exits_2_from_the_command_line(rig_env):
    r = run_rig({**rig_env, "GPU_WAIT": "a minute"}, "start", "--dry-run", "--no-build", "--skip-box-check")
    assert r.code == 2, r.text
    assert "GPU_WAIT: expected a whole number >= 0" in r.err and "'a minute'" in r.err and "command:" not in r.out


# --- the gate on the start path (rig/control/start.py), with read_nvml and the clock replaced ----------------------

@pytest.fixture
def fake_gate(monkeypatch):
    """The real gate with a fake clock; the engine's start replaced by a recorder."""
    clock, started, real = Clock(), [], gpugate.wait_free
    monkeypatch.setattr(gpugate, "wait_free", lambda read, cards, timeout: real(read, cards, timeout, clock=clock,
                                                                                sleep=clock.sleep))
    monkeypatch.setattr(supervise, "start", lambda launch: started.append(launch) or 0)
    return clock, started


def serve_start(env, monkeypatch, reading, *, box_check=False, dry_run=False) -> int:
    monkeypatch.setattr(box, "read_nvml", reading if callable(reading) else lambda: reading)
    return starting.run(slots.settings(env), env, foreground=True, dry_run=dry_run, build=False, box_check=box_check,
                        clear_cache=False)


def test_start_waits_before_the_engine_and_fails_naming_the_process(rig_env, monkeypatch, capsys, fake_gate):
    """--skip-box-check still gates: the gate protects the KV cache size, not the box's shape."""
    clock, started = fake_gate
    with pytest.raises(WorkFailed) as e:
        serve_start({**rig_env, "GPU_WAIT": "20"}, monkeypatch, h200s(4, {1: busy_card(ME)}))
    assert f"pid {ME} {MY_NAME}, 20.0 GiB" in e.value.message and "GPU_WAIT=20 s" in e.value.message
    assert started == [] and clock.slept == 20.0  # no engine was started


def test_start_after_the_release_starts_the_engine(rig_env, monkeypatch, capsys, fake_gate):
    clock, started = fake_gate
    t0 = clock()
    assert serve_start(rig_env, monkeypatch, lambda: h200s(4, {0: busy_card(ME)} if clock() - t0 < 3 else {})) == 0
    out = capsys.readouterr().out
    assert len(started) == 1 and "GPUs: card 0 free after 3.0 s" in out


def test_gpu_wait_0_turns_the_gate_off(rig_env, monkeypatch, capsys, fake_gate):
    clock, started = fake_gate
    assert serve_start({**rig_env, "GPU_WAIT": "0"}, monkeypatch, h200s(4, {1: busy_card(ME)})) == 0
    assert len(started) == 1 and clock.slept == 0
    assert "GPU gate: off (GPU_WAIT=0)" in capsys.readouterr().out


def test_the_cpu_build_reads_no_gpu(rig_env, monkeypatch, capsys, fake_gate):
    def no_nvml():
        raise AssertionError("the CPU build read NVML")

    _, started = fake_gate
    assert serve_start({**rig_env, "DEVICE": "cpu"}, monkeypatch, no_nvml) == 0
    assert len(started) == 1 and "GPU" not in capsys.readouterr().out


def test_a_busy_card_warns_in_the_box_check_and_a_dry_run_shows_the_cards_in_one_line(rig_env, monkeypatch, capsys,
                                                                                     roomy, fake_gate):
    clock, started = fake_gate
    busy = h200s(4, {1: busy_card(GONE)})
    assert serve_start(rig_env, monkeypatch, busy, box_check=True, dry_run=True) == 0
    cap = capsys.readouterr()
    assert "warn  GPU 1 free: expected no compute process, found pids" in cap.err and "GPU_WAIT=60 s" in cap.err
    gate_lines = [ln for ln in cap.out.splitlines() if "GPU gate" in ln]
    assert gate_lines == [f"      GPU gate: card 1 busy (1 compute process (pid {GONE}, not in this PID namespace, "
                          "20.0 GiB), 20.6 GiB used of 140.4 GiB); a real start waits up to GPU_WAIT=60 s"]
    assert started == [] and clock.slept == 0 and not Path(rig_env["DOUBLE_RECORD"]).exists()


def test_with_the_gate_off_a_busy_card_fails_the_box_check_as_before(rig_env, monkeypatch, capsys, roomy):
    with pytest.raises(BadInput) as e:
        serve_start({**rig_env, "GPU_WAIT": "0"}, monkeypatch, h200s(4, {1: busy_card(ME)}), box_check=True)
    assert e.value.code == 2 and "1 of" in e.value.message
    assert "fail  GPU 1 free: expected no compute process" in capsys.readouterr().err
