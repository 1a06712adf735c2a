"""The thin edges: the shell wrappers and the noxfile hold no logic of their own."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tomllib

from conftest import ROOT

from rig.build.steps.order import ORDER
from rig.facts import config

WRAPPERS = ["build.sh", "start.sh", "vllm-logs.sh", "scripts/nox.sh", "scripts/gen-cuda-stub.sh"]


def test_wrappers_are_thin():
    for w in WRAPPERS:
        lines = (ROOT / w).read_text().splitlines()
        assert len(lines) <= 20, w
        assert os.access(ROOT / w, os.X_OK), w


def test_build_help_from_another_directory_lists_steps_and_variables(tmp_path):
    r = subprocess.run([str(ROOT / "build.sh"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    for n, name in enumerate(ORDER, 1):
        assert re.search(rf"^\s+{n}\. {name}\b", r.stdout, re.M), name
    for v in config.VARS:
        assert v.name in r.stdout


def test_wrapper_passes_the_exit_code_through(tmp_path):
    env = {**os.environ, "PATCHES_DIR": str(tmp_path / "no-patches"), "RIG_STATE": str(tmp_path / "state")}
    r = subprocess.run([str(ROOT / "build.sh"), "--only", "tree"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "series.toml" in r.stderr


def test_noxfile_script_block_carries_the_project_dependencies():
    text = (ROOT / "noxfile.py").read_text()
    block = re.search(r"^# /// script\n(.*?)^# ///$", text, re.S | re.M)[1]
    meta = tomllib.loads("\n".join(line[2:] for line in block.splitlines()))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(meta["dependencies"]) == sorted(deps + [d for d in meta["dependencies"] if d.startswith("nox")])
    floor = re.search(r'"nox>=([\d.]+)"', block)[1]
    assert f'nox.needs_version = ">={floor}"' in text


def test_every_session_has_a_one_line_docstring():
    import ast
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    sessions = [f for f in tree.body if isinstance(f, ast.FunctionDef)
                and any("session" in ast.unparse(d) for d in f.decorator_list)]
    assert {f.name for f in sessions} >= {"build", "tree", "lock", "pack", "verify", "logs", "doctor", "tests", "lint"}
    for f in sessions:
        doc = ast.get_docstring(f)
        assert doc and "\n" not in doc, f.name


def test_start_help_names_its_switches_and_the_variables(tmp_path):
    r = subprocess.run([str(ROOT / "start.sh"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    for switch in ("--foreground", "--dry-run", "--no-build", "--skip-box-check", "--clear-cache", "CKPT"):
        assert switch in r.stdout
    for name in ("MODEL_NAME", "VLLM_API_KEY", "MAX_SEQS", "GUARD", "STOP_TIMEOUT"):
        assert name in r.stdout


def test_a_fresh_machine_gets_uv_without_pip_or_the_system_python(tmp_path):
    """Debian's own python3 is externally managed (PEP 668): the wrapper fetches the pinned uv itself.

    The environment is bare: no certificate variables. Behind a TLS-inspecting proxy whose CA is only in the
    system's store, uv with its own bundled roots fails; the wrapper makes it trust the store as Python does."""
    import shutil as sh

    copy = tmp_path / "rig"
    copy.mkdir()
    for rel in ("build.sh", "noxfile.py", "pyproject.toml", "scripts", "rig", "patches"):
        (sh.copytree if (ROOT / rel).is_dir() else sh.copy2)(ROOT / rel, copy / rel)
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    assert subprocess.run(["/usr/bin/python3", "-m", "pip", "install", "--user", "--dry-run", "uv"], env=env,
                          capture_output=True, text=True).returncode != 0  # what the wrapper must not rely on
    r = subprocess.run([str(copy / "build.sh"), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fetching uv 0.13.9" in r.stderr and "usage: build.sh" in r.stdout
    assert os.access(copy / ".rig" / "uv" / "uv", os.X_OK)
    again = subprocess.run([str(copy / "build.sh"), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "fetching uv" not in again.stderr  # kept under the rig's state


def test_uv_trusts_the_system_store_unless_the_user_chose(tmp_path):
    """The wrapper sets uv's system-certificates switch, and leaves either of uv's own TLS variables alone."""
    seen = tmp_path / "seen"
    fake = tmp_path / "uv"  # records what the wrapper hands uv; the real uv is driven by the test above
    fake.write_text(f"#!/bin/sh\necho \"${{UV_SYSTEM_CERTS-unset}} ${{UV_NATIVE_TLS-unset}}\" >> {seen}\n")
    fake.chmod(0o755)
    for extra in ({}, {"UV_SYSTEM_CERTS": "false"}, {"UV_NATIVE_TLS": "0"}):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "UV": str(fake), **extra}
        subprocess.run([str(ROOT / "scripts" / "nox.sh"), "-l"], env=env, check=True)
    assert seen.read_text().splitlines() == ["1 unset", "false unset", "unset 0"]


def test_the_uv_bootstrap_says_a_failed_download_is_exit_1(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(["/usr/bin/python3", str(ROOT / "scripts" / "bootstrap_uv.py"), str(tmp_path / "uv")],
                       env={"PATH": "/usr/bin:/bin", "INDEX_URL": f"http://127.0.0.1:{port}/simple"},
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "check the network" in r.stderr
    assert not (tmp_path / "uv" / "uv").exists()


def test_the_uv_bootstrap_refuses_a_wheel_whose_sha256_is_not_the_pin(tmp_path):
    from conftest import Index

    name = "uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    idx = Index(tmp_path / "index", {name: b"not uv"})
    try:
        r = subprocess.run(["/usr/bin/python3", str(ROOT / "scripts" / "bootstrap_uv.py"), str(tmp_path / "uv")],
                           env={"PATH": "/usr/bin:/bin", "INDEX_URL": idx.url}, capture_output=True, text=True)
    finally:
        idx.stop()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "expected d7f459fe" in r.stderr and idx.sha[name] in r.stderr
    assert not (tmp_path / "uv" / "uv").exists()
