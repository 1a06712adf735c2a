"""Steps 6 and 7 on the fixture upstream, whose setup.py builds a real C++ extension through CMake and ccache."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WHEEL, Index, run_rig

from rig.base import venvs
from rig.build.buildlock import BuildLock
from rig.build.kernels import route
from rig.facts import config, products, record

PY_PATCH = {"vllm/entrypoints/api.py": "".join(f"# api line {i}\n" for i in range(1, 31))
            + "def serve():\n    return 'patched'\n"}
CSRC_PATCH = {"csrc/ops.cpp": "".join(f"// line {i}\n" for i in range(1, 21))
              + "int vllm_fixture_op(int x) { return x + 2; }\n"}
STEPS = "tree,ops,install"


def accept(series) -> None:
    series.write_toml({"git": series.tree})


def venv_py(env) -> str:
    return str(Path(env["VENV_DIR"]) / "bin" / "python")


def op_result(env, x: int = 1) -> str:
    r = subprocess.run([venv_py(env), "-c", f"import vllm._C_stable_libtorch as m; print(m.op({x}))"],
                       capture_output=True, text=True, cwd="/")
    return r.stdout.strip() or r.stderr.strip()


def logs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "logs").glob("build-*.log"))


def test_python_only_series_takes_the_precompiled_route(series, ops_env, tmp_path):
    env, idx = ops_env
    series.commit("api: patched", PY_PATCH)
    accept(series)
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0, r.text[-3000:]
    assert r.fact("route") == "precompiled"
    assert "[extract] vllm/_C_stable_libtorch.abi3.so" in r.out
    assert f"files/{WHEEL}" in r.out  # downloaded from the index, then hash-checked
    assert op_result(env) == "2"  # the official wheel's kernel, built from the base
    assert "link layer" in r.out and "only the link layer was checked" in r.out
    rec = products.read(tmp_path / "vllm")
    assert rec.facts["route"] == "precompiled" and set(rec.files) == {"vllm/_C_stable_libtorch.abi3.so"}
    sums = (tmp_path / "vllm" / products.SUMS).read_text()
    check = subprocess.run(["sha256sum", "-c", products.SUMS], cwd=tmp_path / "vllm", capture_output=True, text=True)
    assert check.returncode == 0 and "OK" in check.stdout, sums
    assert "vllm/_version.py" not in subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path / "vllm",
                                                    capture_output=True, text=True).stdout
    again = run_rig(env, "build", "--only", STEPS)
    assert again.code == 0 and again.out.count("current:") == 3, again.out


def test_compile_route_with_ccache_log_and_status_lines(series, ops_env, tmp_path):
    env, _ = ops_env
    series.commit("csrc: x + 2", CSRC_PATCH)
    accept(series)
    r = run_rig({**env, "STATUS_INTERVAL": "1", "FIXTURE_SLOW": "3", "MAX_JOBS": "2"}, "build", "--only", STEPS)
    assert r.code == 0, r.text[-3000:]
    assert r.fact("route") == "compile" and "csrc/ops.cpp" in r.out
    assert op_result(env) == "3"  # x + 2: the patched kernel was compiled
    status = [ln for ln in r.out.splitlines() if re.search(r"\[compile\] \d+m\d\ds", ln)]  # however slow the box
    assert status and "last compiled: csrc/" in status[-1] and "ccache 0 hit(s) / 2 miss(es)" in status[-1], status
    assert "MAX_JOBS=2" in r.out and "ccache=on" in r.out
    log = logs(tmp_path)[-1]
    text = log.read_text()
    assert "ccache" in text and "ops.cpp" in text  # the compiler lines, with their launcher
    assert "0 hit(s), " in r.out  # a cold ccache: misses only
    # --force compiles again: this time ccache hits
    r2 = run_rig({**env, "MAX_JOBS": "2"}, "build", "--only", STEPS, "--force")
    assert r2.code == 0, r2.text[-2000:]
    hits = [ln for ln in r2.out.splitlines() if "in this run" in ln]
    assert hits and not hits[-1].strip().startswith("ccache: 0 hit"), hits


def test_python_only_patch_after_a_compile_needs_no_compile(series, ops_env, tmp_path):
    env, _ = ops_env
    series.commit("csrc: x + 2", CSRC_PATCH)
    accept(series)
    assert run_rig(env, "build", "--only", STEPS).code == 0
    n_logs = len(logs(tmp_path))
    series.commit("api: patched", PY_PATCH)
    accept(series)
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0, r.text[-2000:]
    assert "current: 1 products" in r.out and "current: vllm" in r.out
    assert len(logs(tmp_path)) == n_logs  # no pip run at all
    out = subprocess.run([venv_py(env), "-c", "import vllm.entrypoints.api as a; print(a.serve())"],
                         capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "patched"  # the editable install runs the tree's new Python


def test_verify_rehashes_and_catches_a_same_size_change(series, ops_env, tmp_path):
    env, _ = ops_env
    assert run_rig(env, "build", "--only", STEPS).code == 0
    so = tmp_path / "vllm" / "vllm" / "_C_stable_libtorch.abi3.so"
    st = so.stat()
    data = bytearray(so.read_bytes())
    data[-1] ^= 0xFF
    so.write_bytes(bytes(data))
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))
    fast = run_rig(env, "build", "--only", "ops")
    assert "current:" in fast.out  # size and mtime cannot see it
    r = run_rig(env, "build", "--only", "ops", "--verify")
    assert r.code == 0, r.text[-2000:]
    assert "sha256 differs" in r.out
    assert products.mismatches(tmp_path / "vllm", products.read(tmp_path / "vllm"), rehash=True) == []


def test_compile_failure_names_the_log_and_the_first_error(series, ops_env, tmp_path):
    env, _ = ops_env
    series.commit("csrc: broken", {"csrc/ops.cpp": "int vllm_fixture_op(int x) { return x + ; }\n"})
    accept(series)
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 1, r.text[-2000:]
    log = logs(tmp_path)[-1]
    assert str(log) in r.err and "First error:" in r.err and "error" in r.err.split("First error:")[1].lower()
    assert "ops.cpp" in r.err.split("First error:")[1]
    assert products.read(tmp_path / "vllm") is None


def test_wheel_hash_mismatch_is_refused(series, ops_env, tmp_path, fixture_wheel):
    env, idx = ops_env
    bad = Index(tmp_path / "bad-index", {WHEEL: fixture_wheel}, {WHEEL: "ee" * 32})
    try:
        r = run_rig({**env, "INDEX_URL": bad.url}, "build", "--only", STEPS)
    finally:
        bad.stop()
    assert r.code == 2, r.text[-2000:]
    assert WHEEL in r.err and "ee" * 32 in r.err
    assert products.read(tmp_path / "vllm") is None


def test_force_rebuilds_a_current_tree(series, ops_env):
    env, _ = ops_env
    assert run_rig(env, "build", "--only", STEPS).code == 0
    r = run_rig(env, "build", "--only", "ops", "--force")
    assert r.code == 0 and "runs: --force" in r.out and "[extract]" in r.out


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_vllm_removed_or_replaced_by_hand_is_reinstalled(series, ops_env, tmp_path, fixture_wheel, how):
    env, _ = ops_env
    assert run_rig(env, "build", "--only", STEPS).code == 0
    if how == "removed":
        subprocess.run([venv_py(env), "-m", "pip", "uninstall", "-y", "-q", "vllm"], check=True)
        want = "vllm is not installed"
    else:  # a plain (not editable) install of the tree, made by hand
        hand = {**os.environ, "VLLM_VERSION_OVERRIDE": "0.30.0",
                "VLLM_PRECOMPILED_WHEEL_LOCATION": str(tmp_path / "cache" / "dist" / WHEEL)}
        subprocess.run([venv_py(env), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--force-reinstall", str(tmp_path / "vllm")], check=True, env=hand, capture_output=True)
        want = "plain install"
    version, wrong = venvs.installed_vllm(env["VENV_DIR"], env["VLLM_DIR"])
    assert version == (None if how == "removed" else "0.30.0") and want in wrong, wrong
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0, r.text[-2000:]
    # removed: the install step reinstalls; replaced: the hand install also rewrote the kernels, so ops runs first
    assert (want in r.out and "reinstalling" in r.out) or "product(s) differ" in r.out, r.out
    assert venvs.installed_vllm(env["VENV_DIR"], env["VLLM_DIR"]) == ("0.30.0", "")
    assert op_result(env) == "2"
    again = run_rig(env, "build", "--only", STEPS)  # the repair left every record true: nothing to redo
    assert again.code == 0 and again.out.count("current:") == 3, again.out


def test_kill_9_during_the_build_is_not_trusted(series, ops_env, tmp_path):
    env, _ = ops_env
    series.commit("csrc: x + 2", CSRC_PATCH)
    accept(series)
    assert run_rig(env, "build", "--only", STEPS).code == 0
    series.commit("csrc: x + 3", {"csrc/ops.cpp": CSRC_PATCH["csrc/ops.cpp"].replace("x + 2", "x + 3")})
    accept(series)
    p = subprocess.Popen([sys.executable, "-m", "rig.cli", "build", "--only", STEPS], cwd=ROOT,
                         env={**env, "FIXTURE_SLOW": "60"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    for line in p.stdout:
        if "fixture: still working" in line:
            break
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert products.read(tmp_path / "vllm") is None  # the old record was dropped before the build began
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0, r.text[-2000:]
    assert "runs: no build record" in r.out
    assert op_result(env) == "4"


def test_sigterm_during_the_build_is_not_trusted(series, ops_env, tmp_path):
    env, _ = ops_env
    series.commit("csrc: x + 2", CSRC_PATCH)
    accept(series)
    p = subprocess.Popen([sys.executable, "-m", "rig.cli", "build", "--only", STEPS], cwd=ROOT,
                         env={**env, "FIXTURE_SLOW": "60"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    for line in p.stdout:
        if "fixture: still working" in line:
            break
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode != 0, rest
    assert products.read(tmp_path / "vllm") is None
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0 and "runs: no build record" in r.out


def test_disk_full_while_writing_the_record(series, ops_env, tmp_path):
    env, _ = ops_env
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        env = {**env, "VLLM_DIR": str(mnt / "vllm")}
        assert run_rig(env, "build", "--only", "tree").code == 0
        r = run_rig({**env, "FIXTURE_FILL_DISK": str(mnt / "filler")}, "build", "--only", "ops")
        assert r.code == 1, r.text[-2000:]
        assert "expected written, found it could not be written: No space left" in r.err and "free disk" in r.err
        assert "the build record" in r.err
        assert not (mnt / "vllm" / products.RECORD).exists()
        assert not list((mnt / "vllm").glob(".build-products*"))
        (mnt / "filler").unlink()
        r = run_rig(env, "build", "--only", "ops")
        assert r.code == 0 and "runs: no build record" in r.out, r.text[-2000:]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_patch_to_a_file_the_wheel_overwrites_forces_the_compile_route(series, ops_env, tmp_path):
    env, _ = ops_env
    series.ops_paths.remove("vllm/third_party")
    series.commit("flashmla: tweak the interface", {"vllm/third_party/flashmla/flash_mla_interface.py": "X = 1\n"})
    accept(series)
    r = run_rig({**env, "OPS_ROUTE": "precompiled"}, "build", "--only", STEPS)
    assert r.code == 2
    assert "OPS_ROUTE=precompiled" in r.err and "flash_mla_interface.py" in r.err
    r = run_rig(env, "build", "--only", STEPS)
    assert r.code == 0, r.text[-2000:]
    assert r.fact("route") == "compile" and "precompiled kernels overwrite" in r.out


def test_overwritten_matches_vllm_setup_rules():
    assert route.overwritten(["vllm/vllm_flash_attn/layers/rotary.py", "vllm/vllm_flash_attn/__init__.py",
                            "vllm/vllm_flash_attn/flash_attn_interface.py", "vllm/third_party/deep_gemm/x.cuh",
                            "vllm/_rust_tool_parser.abi3.so", "vllm/entrypoints/api.py", "vllm/vllm-rs"]) == [
        "vllm/vllm_flash_attn/layers/rotary.py", "vllm/third_party/deep_gemm/x.cuh",
        "vllm/_rust_tool_parser.abi3.so", "vllm/vllm-rs"]
    _ = time


def test_pack_once_then_current_then_repacked_without_compiling(series, ops_env, tmp_path):
    env, _ = ops_env
    env = {**env, "ARTIFACTS_DIR": str(tmp_path / "artifacts")}
    r = run_rig(env, "build", "--only", STEPS + ",pack")
    assert r.code == 0, r.text[-2000:]
    assert "[8/8] pack" in r.out and (tmp_path / "artifacts" / "manifest.toml").exists()
    again = run_rig(env, "build", "--only", "pack")
    assert "current:" in again.out
    n_logs = len(logs(tmp_path))
    (tmp_path / "artifacts" / "ops.sha256").unlink()
    r = run_rig(env, "build", "--only", "pack")
    assert r.code == 0 and "ops.sha256 is missing" in r.out and "no compile" in r.out, r.out
    assert len(logs(tmp_path)) == n_logs
    skipped = run_rig({**env, "PACK": "0"}, "build", "--only", "pack")
    assert "skipped (--no-pack or PACK=0)" in skipped.out
    (tmp_path / "artifacts" / "ops.sha256").unlink()
    packed = run_rig({**env, "PACK": "0"}, "pack")  # nox -s pack: PACK=0 is the build's, this packs
    assert packed.code == 0 and "ops.sha256 is missing" in packed.out, packed.out
    assert (tmp_path / "artifacts" / "ops.sha256").is_file()
    # a tarball swapped for another valid one of the same kernels: not the one this build packed
    other = tmp_path / "other"
    from rig.build import artifacts
    from rig.build.steps.pack import manifest_facts
    s = config.settings(env)
    vllm_dir = s.vllm_dir
    facts = manifest_facts(s, record.load(s.state_dir, s.device))
    copy = tmp_path / "copy"  # the same files, copied a second later: other mtimes in the tar headers
    time.sleep(1.1)
    for rel in [*products.read(vllm_dir).files, products.SUMS]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vllm_dir / rel, copy / rel)
    artifacts.pack(copy, other, facts, progress=False)
    for name in ("ops.tar.zst", "manifest.toml"):
        shutil.copy(other / name, tmp_path / "artifacts" / name)
    r = run_rig(env, "build", "--only", "pack")
    assert r.code == 0 and "names tarball sha256" in r.out and "this build packed" in r.out, r.out
    assert "current:" in run_rig(env, "build", "--only", "pack").out
    # verify: the build's own record is the set; its scratch is the rig's; it takes the build lock
    scratch = Path(env["RIG_STATE"]) / "verify-dest"
    (scratch / "vllm").mkdir(parents=True)
    (scratch / "vllm" / "half.so").write_bytes(b"x")
    v = run_rig(env, "verify")
    assert v.code == 0 and "fits this target" in v.out, v.text
    assert f"kernels of this tree ({vllm_dir / '.build-products'})" in v.out
    assert f"removed {scratch} (0 MB), left by a verify that was killed" in v.out and not scratch.exists()
    with BuildLock(s, "a build"):
        locked = run_rig(env, "verify")
    assert locked.code == 2 and "the build lock" in locked.err and "a build" in locked.err, locked.text
    bad = run_rig({**env, "ARCH": "7.0"}, "verify")
    assert bad.code == 2 and "architectures" in bad.err and "'7.0'" in bad.err
