"""Step 4, runtime: a real hashed lock made by uv pip compile, installed with hash checking."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import ROOT, run_rig

from rig.base import venvs
from rig.base.errors import BadInput
from rig.build.steps import runtime
from rig.facts import config, uv


@pytest.fixture(scope="module")
def small_lock(tmp_path_factory) -> Path:
    """A lock of two small packages, made the way nox -s lock makes the real one."""
    d = tmp_path_factory.mktemp("lock")
    s = config.settings({**os.environ, "RUNTIME_LOCK": str(d / "runtime.lock")})
    n = runtime.make_lock(s, uv.resolve(s), s.runtime_lock, ["six==1.16.0", "idna==3.7"])
    assert n == 2
    return s.runtime_lock


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_lock):
    d = tmp_path_factory.mktemp("rt")
    env = {k: v for k, v in os.environ.items() if k not in ("UV", "PYTHON", "UV_PYTHON")}
    env.update({"VENV_DIR": str(d / ".venv"), "RIG_STATE": str(d / "state"), "RUNTIME_LOCK": str(small_lock)})
    r = run_rig(env, "build", "--only", "venv,runtime")
    return r, env, d


def edited(small_lock: Path, tmp_path: Path, fn) -> str:
    p = tmp_path / "runtime.lock"
    p.write_text(fn(small_lock.read_text()))
    return str(p)


def test_a_lock_with_uv_turned_off_says_unset_it_and_unset_it_resolves(tmp_path, monkeypatch):
    """The wrapper puts a uv on PATH but leaves UV=0 as it is: the fix must be to unset it, not the wrapper."""
    monkeypatch.setenv("PATH", f"{Path(uv.find(ROOT)).parent}:{os.environ.get('PATH', '')}")  # as scripts/nox.sh
    env = {**os.environ, "UV": "0", "RUNTIME_LOCK": str(tmp_path / "runtime.lock")}
    s = config.settings(env)
    with pytest.raises(BadInput) as refused:
        runtime.make_lock(s, uv.resolve(s), s.runtime_lock, ["six==1.16.0"])
    assert "UV=0, which turns uv off" in refused.value.message and "unset UV" in refused.value.message
    del env["UV"]  # the fix followed
    s = config.settings(env)
    assert runtime.make_lock(s, uv.resolve(s), s.runtime_lock, ["six==1.16.0"]) == 1


def test_lock_pins_every_requirement_with_hashes(small_lock):
    lock = runtime.read_lock(small_lock)
    assert lock.python == "3.13"
    assert set(lock.pins) == {"six", "idna"}
    assert all(h for _, h in lock.pins.values())
    assert "--generate-hashes" in small_lock.read_text()


def test_installs_and_a_rerun_is_current(built):
    r, env, d = built
    assert r.code == 0, r.text
    assert r.fact("pins") == "2"
    have = venvs.installed(env["VENV_DIR"])
    assert have["six"] == "1.16.0" and have["idna"] == "3.7"
    again = run_rig({**env, "INDEX_URL": "http://127.0.0.1:9/simple"}, "build", "--only", "runtime")
    assert again.code == 0, again.text
    assert "current: 2 pins" in again.out


def test_a_removed_package_is_installed_again(built, tmp_path):
    r, env, d = built
    sp = Path(config.settings(env).venv_dir) / "lib/python3.13/site-packages"
    for p in sp.glob("six-*.dist-info"):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    r = run_rig(env, "build", "--only", "runtime")
    assert r.code == 0, r.text
    assert "six==1.16.0 (found none)" in r.out
    assert venvs.installed(env["VENV_DIR"])["six"] == "1.16.0"


def _break(env: dict[str, str], name: str) -> Path:
    """What kill -9 in the middle of an install leaves: the .dist-info folder, and a package file missing."""
    sp = venvs.site_packages(Path(env["VENV_DIR"]))
    gone = sp / name / "__init__.py"
    gone.unlink()
    return gone


def test_an_install_cut_short_is_found_and_repaired_by_a_plain_rerun(built):
    _, env, _ = built
    gone = _break(env, "idna")
    s = config.settings(env)
    (s.venv_dir / runtime.MARKER).write_text("pid 4242 at 2026-12-01 10:00:00\n")  # the run that was killed
    r = run_rig(env, "build", "--only", "runtime")
    assert r.code == 0 and "was cut short" in r.out and gone.exists(), r.text
    r = run_rig(env, "build", "--only", "runtime")
    assert r.code == 0 and "current: 2 pins" in r.out, r.text
    assert not (s.venv_dir / runtime.MARKER).exists() and venvs.damaged(s.venv_dir) == {}


def test_an_install_cut_short_says_so_and_names_the_broken_package(built):
    _, env, _ = built
    gone = _break(env, "idna")
    s = config.settings(env)
    (s.venv_dir / runtime.MARKER).write_text("pid 4242 at 2026-12-01 10:00:00\n")
    r = run_rig(env, "build", "--only", "runtime")
    assert r.code == 0, r.text
    assert "was cut short (pid 4242 at 2026-12-01 10:00:00)" in r.out
    assert "package(s) with files missing, e.g. idna (idna/__init__.py): installed again" in r.out
    assert gone.exists() and venvs.damaged(s.venv_dir) == {}


def test_force_repairs_a_damaged_venv_even_without_a_marker(built):
    _, env, _ = built
    gone = _break(env, "idna")
    current = run_rig(env, "build", "--only", "runtime")
    assert "current: 2 pins" in current.out  # the names are there: the cheap check cannot see it
    r = run_rig(env, "build", "--only", "runtime", "--force")
    assert r.code == 0 and gone.exists(), r.text
    assert venvs.damaged(Path(env["VENV_DIR"])) == {}


def test_hand_edited_hash_is_refused_naming_the_package(built, small_lock, tmp_path):
    _, env, _ = built
    lock = runtime.read_lock(small_lock)
    _, real = lock.pins["six"]

    def swap(text: str) -> str:
        for h in real:
            text = text.replace(h, "sha256:" + "0" * 64 if h == real[0] else "sha256:" + "1" * 64)
        return text

    r = run_rig({**env, "RUNTIME_LOCK": edited(small_lock, tmp_path, swap)}, "build", "--only", "runtime")
    assert r.code == 2, r.text
    assert "six==1.16.0" in r.err and "sha256:" + "0" * 64 in r.err
    assert re.search(r"found sha256:[0-9a-f]{64}", r.err)
    assert any(h in r.err.split("found ")[1] for h in real)


def test_lock_for_another_python_is_refused(built, small_lock, tmp_path):
    _, env, _ = built
    lock = edited(small_lock, tmp_path, lambda t: t.replace("# python: 3.13", "# python: 3.12"))
    r = run_rig({**env, "RUNTIME_LOCK": lock}, "build", "--only", "runtime")
    assert r.code == 2
    assert "a lock for the venv's Python 3.13" in r.err and "found a lock for Python 3.12" in r.err


def test_package_missing_from_the_index(built, small_lock, tmp_path):
    _, env, _ = built
    lock = edited(small_lock, tmp_path, lambda t: t.replace("six==1.16.0", "six==99.0.0"))
    r = run_rig({**env, "RUNTIME_LOCK": lock}, "build", "--only", "runtime")
    assert r.code == 2, r.text
    assert "six==99.0.0" in r.err and "nox -s lock" in r.err


def test_unpinned_requirement_is_refused(built, small_lock, tmp_path):
    _, env, _ = built
    lock = edited(small_lock, tmp_path, lambda t: t + "requests>=2\n")
    r = run_rig({**env, "RUNTIME_LOCK": lock}, "build", "--only", "runtime")
    assert r.code == 2
    assert "'requests>=2'" in r.err and "NAME==VERSION" in r.err


def test_runtime_needs_a_venv(tmp_path, small_lock):
    env = {**os.environ, "VENV_DIR": str(tmp_path / "none"), "RIG_STATE": str(tmp_path / "s"),
           "RUNTIME_LOCK": str(small_lock)}
    r = run_rig(env, "build", "--only", "runtime")
    assert r.code == 2
    assert "step venv (needed by runtime)" in r.err and "--only venv,runtime" in r.err


def test_committed_lock_is_the_cuda_runtime_for_313():
    lock = runtime.read_lock(ROOT / "scripts" / "runtime.lock")
    assert lock.python == "3.13"
    assert lock.pins["torch"][0] == "2.13.0"
    assert lock.pins["torchvision"][0] == "0.28.0" and lock.pins["torchaudio"][0] == "2.11.0"
    assert lock.pins["flashinfer-python"][0] == "0.6.18.post1"
    assert lock.pins["nvidia-cuda-runtime"][0].startswith("13.")
    assert "vllm" not in lock.pins
    for req in ("setuptools", "setuptools-scm", "setuptools-rust", "cmake", "ninja", "wheel", "jinja2"):
        assert req in lock.pins, req
    print(f"\nruntime lock: {len(lock.pins)} pins")
