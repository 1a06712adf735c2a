"""Step 2 on a small upstream repository with vLLM's layout and a real format-patch series."""

from __future__ import annotations

import datetime as dt
import fcntl
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, TAG, git, run_rig

PY_PATCH = {"vllm/entrypoints/api.py": "".join(f"# api line {i}\n" for i in range(1, 31))
            + "def serve():\n    return 'patched'\n"}
CSRC_PATCH = {"csrc/ops.cpp": "".join(f"// line {i}\n" for i in range(1, 21))
              + "int vllm_fixture_op(int x) { return x + 2; }\n"}


def tree_of(vllm: Path) -> str:
    return git(vllm, "rev-parse", "HEAD^{tree}")


def accept_current(series) -> None:
    series.write_toml({"git": series.tree})


def test_builds_the_expected_tree(series, rig_env, tmp_path):
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    r = run_rig(rig_env, "tree")
    assert r.code == 0, r.text
    vllm = tmp_path / "vllm"
    assert r.fact("tree") == series.tree == tree_of(vllm)
    assert r.fact("source") == "git"
    assert "return 'patched'" in (vllm / "vllm/entrypoints/api.py").read_text()
    # only the tag was fetched, not the commit after it
    assert git(vllm, "rev-list", "--all", "--count") == "2"
    assert git(vllm, "status", "--porcelain") == ""


def test_rerun_needs_no_upstream(series, rig_env, tmp_path):
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    assert run_rig(rig_env, "tree").code == 0
    head = git(tmp_path / "vllm", "rev-parse", "HEAD")
    rig_env["VLLM_UPSTREAM_URL"] = str(tmp_path / "no-such-upstream")
    r = run_rig(rig_env, "tree")
    assert r.code == 0, r.text
    assert "current: tree" in r.out
    assert git(tmp_path / "vllm", "rev-parse", "HEAD") == head


def test_what_a_killed_run_left_is_removed_by_the_next_run_saying_so(series, rig_env, tmp_path):
    """kill -9 skips every finally: a scratch worktree (git's entry still locked when `worktree add` itself was
    killed), a .venv.old-* and a pack's .tmp stay. The next run removes them, even when every step is current."""
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    scratch = tmp_path / ".vllm.scratch-999999999"  # no such pid: its run is gone
    git(vllm, "worktree", "add", "--quiet", "--detach", "--lock", str(scratch), "HEAD")
    assert "locked" in git(vllm, "worktree", "list", "--porcelain")
    old_venv = tmp_path / ".venv.old-1700000000"
    (old_venv / "lib").mkdir(parents=True)
    (old_venv / "lib" / "big").write_bytes(b"x" * 3_000_000)
    art = tmp_path / "artifacts"
    art.mkdir()
    (art / ".ops.tar.zst.999999999.tmp").write_bytes(b"half")
    keep = art / "notes.tmp"  # not a name the rig makes (no leading dot): not the rig's to remove
    keep.write_text("mine")
    env = {**rig_env, "VENV_DIR": str(tmp_path / ".venv"), "ARTIFACTS_DIR": str(art)}
    r = run_rig(env, "tree")
    assert r.code == 0 and "current: tree" in r.out, r.text
    assert f"removed {scratch} (" in r.out and "left by a tree step that was killed" in r.out
    assert f"removed {old_venv} (3 MB), left by a venv step that was killed" in r.out
    assert f"removed {art / '.ops.tar.zst.999999999.tmp'} (0 MB), left by a pack that was killed" in r.out
    assert not scratch.exists() and not old_venv.exists() and keep.exists()
    assert git(vllm, "worktree", "list", "--porcelain").count("worktree ") == 1
    again = run_rig(env, "tree")
    assert "removed" not in again.out


def test_new_patch_is_applied_on_the_kept_base_without_network(series, rig_env, tmp_path):
    assert run_rig(rig_env, "tree").code == 0
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    rig_env["VLLM_UPSTREAM_URL"] = str(tmp_path / "gone")
    r = run_rig(rig_env, "tree")
    assert r.code == 0, r.text
    assert "already in" in r.out
    assert r.fact("tree") == series.tree == tree_of(tmp_path / "vllm")


