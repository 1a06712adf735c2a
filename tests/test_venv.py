"""Step 3, venv: CPython 3.13 found by itself, a correct venv kept, a wrong or broken one replaced."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_rig

from rig.build.steps import venv
from rig.facts import config


def env_for(tmp_path: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("UV", "PYTHON", "UV_PYTHON")}
    env.update({"VENV_DIR": str(tmp_path / ".venv"), "RIG_STATE": str(tmp_path / "state"), **extra})
    return env


def venv_version(v: Path) -> str:
    return subprocess.run([str(v / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
                          capture_output=True, text=True).stdout.strip()


def test_finds_313_without_being_told(tmp_path):
    python, how = venv.find_python(config.settings(env_for(tmp_path)), shutil.which("uv"))
    assert venv.probe(python)[0] == (3, 13)
    assert how


def test_creates_then_keeps_a_313_venv(tmp_path):
    env = env_for(tmp_path)
    r = run_rig(env, "build", "--only", "venv")
    assert r.code == 0, r.text
    assert venv_version(tmp_path / ".venv") == "(3, 13)"
    assert "uv cache:" in r.out and "pip cache:" in r.out
    marker = tmp_path / ".venv" / "kept"
    marker.write_text("x")
    r = run_rig(env, "build", "--only", "venv")
    assert r.code == 0 and "current:" in r.out
    assert marker.exists()


def test_wrong_minor_is_replaced_saying_so(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    assert venv_version(tmp_path / ".venv") != "(3, 13)"
    r = run_rig(env_for(tmp_path), "build", "--only", "venv")
    assert r.code == 0, r.text
    assert "not 3.13: replacing it" in r.out
    assert venv_version(tmp_path / ".venv") == "(3, 13)"
    assert not list(tmp_path.glob(".venv.old-*"))


def test_broken_venv_is_replaced(tmp_path):
    env = env_for(tmp_path)
    assert run_rig(env, "build", "--only", "venv").code == 0
    py = tmp_path / ".venv" / "bin" / "python"
    py.unlink()
    py.symlink_to(tmp_path / "gone" / "python3.13")
    r = run_rig(env, "build", "--only", "venv")
    assert r.code == 0, r.text
    assert "broken" in r.out
    assert venv_version(tmp_path / ".venv") == "(3, 13)"


def test_uv_0_uses_python_m_venv(tmp_path):
    r = run_rig(env_for(tmp_path, UV="0"), "build", "--only", "venv")
    assert r.code == 0, r.text
    assert "-m venv (UV=0)" in r.out
    assert (tmp_path / ".venv" / "bin" / "pip").exists()


def test_python_of_another_minor_is_refused(tmp_path):
    r = run_rig(env_for(tmp_path, PYTHON=sys.executable), "build", "--only", "venv")
    assert r.code == 2
    assert f"PYTHON/UV_PYTHON={sys.executable}" in r.err and "a CPython 3.13" in r.err
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in r.err
    assert not (tmp_path / ".venv").exists()


def test_no_313_anywhere_says_how_to_install(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("git", "cc"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = env_for(tmp_path, UV="0", PATH=str(bin_dir), PYENV_ROOT=str(tmp_path / "no-pyenv"))
    r = run_rig(env, "build", "--only", "venv")
    assert r.code == 2, r.text
    assert "CPython 3.13" in r.err and "pyenv install 3.13" in r.err


@pytest.mark.parametrize("fake", ["true", "false"])
def test_uv_path_that_is_not_uv_is_refused(tmp_path, fake):
    r = run_rig(env_for(tmp_path, UV=shutil.which(fake)), "build", "--only", "venv")
    assert r.code == 2
    assert f"UV={shutil.which(fake)}" in r.err and not (tmp_path / ".venv").exists()


def test_force_replaces_an_existing_venv_from_its_base_python(tmp_path):
    """--force must never take the venv's own bin/python (what discovery finds first) as the new base."""
    env = env_for(tmp_path)
    assert run_rig(env, "build", "--only", "venv").code == 0
    # uv's discovery, like a shell with the venv active, finds this venv first
    r = run_rig({**env, "VIRTUAL_ENV": str(tmp_path / ".venv")}, "build", "--only", "venv", "--force")
    assert r.code == 0, r.text
    assert venv_version(tmp_path / ".venv") == "(3, 13)"
    assert str(tmp_path / ".venv") not in r.out.split("CPython 3.13: ", 1)[1].split("\n", 1)[0]
    assert not list(tmp_path.glob(".venv.old-*"))


def test_a_venv_python_named_by_python_gives_its_base(tmp_path):
    env = env_for(tmp_path)
    assert run_rig(env, "build", "--only", "venv").code == 0
    inner = str(tmp_path / ".venv" / "bin" / "python")
    python, _ = venv.find_python(config.settings({**env, "PYTHON": inner}), shutil.which("uv"))
    assert not Path(os.path.realpath(python)).is_relative_to(tmp_path / ".venv")
    assert venv.probe(python)[0] == (3, 13)


def test_a_new_build_borrows_the_serving_builds_bytecode_for_the_files_they_share(tmp_path):
    """An update's new venv links the serving venv's bytecode where the source is the same file (uv links both
    from its cache): Python then loads it, naming the new venv's file. Another file of the same size, written in
    the same second, is not linked: Python's own check (size and mtime) would take the wrong bytecode."""
    import py_compile

    from rig.base import venvs

    src, dst = tmp_path / "serving", tmp_path / "new"
    sp = {v: v / "lib" / "python3.13" / "site-packages" / "pkg" for v in (src, dst)}
    for d in sp.values():
        d.mkdir(parents=True)
    (sp[src] / "same.py").write_text("def where():\n    return where.__code__.co_filename\n")
    (sp[src] / "changed.py").write_text("X = 1\n")
    os.link(sp[src] / "same.py", sp[dst] / "same.py")  # as uv links a wheel's file into each venv
    (sp[dst] / "changed.py").write_text("X = 2\n")
    for name in ("same", "changed"):
        py_compile.compile(str(sp[src] / f"{name}.py"), doraise=True)
    assert venvs.borrow_bytecode(src, dst) == 1
    assert [p.name.split(".")[0] for p in (sp[dst] / "__pycache__").iterdir()] == ["same"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    r = subprocess.run([sys.executable, "-v", "-c", "import pkg.same as m; print(m.where())"], env={
        **env, "PYTHONPATH": str(sp[dst].parent)}, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"code object from '{sp[dst] / '__pycache__'}" in r.stderr  # the borrowed file was read, not compiled
    assert r.stdout.strip() == str(sp[dst] / "same.py")
    assert venvs.borrow_bytecode(src, dst) == 0  # already there: nothing linked twice
