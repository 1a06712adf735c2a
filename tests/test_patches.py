"""nox -s patches: check, rebase and new, on the fixture upstream (fast) and on real vLLM sdists (slow)."""

from __future__ import annotations

import datetime as dt
import os
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, TAG, git, run_rig, write_files

WHY = ("\n\nUsers of the rig need this because the default behaviour hides what the server is doing, "
       "and this says it.")
PY_PATCH = {"vllm/entrypoints/api.py": "".join(f"# api line {i}\n" for i in range(1, 31)) + "def serve():\n"
            "    return 'patched'\n"}
CSRC_PATCH = {"csrc/ops.cpp": "".join(f"// line {i}\n" for i in range(1, 21))
              + "int vllm_fixture_op(int x) { return x + 2; }\n"}


def two_patch_series(series) -> None:
    series.commit("api: patched" + WHY, PY_PATCH)
    series.commit("csrc: a kernel tweak", CSRC_PATCH)  # no body: does not say why
    series.write_toml({"git": series.tree})


def test_check_reports_each_patch(series, rig_env, tmp_path):
    two_patch_series(series)
    r = run_rig(rig_env, "patches", "check")
    assert r.code == 0, r.text
    lines = [ln.strip() for ln in r.out.splitlines() if ".patch:" in ln]
    assert len(lines) == 2
    assert lines[0].startswith("0001-api-patched.patch: applies") and "Python only" in lines[0]
    assert "vllm/entrypoints/api.py" in lines[0] and "says why" in lines[0]
    assert "forces a compile: csrc/ops.cpp" in lines[1] and "does not say why" in lines[1]
    assert not (tmp_path / "vllm").exists()  # check never makes or touches vllm/


def test_check_names_the_patch_and_hunk_that_fails_and_leaves_vllm_alone(series, rig_env, tmp_path):
    two_patch_series(series)
    assert run_rig(rig_env, "tree").code == 0
    head = git(tmp_path / "vllm", "rev-parse", "HEAD")
    bad = series.patches / "0003-api-again.patch"
    text = (series.patches / "0001-api-patched.patch").read_text()
    bad.write_text(text.replace("# api line 30\n", "# api line thirty\n"))  # context that matches nothing
    r = run_rig(rig_env, "patches", "check")
    assert r.code == 1, r.text
    assert "0003-api-again.patch: conflict" in r.out
    assert "vllm/entrypoints/api.py: hunk at line" in r.err and "0003-api-again.patch" in r.err
    assert git(tmp_path / "vllm", "rev-parse", "HEAD") == head and not git(tmp_path / "vllm", "status", "--porcelain")


def newer_upstream(series, changes: dict[str, str]) -> None:
    """A v0.31.0 tag in the fixture upstream, with ``changes`` on top of v0.30.0."""
    up = series.upstream
    git(up, "checkout", "-q", "-B", "next", TAG)
    write_files(up, changes)
    git(up, "add", "-A")
    git(up, "commit", "-q", "-m", "upstream v0.31.0")
    git(up, "tag", "-a", "v0.31.0", "-m", "v0.31.0")


def test_rebase_writes_a_new_series_and_a_report(series, rig_env, tmp_path):
    two_patch_series(series)
    # v0.31.0 changes a file no patch touches: both apply as they are, onto a different base.
    newer_upstream(series, {"README.md": "vLLM 0.31.0\n"})
    before = {p.name: p.read_bytes() for p in series.patches.iterdir()}
    r = run_rig(rig_env, "patches", "rebase", "v0.31.0")
    assert r.code == 0, r.text
    out = Path(r.out.split("is in ", 1)[1].split(" (patches/")[0])
    try:
        assert sorted(p.name for p in out.iterdir()) == ["0001-api-patched.patch", "0002-csrc-a-kernel-tweak.patch",
                                                         "REBASE-v0.30.0-to-v0.31.0.md", "series.toml"]
        st = tomllib.loads((out / "series.toml").read_text())
        assert st["upstream"]["version"] == "0.31.0" and st["upstream"]["tag"] == "v0.31.0"
        assert st["expected"]["git"]["verified"] == dt.date.today().isoformat()
        assert st["ops"]["paths"] == tomllib.loads((series.patches / "series.toml").read_text())["ops"]["paths"]
        report = (out / "REBASE-v0.30.0-to-v0.31.0.md").read_text()
        assert "| 0001-api-patched.patch | applies |" in report
        # the new series builds the tree it records
        env = {**rig_env, "PATCHES_DIR": str(out), "VLLM_DIR": str(tmp_path / "vllm31")}
        b = run_rig(env, "tree")
        assert b.code == 0, b.text
        assert b.fact("tree") == st["expected"]["git"]["tree"]
    finally:
        import shutil
        shutil.rmtree(out, ignore_errors=True)
    assert {p.name: p.read_bytes() for p in series.patches.iterdir()} == before  # patches/ untouched


