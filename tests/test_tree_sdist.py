"""Step 2 from a PyPI-style sdist, served by a local simple index (PEP 691 JSON)."""

from __future__ import annotations

import hashlib
import io
import socket
import tarfile
from pathlib import Path

import pytest
from conftest import UPSTREAM_FILES, Index, git, run_rig

NAME = "vllm-0.30.0.tar.gz"


def make_sdist(path: Path) -> bytes:
    """An sdist shaped like vLLM's: one top folder, PKG-INFO, the upstream files."""
    files = {**UPSTREAM_FILES, "PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.0\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-0.30.0/{rel}")
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def tree_of_sdist(data: bytes, tmp: Path) -> str:
    """The tree of the unpacked sdist as plain git computes it."""
    d = tmp / "sdist-tree"
    d.mkdir()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        tf.extractall(d, filter="data")
    root = d / "vllm-0.30.0"
    git(root, "init", "-q")
    git(root, "add", "-A", "-f")
    return git(root, "write-tree")


@pytest.fixture
def sdist(tmp_path):
    data = make_sdist(tmp_path / NAME)
    idx = Index(tmp_path / "index", {NAME: data})
    yield data, idx
    idx.stop()


def sdist_env(rig_env, idx, tmp_path, source="sdist"):
    return {**rig_env, "VLLM_SOURCE": source, "INDEX_URL": idx.url, "VLLM_UPSTREAM_URL": str(tmp_path / "gone")}


def test_sdist_base_gives_the_tree_plain_git_gives(series, rig_env, sdist, tmp_path):
    data, idx = sdist
    expected = tree_of_sdist(data, tmp_path)
    series.write_toml({"sdist": expected})
    r = run_rig(sdist_env(rig_env, idx, tmp_path), "tree")
    assert r.code == 0, r.text
    assert r.fact("source") == "sdist" and r.fact("tree") == expected
    vllm = tmp_path / "vllm"
    assert git(vllm, "tag", "--list") == "v0.30.0"
    assert (vllm / "PKG-INFO").exists()
    assert (tmp_path / "cache" / "dist" / NAME).read_bytes() == data


def test_sdist_base_commit_is_the_same_on_every_run(series, rig_env, sdist, tmp_path):
    data, idx = sdist
    series.write_toml({"sdist": tree_of_sdist(data, tmp_path)})
    env = sdist_env(rig_env, idx, tmp_path)
    first = run_rig(env, "tree")
    again = run_rig({**env, "FETCH": "1"}, "tree")
    assert first.code == again.code == 0, again.text
    assert first.fact("head") == again.fact("head")


def test_auto_falls_back_to_the_sdist_and_says_so(series, rig_env, sdist, tmp_path):
    data, idx = sdist
    series.write_toml({"git": series.tree, "sdist": tree_of_sdist(data, tmp_path)})
    r = run_rig(sdist_env(rig_env, idx, tmp_path, source="auto"), "tree")
    assert r.code == 0, r.text
    assert "unreachable" in r.out and "falling back to the PyPI sdist" in r.out
    assert r.fact("source") == "sdist"


def test_auto_with_git_reachable_takes_the_sdist_when_only_its_tree_is_recorded(series, rig_env, sdist, tmp_path):
    """A machine that reaches the git host must not stop at step 2 when series.toml records the sdist's tree."""
    data, idx = sdist
    series.write_toml({"sdist": tree_of_sdist(data, tmp_path)})
    env = {**rig_env, "VLLM_SOURCE": "auto", "INDEX_URL": idx.url}  # VLLM_UPSTREAM_URL: the reachable fixture
    r = run_rig(env, "tree")
    assert r.code == 0, r.text
    assert r.fact("source") == "sdist"
    assert "records an expected tree for the sdist only" in r.out
    again = run_rig(env, "tree")
    assert again.code == 0 and "current:" in again.out, again.text


