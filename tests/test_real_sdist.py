"""Step 2 on the real vLLM v0.30.0 sdist (about 42 MB, cached under ~/.cache/vllm-rig)."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, git, run_rig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory):
    """The real base from the sdist plus the starter series in patches/."""
    tmp = tmp_path_factory.mktemp("real")
    env = {k: v for k, v in os.environ.items() if k not in ("FETCH", "VLLM_DIR", "PATCHES_DIR", "RIG_STATE")}
    env.update({"VLLM_SOURCE": "sdist", "VLLM_DIR": str(tmp / "vllm"), "RIG_STATE": str(tmp / "state")})
    r = run_rig(env, "tree")
    return tmp / "vllm", r, env


def test_real_sdist_plus_series_matches_series_toml(real_tree):
    vllm, r, _ = real_tree
    assert r.code == 0, r.text
    expected = tomllib.loads((ROOT / "patches" / "series.toml").read_text())["expected"]["sdist"]["tree"]
    assert r.fact("tree") == expected == git(vllm, "rev-parse", "HEAD^{tree}")
    assert r.fact("source") == "sdist"
    for rel in ("csrc", "CMakeLists.txt", "setup.py", "rust-toolchain.toml", "vllm/vllm_flash_attn", "PKG-INFO"):
        assert (vllm / rel).exists(), rel
    n = len(list((ROOT / "patches").glob("*.patch")))
    assert git(vllm, "rev-list", "--count", "v0.30.0..HEAD") == str(n)


def test_real_rerun_is_current(real_tree):
    _, _, env = real_tree
    r = run_rig({**env, "INDEX_URL": "http://127.0.0.1:9/simple"}, "tree")
    assert r.code == 0, r.text
    assert "current: tree" in r.out


def test_python_only_starter_series_keeps_ops_obj(real_tree):
    _, r, _ = real_tree
    assert r.fact("ops_obj") == r.fact("base_ops_obj")


def test_every_python_file_the_series_touches_compiles(real_tree):
    vllm, _, _ = real_tree
    touched = git(vllm, "diff", "--name-only", "v0.30.0", "HEAD").splitlines()
    py = [f for f in touched if f.endswith(".py")]
    assert py
    for f in py:
        py_compile.compile(str(vllm / f), doraise=True)


def test_open_api_warning_patch(real_tree):
    """What 0001 adds, imported from the built tree (it needs no GPU and no vLLM deps)."""
    vllm, _, _ = real_tree
    path = Path(vllm) / "vllm/entrypoints/serve/exposure.py"
    spec = importlib.util.spec_from_file_location("exposure", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "no API key" in mod.open_api_warning(None, None)
    assert "0.0.0.0" in mod.open_api_warning("0.0.0.0", [""])
    assert mod.open_api_warning("::", []) is not None
    assert mod.open_api_warning("0.0.0.0", ["secret"]) is None
    assert mod.open_api_warning("127.0.0.1", None) is None
    register = (vllm / "vllm/entrypoints/serve/middleware/register.py").read_text()
    assert "open_api_warning(getattr(args, \"host\", None), tokens)" in register