def test_fetch_1_fetches_again_and_keeps_untracked_files(series, rig_env, tmp_path):
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    assert run_rig(rig_env, "tree").code == 0
    product = tmp_path / "vllm" / "vllm" / "_C.abi3.so"
    product.write_bytes(b"built kernel")
    r = run_rig({**rig_env, "FETCH": "1"}, "tree")
    assert r.code == 0, r.text
    assert "FETCH=1" in r.out and "fetching tag" in r.out
    assert r.fact("tree") == series.tree
    assert product.read_bytes() == b"built kernel"


def test_fetch_1_with_upstream_gone_says_so_and_keeps_the_tree(series, rig_env, tmp_path):
    assert run_rig(rig_env, "tree").code == 0
    head = git(tmp_path / "vllm", "rev-parse", "HEAD")
    r = run_rig({**rig_env, "FETCH": "1", "VLLM_UPSTREAM_URL": str(tmp_path / "gone")}, "tree")
    assert r.code == 2
    assert "the git source" in r.err and str(tmp_path / "gone") in r.err and "VLLM_SOURCE=sdist" in r.err
    assert git(tmp_path / "vllm", "rev-parse", "HEAD") == head


def test_ops_obj_moves_only_with_compiled_inputs(series, rig_env):
    r0 = run_rig(rig_env, "tree")
    assert r0.code == 0, r0.text
    assert r0.fact("ops_obj") == r0.fact("base_ops_obj")
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    r1 = run_rig(rig_env, "tree")
    assert r1.fact("tree") != r0.fact("tree")
    assert r1.fact("ops_obj") == r0.fact("ops_obj")
    series.commit("csrc: patched", CSRC_PATCH)
    accept_current(series)
    r2 = run_rig(rig_env, "tree")
    assert r2.code == 0, r2.text
    assert r2.fact("ops_obj") != r1.fact("ops_obj")
    assert r2.fact("base_ops_obj") == r0.fact("base_ops_obj")


def test_ops_obj_counts_an_absent_path_as_absent(series, rig_env):
    series.ops_paths.append("rust-toolchain.toml")
    accept_current(series)
    r0 = run_rig(rig_env, "tree")
    assert r0.code == 0, r0.text
    series.commit("add a rust toolchain", {"rust-toolchain.toml": "[toolchain]\nchannel = \"1.95\"\n"})
    accept_current(series)
    r1 = run_rig(rig_env, "tree")
    assert r1.code == 0, r1.text
    assert r1.fact("ops_obj") != r0.fact("ops_obj")


def test_added_patch_is_refused_with_both_trees_then_accepted(series, rig_env, tmp_path):
    assert run_rig(rig_env, "tree").code == 0
    old_head = git(tmp_path / "vllm", "rev-parse", "HEAD")
    series.commit("api: patched", PY_PATCH)  # series.toml still expects the old tree
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    old = tomllib.loads((series.patches / "series.toml").read_text())["expected"]["git"]["tree"]
    assert f"expected {old}" in r.err and f"found {series.tree}" in r.err
    assert "--accept" in r.err
    assert git(tmp_path / "vllm", "rev-parse", "HEAD") == old_head  # last good state
    r = run_rig(rig_env, "tree", "--accept")
    assert r.code == 0, r.text
    data = tomllib.loads((series.patches / "series.toml").read_text())
    assert data["expected"]["git"] == {"tree": series.tree, "verified": dt.date.today().isoformat()}
    assert data["ops"]["paths"] == series.ops_paths  # the rest of the file survives
    assert tree_of(tmp_path / "vllm") == series.tree
    assert run_rig(rig_env, "tree").code == 0


def test_build_only_tree_accept_works_too(series, rig_env):
    series.commit("api: patched", PY_PATCH)
    r = run_rig(rig_env, "build", "--only", "tree", "--accept")
    assert r.code == 0, r.text
    assert "[2/8] tree" in r.out


