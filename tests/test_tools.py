"""Step 1, tools, against the real tools of this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Result, run_rig


@pytest.fixture(scope="module")
def tools_run(tools_state):
    state, facts = tools_state
    env = {**os.environ, "RIG_STATE": str(state)}
    env.pop("UV", None)
    return Result(0, facts["out"], facts["err"]), state, env


def test_tools_step_reports_and_finds_a_new_enough_cmake(tools_run):
    r, state, _ = tools_run
    assert r.code == 0, r.text
    assert "[1/8] tools" in r.out
    for name in ("git", "cc", "c++", "cmake", "ninja", "ccache", "cargo"):
        assert f"\n      {name:7} " in r.out, name
    cmake = r.fact("cmake")
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    major, minor = map(int, out.split()[2].split(".")[:2])
    assert (major, minor) >= (3, 26)
    system = shutil.which("cmake")
    if system and subprocess.run([system, "--version"], capture_output=True, text=True).stdout.split()[2] < "3.26":
        assert cmake.startswith(str(state / "tools")), "the system cmake is too old: PyPI's must be used"
        assert "come from PyPI" in r.out
    assert subprocess.run([r.fact("ninja"), "--version"], capture_output=True).returncode == 0


def test_tools_rerun_is_current(tools_run):
    _, _, env = tools_run
    r = run_rig(env, "build", "--only", "tools")
    assert r.code == 0, r.text
    assert "current: every tool found" in r.out


def test_ccache_directory_is_printed_or_its_absence_explained(tools_run, tmp_path):
    _, _, env = tools_run
    if shutil.which("ccache"):
        r = run_rig({**env, "CCACHE_DIR": str(tmp_path / "cc")}, "build", "--only", "tools")
        assert f"ccache directory: {tmp_path / 'cc'}" in r.out
    else:
        r = run_rig(env, "build", "--only", "tools")
        assert "ccache not found" in r.err and "apt-get install -y ccache" in r.err


def _bin_with(tmp_path: Path, names: tuple[str, ...]) -> str:
    d = tmp_path / "bin"
    d.mkdir()
    for n in names:
        (d / n).symlink_to(shutil.which(n))
    return str(d)


def test_missing_git_stops_with_the_install_command(tools_run, tmp_path):
    _, _, env = tools_run
    r = run_rig({**env, "PATH": _bin_with(tmp_path, ("cc", "c++"))}, "build", "--only", "tools")
    assert r.code == 2, r.text
    assert "git" in r.err and "not found" in r.err and "apt-get install -y git" in r.err


def test_missing_ccache_and_cargo_only_warn(tools_run, tmp_path):
    _, _, env = tools_run
    r = run_rig({**env, "PATH": _bin_with(tmp_path, ("cc", "c++", "git"))}, "build", "--only", "tools")
    assert r.code == 0, r.text
    assert "ccache not found" in r.err
    assert "Rust frontend is skipped" in r.out


def test_uv_that_is_not_uv_is_refused(tools_run):
    _, _, env = tools_run
    r = run_rig({**env, "UV": shutil.which("true")}, "build", "--only", "tools")
    assert r.code == 2
    assert f"UV={shutil.which('true')}" in r.err and "uv --version" in r.err
