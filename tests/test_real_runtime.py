"""Steps 3-5 for real: the committed lock (CUDA torch, several GB, from the uv cache) and the wheel toolkit."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ROOT, run_rig

from rig.build.steps import toolchain

pytestmark = pytest.mark.slow


def test_real_lock_installs_with_cuda_torch(real_venv):
    r, env, d = real_venv
    assert r.code == 0, r.text[-3000:]
    print(f"\npins: {r.fact('pins')}; {[ln.strip() for ln in r.out.splitlines() if 'venv size' in ln]}")
    torch_cuda = subprocess.run([str(d / ".venv/bin/python"), "-c",
                                 "import torch; print(torch.__version__, torch.version.cuda)"],
                                capture_output=True, text=True)
    assert torch_cuda.stdout.split()[0].startswith("2.13.0") and torch_cuda.stdout.split()[1].startswith("13.")


def test_wheel_toolkit_is_chosen_and_matches_torch(real_venv):
    r, _, d = real_venv
    assert r.fact("cuda_home") == str(d / ".venv/lib/python3.13/site-packages/nvidia/cu13")
    assert r.fact("nvcc_version").startswith("13.")


def test_stub_lives_beside_the_wheel_toolkit_and_cmake_finds_it_alone(real_venv, tmp_path, tools_state):
    r, _, d = real_venv
    if toolchain.driver_loadable():
        assert r.fact("cuda_stub") == ""
        return
    stub = r.fact("cuda_stub")
    assert stub.endswith("nvidia/cu13/lib/stubs/libcuda.so.1")
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.26)\nproject(s LANGUAGES C)\nfind_package(CUDAToolkit REQUIRED)\n"
        "add_executable(t main.c)\ntarget_link_libraries(t PRIVATE CUDA::cuda_driver)\n")
    (src / "main.c").write_text("#include <cuda.h>\nint main(void) { return (int)cuInit(0); }\n")
    cmake = tools_state[1]["cmake"]
    root = r.fact("cuda_home")
    c = subprocess.run([cmake, "-S", str(src), "-B", str(tmp_path / "b"), f"-DCUDAToolkit_ROOT={root}"],
                       capture_output=True, text=True)
    assert c.returncode == 0, c.stderr
    b = subprocess.run([cmake, "--build", str(tmp_path / "b")], capture_output=True, text=True)
    assert b.returncode == 0, b.stdout
    dyn = subprocess.run(["readelf", "-d", str(tmp_path / "b" / "t")], capture_output=True, text=True).stdout
    assert "[libcuda.so.1]" in dyn and "stubs" not in dyn


def test_rerun_of_steps_3_to_5_is_current(real_venv):
    _, env, _ = real_venv
    r = run_rig(env, "build", "--only", "venv,runtime,toolchain")
    assert r.code == 0, r.text
    assert r.out.count("current:") == 3, r.out


def test_lock_session_regenerates_an_equivalent_lock(tmp_path):
    """nox -s lock resolves the same pins again (needs the network)."""
    env = {**os.environ, "RUNTIME_LOCK": str(tmp_path / "runtime.lock")}
    r = run_rig(env, "lock", timeout=600)
    assert r.code == 0, r.text
    from rig.build.steps.runtime import read_lock
    new, old = read_lock(tmp_path / "runtime.lock"), read_lock(ROOT / "scripts/runtime.lock")
    assert new.pins["torch"][0] == old.pins["torch"][0] == "2.13.0"
    assert abs(len(new.pins) - len(old.pins)) <= 10