def test_conflicting_patch_names_patch_and_hunk_and_touches_nothing(series, rig_env, tmp_path):
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    head, before = git(vllm, "rev-parse", "HEAD"), (vllm / "vllm/entrypoints/api.py").read_text()
    # A second patch made against the base, not the series: its context no longer matches.
    other = tmp_path / "other"
    git(tmp_path, "clone", "-q", str(series.upstream), str(other))
    git(other, "checkout", "-q", TAG)
    (other / "vllm/entrypoints/api.py").write_text(before.replace("return 'patched'", "return 'other'")
                                                   .replace("'patched'", "'ok'"))
    text = (other / "vllm/entrypoints/api.py").read_text().replace("return 'ok'", "return 'other'")
    (other / "vllm/entrypoints/api.py").write_text(text)
    git(other, "commit", "-q", "-am", "api: other")
    git(other, "format-patch", "-q", "--zero-commit", "--start-number", "2", "-o", str(series.patches), "HEAD~1")
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert "0002-api-other.patch" in r.err
    assert "vllm/entrypoints/api.py: hunk at line" in r.err
    assert "after 0001-api-patched.patch" in r.err
    assert git(vllm, "rev-parse", "HEAD") == head
    assert (vllm / "vllm/entrypoints/api.py").read_text() == before
    assert not list(tmp_path.glob(".vllm.scratch-*"))
    assert git(vllm, "worktree", "list").count("\n") == 0


def test_patch_for_a_missing_file_names_it(series, rig_env, tmp_path):
    series.commit("docs: add", {"docs/new.md": "one\ntwo\n"})
    series.commit("docs: edit", {"docs/new.md": "one\nTWO\n"})
    (series.patches / "0001-docs-add.patch").unlink()  # the edit now targets a file nobody created
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert "0002-docs-edit.patch" in r.err and "docs/new.md" in r.err
    assert not (tmp_path / "vllm").exists()


def test_no_fuzz_a_patch_gnu_patch_would_fuzz_in_is_refused(series, rig_env, tmp_path):
    # Patch line 15 of ops.cpp, made against a copy whose line 13 (context) differs.
    other = tmp_path / "other"
    git(tmp_path, "clone", "-q", str(series.upstream), str(other))
    git(other, "checkout", "-q", TAG)
    src = (other / "csrc/ops.cpp").read_text()
    (other / "csrc/ops.cpp").write_text(src.replace("// line 13\n", "// line thirteen\n"))
    git(other, "commit", "-q", "-am", "context differs")
    (other / "csrc/ops.cpp").write_text((other / "csrc/ops.cpp").read_text().replace("// line 15\n", "// LINE 15\n"))
    git(other, "commit", "-q", "-am", "ops: change line 15")
    git(other, "format-patch", "-q", "--zero-commit", "-o", str(series.patches), "HEAD~1")
    patch = next(series.patches.glob("*.patch"))
    if shutil.which("patch"):  # GNU patch applies it with fuzz: the rig must not
        probe = tmp_path / "probe"
        git(tmp_path, "clone", "-q", str(series.upstream), str(probe))
        git(probe, "checkout", "-q", TAG)
        gnu = subprocess.run(["patch", "-p1", "--dry-run", "-F2", "-i", str(patch)], cwd=probe,
                             capture_output=True, text=True)
        assert gnu.returncode == 0 and "fuzz" in gnu.stdout
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert patch.name in r.err and "csrc/ops.cpp: hunk at line" in r.err


def test_a_plain_diff_is_not_a_mail_patch(series, rig_env):
    (series.patches / "0001-plain.patch").write_text(
        "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-fixture upstream\n+changed\n")
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "0001-plain.patch" in r.err and "mail-format" in r.err and "patches -- new" in r.err


def test_a_patch_without_the_number_prefix_is_refused(series, rig_env):
    series.commit("api: patched", PY_PATCH)
    patch = next(series.patches.glob("*.patch"))
    patch.rename(series.patches / "fix-api.patch")
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "fix-api.patch" in r.err and "NNNN-short-name.patch" in r.err


@pytest.mark.parametrize("name", ["0003-x.diff", "0003-x.PATCH", "0003-x.Patch", "0003-x.patch.orig",
                                  "3-fix.patch", "fix-api", "fix-api.txt"])
