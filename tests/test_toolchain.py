"""Step 5 pieces on the real CUDA toolkit of this machine: the driver stub through CMake, the major check."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from rig.base.errors import BadInput
from rig.build import cudastub
from rig.build.steps import toolchain
from rig.facts import config

SYSTEM = Path("/usr/local/cuda")
needs_toolkit = pytest.mark.skipif(not (SYSTEM / "include" / "cuda.h").exists(), reason="no CUDA toolkit here")
CMAKE_PROJECT = """cmake_minimum_required(VERSION 3.25)
project(stubcheck LANGUAGES C)
find_package(CUDAToolkit REQUIRED)
add_executable(calls_cuinit main.c)
target_link_libraries(calls_cuinit PRIVATE CUDA::cuda_driver)
"""
MAIN_C = "#include <cuda.h>\nint main(void) { return cuInit(0) == CUDA_SUCCESS ? 0 : 1; }\n"


@pytest.fixture
def cmake(tools_state) -> str:
    """The tools step's cmake (>= 3.26, which keeps `stubs` folders out of the RUNPATH it writes)."""
    return tools_state[1]["cmake"]


def configure(cmake: str, tmp_path: Path, name: str, *defs: str) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "CMakeLists.txt").write_text(CMAKE_PROJECT)
    (src / "main.c").write_text(MAIN_C)
    return subprocess.run([cmake, "-S", str(src), "-B", str(tmp_path / name), f"-DCUDAToolkit_ROOT={SYSTEM}",
                           *defs], capture_output=True, text=True)


@needs_toolkit
def test_without_the_stub_cuda_driver_is_not_found(tmp_path, cmake):
    if toolchain.driver_loadable():
        pytest.skip("a real driver is here")
    r = configure(cmake, tmp_path, "no-stub")
    assert r.returncode != 0
    assert "CUDA::cuda_driver" in r.stderr and "target was not found" in r.stderr


@needs_toolkit
def test_with_the_stub_cuinit_links_and_the_soname_is_libcuda_so_1(tmp_path, cmake):
    script = ROOT / "scripts" / "gen-cuda-stub.sh"
    stubs = tmp_path / "lib" / "stubs"
    out = subprocess.run([str(script), "--cuda-h", str(SYSTEM / "include/cuda.h"), "--out", str(stubs)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    print("\n" + out.stdout.strip())
    n = int(out.stdout.split(": ")[1].split()[0])
    assert n > 500
    soname = subprocess.run(["readelf", "-d", str(stubs / "libcuda.so.1")], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in soname
    r = configure(cmake, tmp_path, "with-stub", f"-DCUDA_cuda_driver_LIBRARY={stubs / 'libcuda.so'}")
    assert r.returncode == 0, r.stderr
    b = subprocess.run([cmake, "--build", str(tmp_path / "with-stub")], capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    exe = tmp_path / "with-stub" / "calls_cuinit"
    dyn = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert "Shared library: [libcuda.so.1]" in dyn
    assert str(stubs) not in dyn, "the stub folder must be on no loader path"
    if not toolchain.driver_loadable():
        run = subprocess.run([str(exe)], capture_output=True, text=True)
        assert run.returncode == 127 and "libcuda.so.1" in run.stderr


@needs_toolkit
def test_stub_covers_versioned_names_the_header_maps_to():
    names = set(cudastub.entry_points(SYSTEM / "include" / "cuda.h"))
    for n in ("cuInit", "cuMemAlloc_v2", "cuMemAlloc", "cuCtxCreate_v4", "cuMemcpyHtoD_v2_ptds",
              "cuLaunchKernel_ptsz", "cuDeviceTotalMem_v2"):
        assert n in names, n


def test_unparseable_cuda_h_names_the_line(tmp_path):
    h = tmp_path / "cuda.h"
    h.write_text("/* header */\nCUresult CUDAAPI cuInit(unsigned int);\n#define cuMemAlloc cuMemAlloc_v2\n"
                 "CUresult CUDAAPI 2bad(int);\n")
    with pytest.raises(BadInput) as e:
        cudastub.entry_points(h)
    assert f"{h}:4" in e.value.message and "2bad" in e.value.message
    h.write_text("CUresult CUDAAPI cuInit(unsigned int);\n#define cuMemAlloc (cuMemAlloc_v2 + 1)\n")
    with pytest.raises(BadInput) as e:
        cudastub.entry_points(h)
    assert f"{h}:2" in e.value.message
    r = subprocess.run([str(ROOT / "scripts/gen-cuda-stub.sh"), "--cuda-h", str(h), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and f"{h}:2" in r.stderr
    assert not (tmp_path / "o" / "libcuda.so.1").exists()


@needs_toolkit
def test_toolkit_of_another_major_is_refused():
    s = config.settings({"CUDA_HOME": str(SYSTEM)})
    ver = toolchain.nvcc_version(SYSTEM / "bin" / "nvcc")
    major = int(ver.split(".")[0])
    assert toolchain.find_toolkit(s, major).version == ver
    with pytest.raises(BadInput) as e:
        toolchain.find_toolkit(s, major - 1)
    assert f"CUDA {major - 1}.x" in e.value.message and f"CUDA {ver}" in e.value.message
    assert "CUDA_HOME" in e.value.message
