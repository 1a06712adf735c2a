"""Which build is current (rig/facts/slots.py): the pointer file the front doors read once; the settings alone
are a pure function of the environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_rig

from rig.base.errors import BadInput
from rig.facts import config, record, slots


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"RIG_STATE": str(tmp_path / "state"), "DEVICE": "cpu", **extra}


def test_without_a_pointer_the_variables_paths_hold(tmp_path):
    s = config.settings(env_for(tmp_path))
    assert s.vllm_dir.name == "vllm-cpu" and s.slot_dir is None and s.record_dir == tmp_path / "state"


def test_a_switch_moves_every_path_and_the_record_and_names_the_previous_build(tmp_path):
    s = config.settings(env_for(tmp_path))
    own = slots.own(s.vllm_dir, s.venv_dir, s.artifacts_dir, s.state_dir)
    new = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    new.venv_dir.mkdir()
    assert new.record_dir.is_dir() and new.record_dir.parent == (tmp_path / "state" / slots.FOLDER).resolve()
    slots.write(s.state_dir, "cpu", new, own)
    t = slots.settings(env_for(tmp_path))
    assert (t.vllm_dir, t.venv_dir, t.artifacts_dir) == (new.vllm_dir, new.venv_dir, new.artifacts_dir)
    assert config.settings(env_for(tmp_path)) == s  # the environment's settings alone never read the pointer
    assert t.record_dir == new.record_dir and record.path(t.record_dir, "cpu").parent == new.record_dir
    assert slots.read(s.state_dir, "cpu") == (new, own)
    assert slots.settings(env_for(tmp_path, DEVICE="cuda")).slot_dir is None  # one pointer per device
    slots.write(s.state_dir, "cpu", own, new)  # back: the checkout's own paths, its record in RIG_STATE
    back = slots.settings(env_for(tmp_path))
    assert back.vllm_dir == s.vllm_dir and back.record_dir == s.state_dir


def test_paths_the_user_names_win_over_the_pointer(tmp_path):
    s = config.settings(env_for(tmp_path))
    new = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    slots.write(s.state_dir, "cpu", new, None)
    t = slots.settings(env_for(tmp_path, VLLM_DIR=str(tmp_path / "mine")))
    assert t.vllm_dir == tmp_path / "mine" and t.slot_dir is None and t.venv_dir == s.venv_dir


@pytest.mark.parametrize("text", ["{not json", '{"current": {"name": "x"}}'])
def test_a_damaged_pointer_is_named_with_the_fix(tmp_path, text):
    state = tmp_path / "state"
    state.mkdir()
    slots.pointer(state, "cpu").write_text(text)
    assert config.settings(env_for(tmp_path)).slot_dir is None  # read by the front doors only
    with pytest.raises(BadInput) as e:
        slots.settings(env_for(tmp_path))
    assert str(slots.pointer(state, "cpu")) in e.value.message and "remove the file" in e.value.message
    slots.pointer(state, "cpu").unlink()  # the fix
    assert slots.settings(env_for(tmp_path)).slot_dir is None


def test_prune_keeps_the_named_builds_of_its_device_and_nothing_else_is_touched(tmp_path):
    state = tmp_path / "state"
    a, b, c = (slots.new(state, "cpu", "v", "e", "a") for _ in range(3))
    other = slots.new(state, "cuda", "v", "e", "a")
    (c.record_dir / "v").mkdir()
    (c.record_dir / "v" / "f").write_text("x")
    own = slots.own(tmp_path / "vllm", tmp_path / ".venv", tmp_path / "artifacts", state)
    (tmp_path / "vllm").mkdir()
    assert len({a.name, b.name, c.name}) == 3
    assert slots.prune(state, "cpu", [a, own]) == sorted([b.name, c.name])
    assert a.record_dir.is_dir() and other.record_dir.is_dir() and (tmp_path / "vllm").is_dir()
    assert not b.record_dir.exists() and not c.record_dir.exists()


def test_disk_counts_a_hard_linked_file_once(tmp_path):
    s = slots.new(tmp_path, "cpu", "v", "e", "a")
    for d in (s.vllm_dir, s.venv_dir):
        d.mkdir()
    (s.vllm_dir / "f").write_bytes(os.urandom(1 << 20))
    os.link(s.vllm_dir / "f", s.venv_dir / "f")
    (s.venv_dir / "g").write_bytes(os.urandom(1 << 20))
    total, shared = slots.disk(s)
    assert 2 << 20 <= total < 3 << 20 and 1 << 20 <= shared < 2 << 20


def test_rollback_with_no_update_behind_it_and_update_with_named_paths_exit_2(tmp_path, rig_env):
    env = {k: v for k, v in rig_env.items() if k not in slots.VARIABLES}
    r = run_rig({**env, "DEVICE": "cpu"}, "rollback")
    assert r.code == 2 and "no update has switched builds yet" in r.err, r.err
    r = run_rig({**rig_env, "DEVICE": "cpu"}, "update")
    assert r.code == 2 and "unset VLLM_DIR" in r.err, r.err  # rig_env names the tree's path


def test_an_update_across_nodes_is_refused_naming_the_way(tmp_path, rig_env):
    env = {k: v for k, v in rig_env.items() if k not in slots.VARIABLES}
    r = run_rig({**env, "NODES": "2", "NODE_RANK": "0", "HEAD_ADDR": "127.0.0.1", "NODES_SECRET": "s" * 32},
                "update")
    assert r.code == 2 and "NODES" in r.err and "./build.sh on every node" in r.err, r.err


def test_the_units_pre_start_build_serves_a_switched_build_as_built(tmp_path, rig_env):
    """``./build.sh --pre-start`` (the unit's ExecStartPre) after an update or rollback switched builds: the
    checkout's series differs from the build switched to, and the start must serve that build, not rebuild it in
    place (a restart after a rollback would undo it). Without a switch it is a plain build."""
    env = {k: v for k, v in rig_env.items() if k not in slots.VARIABLES}
    s = config.settings(env)
    new = slots.new(s.state_dir, s.device, "vllm", ".venv", "artifacts")
    new.venv_dir.mkdir()
    slots.write(s.state_dir, s.device, new, slots.own(s.vllm_dir, s.venv_dir, s.artifacts_dir, s.state_dir))
    r = run_rig(env, "build", "--pre-start")
    assert r.code == 0, r.text
    assert f"pre-start: slot {new.name} is the build an update or rollback switched to" in r.out, r.out
    assert "served as built. The checkout differs from it (step " in r.out and "update builds that beside it" in r.out
    assert not new.vllm_dir.exists() and "[1/8]" not in r.out  # nothing built
    r = run_rig(rig_env, "build", "--pre-start", "--only", "tools")  # the paths named: no switch applies
    assert r.code == 0 and "pre-start:" not in r.out and "[1/8] tools" in r.out, r.text


def ok_entry(slot: slots.Slot) -> dict[str, str]:
    return {k: str(getattr(slot, k)) for k in slots.FIELDS}


@pytest.mark.parametrize("case", ["a list", "current a string", "a number for a name", "a list for a path",
                                  "previous a string", "a venv outside the slot", "a name that climbs"])
def test_a_pointer_of_the_wrong_shape_or_outside_the_slots_is_refused_and_removing_it_clears_it(tmp_path, case):
    """Valid JSON of the wrong shape gave a traceback, and folders outside RIG_STATE/slots were followed (a start
    would have run another venv's vllm): each is exit 2 naming the file, and the fix it names clears it."""
    env = env_for(tmp_path)
    s = config.settings(env)
    good = ok_entry(slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu"))
    data = {"a list": [good], "current a string": {"current": "cpu-1"},
            "a number for a name": {"current": {**good, "name": 5}},
            "a list for a path": {"current": {**good, "vllm_dir": ["x"]}},
            "previous a string": {"current": good, "previous": "cpu-0"},
            "a venv outside the slot": {"current": {**good, "venv_dir": "/usr"}},
            "a name that climbs": {"current": {**good, "name": ".."}}}[case]
    slots.pointer(s.state_dir, "cpu").write_text(json.dumps(data))
    with pytest.raises(BadInput) as e:
        slots.settings(env)
    assert str(slots.pointer(s.state_dir, "cpu")) in e.value.message and "remove the file" in e.value.message
    slots.pointer(s.state_dir, "cpu").unlink()
    assert slots.settings(env) == s


def test_a_current_slot_whose_venv_is_gone_is_refused_and_rollback_clears_it(tmp_path):
    """It passed --pre-start and failed at the spawn with ENOENT; now exit 2 naming the folder, and the fix it
    names (nox -s rollback) works without a venv to stop or start from."""
    from rig.control import update

    env = env_for(tmp_path)
    s = config.settings(env)
    gone = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    older = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    (older.venv_dir / "bin").mkdir(parents=True)
    (older.venv_dir / "bin" / "python").write_text("")
    slots.write(s.state_dir, "cpu", gone, older)
    with pytest.raises(BadInput) as e:
        slots.settings(env)
    assert str(gone.venv_dir) in e.value.message and "nox -s rollback" in e.value.message
    idle = update.Engine(running=lambda: False, stop=lambda: None, start=lambda: None)
    assert update.rollback(env, idle) == 0
    assert slots.settings(env).venv_dir == older.venv_dir


def test_stop_works_from_the_engines_record_alone_with_a_damaged_pointer(tmp_path, rig_env):
    """`nox -s stop` (the unit's ExecStop) exited 2 on a damaged pointer; it reads the engine's record only."""
    env = {**{k: v for k, v in rig_env.items() if k not in slots.VARIABLES}, "DEVICE": "cpu"}
    state = Path(env["RIG_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    slots.pointer(state, "cpu").write_text("[not a pointer")
    r = run_rig(env, "stop")
    assert r.code == 0 and "nothing to stop" in r.out, r.text
    assert run_rig(env, "status").code == 2  # what reads the build still names the damage


def test_an_update_prunes_nothing_before_its_switch(tmp_path, monkeypatch):
    """After the pointer was removed (its fix), the next update deleted the slot that had been serving before it
    did anything else. Nothing is pruned until a switch succeeds: here the build is current, nothing switches,
    and every slot is still there."""
    from rig.control import update

    env = env_for(tmp_path)
    s = config.settings(env)
    serving = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")  # no pointer names it
    monkeypatch.setattr(update.pipeline, "first_stale", lambda *a, **k: None)
    idle = update.Engine(running=lambda: False, stop=lambda: None, start=lambda: None)
    assert update.update(env, idle) == 0
    assert serving.record_dir.is_dir()


def test_a_previous_build_whose_venv_is_gone_is_refused_and_its_fix_gives_a_rollback_again(tmp_path, monkeypatch):
    """The fix named plain ``nox -s update``, which has nothing to do while the current build is the checkout's:
    the rollback stayed refused. ``--force`` builds beside the current build, which is then the previous one."""
    from rig.control import update

    env = env_for(tmp_path)
    s = config.settings(env)
    current = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    broken = slots.new(s.state_dir, "cpu", "vllm-cpu", ".venv-cpu", "artifacts-cpu")
    for slot in (current, broken):
        (slot.venv_dir / "bin").mkdir(parents=True)
        (slot.venv_dir / "bin" / "python").write_text("")
    slots.write(s.state_dir, "cpu", current, broken)
    (broken.venv_dir / "bin" / "python").unlink()
    idle = update.Engine(running=lambda: False, stop=lambda: None, start=lambda: None)
    with pytest.raises(BadInput) as e:
        update.rollback(env, idle)
    assert "nox -s update -- --force" in e.value.message, e.value.message
    monkeypatch.setattr(update.pipeline, "first_stale", lambda *a, **k: None)  # the checkout's build is current

    def build(steps, ns, options, only=None):  # the build's product the rollback reads: the slot's venv
        (ns.venv_dir / "bin").mkdir(parents=True)
        (ns.venv_dir / "bin" / "python").write_text("")

    monkeypatch.setattr(update.pipeline, "run", build)
    assert update.update(env, idle) == 0 and slots.read(s.state_dir, "cpu")[0] == current  # plain: nothing to do
    assert update.update(env, idle, force=True) == 0
    assert update.rollback(env, idle) == 0
    assert slots.settings(env).venv_dir == current.venv_dir