def test_a_file_that_looks_like_a_patch_but_would_be_skipped_is_refused(series, rig_env, tmp_path, name):
    """A patch the series would silently skip builds another tree than its author meant: refuse it by name."""
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    patch = next(series.patches.glob("*.patch"))
    patch.rename(series.patches / name)
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert name in r.err and "would not be applied" in r.err and "NNNN-short-name.patch" in r.err
    assert not (tmp_path / "vllm").exists()


def test_notes_and_folders_beside_the_series_are_not_patches(series, rig_env):
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    (series.patches / "README.md").write_text("# The series\n\nHow these patches are kept.\n")
    (series.patches / "optional").mkdir()
    (series.patches / "optional" / "0101-x.patch").write_text("not in the build\n")
    r = run_rig(rig_env, "tree")
    assert r.code == 0, r.text


def test_an_untracked_file_where_a_new_patch_adds_one_is_refused_and_kept(series, rig_env, tmp_path):
    """reset --hard would overwrite it: the user's file stops the landing instead."""
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    mine = vllm / "vllm" / "entrypoints" / "chat.py"
    mine.write_text("my own work, never committed\n")
    nested = vllm / "docs" / "notes"  # a file where the new tree puts a folder
    nested.parent.mkdir(parents=True)
    nested.write_text("mine too\n")
    head = git(vllm, "rev-parse", "HEAD")
    series.commit("chat: new", {"vllm/entrypoints/chat.py": "CHAT = 1\n", "docs/notes/index.md": "new page\n"})
    accept_current(series)
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert "vllm/entrypoints/chat.py" in r.err and "docs/notes" in r.err and "nothing was touched" in r.err
    assert mine.read_text() == "my own work, never committed\n" and nested.read_text() == "mine too\n"
    assert git(vllm, "rev-parse", "HEAD") == head
    mine.unlink()
    nested.unlink()
    (vllm / "vllm" / "_C.abi3.so").write_bytes(b"an untracked file in no new path")
    r = run_rig(rig_env, "tree")
    assert r.code == 0, r.text
    assert (vllm / "vllm" / "_C.abi3.so").read_bytes() == b"an untracked file in no new path"


@pytest.mark.parametrize("edit", ["uncommitted", "committed"])
def test_local_edits_are_refused_and_kept(series, rig_env, tmp_path, edit):
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    (vllm / "README.md").write_text("my local change\n")
    if edit == "committed":
        git(vllm, "commit", "-q", "-am", "local work")
    head = git(vllm, "rev-parse", "HEAD")
    series.commit("api: patched", PY_PATCH)
    accept_current(series)
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "README.md" in r.err and "local edits" in r.err and "nothing was touched" in r.err
    assert (vllm / "README.md").read_text() == "my local change\n"
    assert git(vllm, "rev-parse", "HEAD") == head


@pytest.mark.parametrize("edit", ["uncommitted", "committed"])
def test_following_the_local_edits_fix_exports_them_and_the_tree_is_current(series, rig_env, tmp_path, edit):
    """The fix the refusal names, followed as written: commit in vllm/, then ``patches new``: the edit is a patch
    of the series, its tree recorded, and the tree step is current."""
    assert run_rig(rig_env, "tree").code == 0
    vllm = tmp_path / "vllm"
    (vllm / "README.md").write_text("my local change\n")
    if edit == "committed":
        git(vllm, "commit", "-q", "-am", "readme: my change")
    r = run_rig(rig_env, "tree")
    assert r.code == 2 and "scripts/nox.sh -s patches -- new SHORT-NAME" in r.err, r.text
    if edit == "uncommitted":
        git(vllm, "commit", "-q", "-am", "readme: my change")
    exported = run_rig(rig_env, "patches", "new", "readme")
    assert exported.code == 0, exported.text
    again = run_rig(rig_env, "tree")
    assert again.code == 0, again.text
    assert "runs:" not in again.out and (vllm / "README.md").read_text() == "my local change\n"
    assert [p.name for p in series.patches.glob("*-readme.patch")]