def test_rebase_reports_the_conflicting_patch_and_file(series, rig_env, tmp_path):
    two_patch_series(series)
    newer_upstream(series, {"csrc/ops.cpp": "".join(f"// moved {i}\n" for i in range(1, 21))})
    out = tmp_path / "rebased"
    r = run_rig(rig_env, "patches", "rebase", "v0.31.0", "--out", str(out), "--keep-going")
    assert r.code == 1, r.text
    assert "0001-api-patched.patch: applies" in r.out
    assert "0002-csrc-a-kernel-tweak.patch: conflict" in r.out and "csrc/ops.cpp" in r.err
    assert not out.exists()  # nothing written when a patch conflicts
    report = Path(r.out.split("report: ", 1)[1].split("\n", 1)[0])
    text = report.read_text()
    assert "| 0002-csrc-a-kernel-tweak.patch | conflict | csrc/ops.cpp |" in text and "1 conflict" in text


def test_rebase_refuses_a_bad_version_and_a_used_folder(series, rig_env, tmp_path):
    two_patch_series(series)
    r = run_rig(rig_env, "patches", "rebase", "latest")
    assert r.code == 2 and "expected an upstream version like v0.31.0, found 'latest'" in r.err
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    r = run_rig(rig_env, "patches", "rebase", "v0.31.0", "--out", str(used))
    assert r.code == 2 and "a rebase never overwrites" in r.err and (used / "keep.txt").read_text() == "mine"


def test_new_round_trip(series, rig_env, tmp_path):
    two_patch_series(series)
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    (vllm / "vllm" / "entrypoints" / "extra.py").write_text("EXTRA = 1\n")
    nothing = run_rig(rig_env, "patches", "new", "extra")
    assert nothing.code == 2 and "expected commits on top of the series, found none" in nothing.err
    git(vllm, "add", "-A")
    git(vllm, "commit", "-q", "-m", "entrypoints: an extra module" + WHY)
    want = git(vllm, "rev-parse", "HEAD^{tree}")
    r = run_rig(rig_env, "patches", "new", "extra-module")
    assert r.code == 0, r.text
    new = series.patches / "0003-extra-module.patch"
    assert new.exists() and "EXTRA = 1" in new.read_text()
    st = tomllib.loads((series.patches / "series.toml").read_text())
    assert st["expected"]["git"] == {"tree": want, "verified": dt.date.today().isoformat()}
    assert git(vllm, "rev-parse", "HEAD^{tree}") == want
    t = run_rig(rig_env, "tree")
    assert t.code == 0 and "current: tree" in t.out, t.text
    c = run_rig(rig_env, "patches", "check")
    assert c.code == 0 and "0003-extra-module.patch: applies" in c.out


# --- the real sdists ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real-patches")
    env = {k: v for k, v in os.environ.items() if k not in ("FETCH", "VLLM_DIR", "PATCHES_DIR", "RIG_STATE")}
    env.update({"VLLM_SOURCE": "sdist", "VLLM_DIR": str(tmp / "vllm"), "RIG_STATE": str(tmp / "state")})
    return tmp, env


@pytest.mark.slow
def test_check_on_the_real_starter_series(real_env):
    _, env = real_env
    r = run_rig(env, "patches", "check", timeout=1800)
    assert r.code == 0, r.text
    lines = [ln for ln in r.out.splitlines() if ".patch:" in ln]
    assert len(lines) == len(list((ROOT / "patches").glob("*.patch")))
    assert all(": applies" in ln and "says why" in ln and "Python only" in ln for ln in lines), lines


@pytest.mark.slow
def test_the_optional_compiled_input_patch_applies_and_forces_a_compile(real_env):
    tmp, env = real_env
    optional = tmp / "with-kernel-note"
    optional.mkdir()
    for p in [*(ROOT / "patches").glob("*.patch"), *(ROOT / "patches" / "optional").glob("*.patch"),
              ROOT / "patches" / "series.toml"]:
        (optional / p.name).write_bytes(p.read_bytes())
    r = run_rig({**env, "PATCHES_DIR": str(optional)}, "patches", "check", timeout=1800)
    assert r.code == 0, r.text
    line = next(ln for ln in r.out.splitlines() if "0101-cmake" in ln)
    assert ": applies" in line and "forces a compile: CMakeLists.txt" in line and "says why" in line


@pytest.mark.slow
def test_rebase_of_the_starter_series_onto_the_real_0_31_0(real_env):
    tmp, env = real_env
    out = tmp / "patches-v0.31.0"
    r = run_rig(env, "patches", "rebase", "v0.31.0", "--out", str(out), "--keep-going", timeout=1800)
    report = Path(r.out.split("report: ", 1)[1].split("\n", 1)[0])
    text = report.read_text()
    print(text)
    assert "# Rebase of the series from v0.30.0 to v0.31.0" in text
    for p in (ROOT / "patches").glob("*.patch"):
        assert f"| {p.name} |" in text
    if r.code == 0:
        st = tomllib.loads((out / "series.toml").read_text())
        assert st["upstream"]["tag"] == "v0.31.0" and len(st["upstream"]["sdist_sha256"]) == 64
        assert "sdist" in st["expected"]
    else:
        assert r.code == 1 and "conflicts on v0.31.0" in r.err and not out.exists()