def test_auto_with_git_reachable_takes_git_when_its_tree_is_recorded(series, rig_env, sdist, tmp_path):
    data, idx = sdist
    series.write_toml({"git": series.tree, "sdist": tree_of_sdist(data, tmp_path)})
    r = run_rig({**rig_env, "VLLM_SOURCE": "auto", "INDEX_URL": idx.url}, "tree")
    assert r.code == 0, r.text
    assert r.fact("source") == "git" and "reachable" in r.out


def test_auto_with_only_a_git_tree_and_git_unreachable_names_the_fix(series, rig_env, sdist, tmp_path):
    _, idx = sdist
    r = run_rig(sdist_env(rig_env, idx, tmp_path, source="auto"), "tree")  # the fixture records git only
    assert r.code == 2, r.text
    assert "VLLM_SOURCE=auto" in r.err and "[expected.sdist]" in r.err and "unreachable" in r.err
    assert "VLLM_SOURCE=sdist ./build.sh --only tree --accept" in r.err
    assert not (tmp_path / "vllm").exists()


def test_pinned_sha_lets_fetch_1_work_offline_from_the_cache(series, rig_env, sdist, tmp_path):
    data, idx = sdist
    series.write_toml({"sdist": tree_of_sdist(data, tmp_path)}, sdist_sha256=idx.sha[NAME])
    env = sdist_env(rig_env, idx, tmp_path)
    assert run_rig(env, "tree").code == 0
    idx.stop()
    r = run_rig({**env, "FETCH": "1"}, "tree")
    assert r.code == 0, r.text
    assert "cached, sha256 ok" in r.out


def test_sdist_whose_sha_does_not_match_the_index(series, rig_env, tmp_path):
    data = make_sdist(tmp_path / NAME)
    idx = Index(tmp_path / "index", {NAME: data}, {NAME: "ab" * 32})
    try:
        series.write_toml({"sdist": "0" * 40})
        r = run_rig(sdist_env(rig_env, idx, tmp_path), "tree")
    finally:
        idx.stop()
    assert r.code == 2, r.text
    assert "sha256" in r.err and "ab" * 32 in r.err and hashlib.sha256(data).hexdigest() in r.err
    assert not (tmp_path / "cache" / "dist" / NAME).exists()
    assert not (tmp_path / "vllm").exists()


def test_index_sha_differs_from_the_pinned_one(series, rig_env, sdist, tmp_path):
    _, idx = sdist
    series.write_toml({"sdist": "0" * 40}, sdist_sha256="cd" * 32)
    r = run_rig(sdist_env(rig_env, idx, tmp_path), "tree")
    assert r.code == 2
    assert "cd" * 32 in r.err and idx.sha[NAME] in r.err and "sdist_sha256" in r.err


def test_git_unreachable_and_sdist_unavailable(series, rig_env, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    series.write_toml({"git": series.tree, "sdist": "0" * 40})
    env = {**rig_env, "VLLM_SOURCE": "auto", "VLLM_UPSTREAM_URL": str(tmp_path / "gone"),
           "INDEX_URL": f"http://127.0.0.1:{port}/simple"}
    r = run_rig(env, "tree")
    assert r.code == 1, r.text  # the network failed: not bad input
    assert "unreachable" in r.out
    assert f"127.0.0.1:{port}" in r.err and "INDEX_URL" in r.err
    assert not (tmp_path / "vllm").exists()


def test_sdist_with_a_member_outside_its_folder_is_refused(series, rig_env, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("vllm-0.30.0/README.md", "elsewhere/evil.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    idx = Index(tmp_path / "index", {NAME: buf.getvalue()})
    try:
        r = run_rig(sdist_env(rig_env, idx, tmp_path), "tree")
    finally:
        idx.stop()
    assert r.code == 2
    assert "elsewhere/evil.txt" in r.err
    assert not (tmp_path / "vllm").exists()
    assert not list(tmp_path.glob(".vllm.scratch-*"))