def test_a_plain_diff_moved_out_and_exported_as_the_fix_says_is_current(series, rig_env, tmp_path):
    assert run_rig(rig_env, "tree").code == 0
    plain = series.patches / "0001-plain.patch"
    plain.write_text("--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-fixture upstream\n+changed\n")
    r = run_rig(rig_env, "tree")
    assert r.code == 2 and "move it out of" in r.err and "patches -- new SHORT-NAME" in r.err, r.text
    plain.rename(tmp_path / plain.name)
    vllm = tmp_path / "vllm"
    applied = subprocess.run(["git", "apply", str(tmp_path / plain.name)], cwd=vllm, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    git(vllm, "commit", "-q", "-am", "readme: changed")
    exported = run_rig(rig_env, "patches", "new", "readme")
    assert exported.code == 0, exported.text
    assert run_rig(rig_env, "tree").code == 0


def test_vllm_dir_that_is_not_a_repository_is_refused(series, rig_env, tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "notes.txt").write_text("mine\n")
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "not its own git repository" in r.err and "mv " in r.err
    assert (tmp_path / "vllm" / "notes.txt").read_text() == "mine\n"


def test_tree_mismatch_leaves_last_good_state(series, rig_env, tmp_path):
    assert run_rig(rig_env, "tree").code == 0
    good = tree_of(tmp_path / "vllm")
    series.commit("api: patched", PY_PATCH)
    series.write_toml({"git": "0" * 40})
    r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "expected " + "0" * 40 in r.err and series.tree in r.err
    assert tree_of(tmp_path / "vllm") == good


@pytest.mark.parametrize("case", ["missing", "malformed", "no-table", "bad-tree"])
def test_bad_series_toml(series, rig_env, case):
    toml = series.patches / "series.toml"
    if case == "missing":
        toml.unlink()
        want = "no such file"
    elif case == "malformed":
        toml.write_text("[upstream\nversion = 1\n")
        want = "valid TOML"
    elif case == "no-table":
        series.write_toml({})
        want = "[expected.git]"
    else:
        series.write_toml({"git": "not-a-tree"})
        want = "40-hex"
    r = run_rig(rig_env, "tree")
    assert r.code == 2, r.text
    assert want in r.err and "series.toml" in r.err and "Fix:" in r.err
    if case in ("no-table", "bad-tree"):  # the fix followed: the table gone, then the built tree recorded
        if case == "bad-tree":
            assert "delete the [expected.git] table" in r.err
            series.write_toml({})
        assert "./build.sh --only tree --accept" in r.err
        accepted = run_rig(rig_env, "tree", "--accept")
        assert accepted.code == 0, accepted.text
        assert run_rig(rig_env, "tree").code == 0


def test_second_build_is_told_who_holds_the_lock(series, rig_env, tmp_path):
    lock = tmp_path / "state" / "build.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write("pid 4242 (build, since 2026-12-02 10:00:00)\n")
        fh.flush()
        r = run_rig(rig_env, "tree")
    assert r.code == 2
    assert "pid 4242" in r.err and "wait for that build" in r.err
    assert not (tmp_path / "vllm").exists()
    assert run_rig(rig_env, "tree").code == 0  # free again once the holder is gone


def test_two_state_folders_on_one_checkout_share_the_venvs_and_the_trees_locks(series, rig_env, tmp_path):
    """The lock sits beside the venv and the tree: a build from another RIG_STATE that would install into the
    same venv is refused, naming the venv's lock and its holder, and gets it once the holder is gone."""
    from rig.build.buildlock import BuildLock
    from rig.facts import config
    env = {**rig_env, "VENV_DIR": str(tmp_path / "venv")}
    other = config.settings({**env, "RIG_STATE": str(tmp_path / "other-state")}, root=ROOT)
    with BuildLock(other, "a build from the other state folder"):
        r = run_rig(env, "tree")
    assert r.code == 2, r.text
    assert f"the build lock {tmp_path / 'venv.build.lock'}" in r.err, r.err
    assert "a build from the other state folder" in r.err and "Fix:" in r.err
    assert not (tmp_path / "vllm").exists()
    assert not (tmp_path / "state" / "build.lock").read_text().strip()  # the state's lock it took was let go
    assert run_rig(env, "tree").code == 0
