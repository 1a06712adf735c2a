"""The fixture upstream: a small vLLM-shaped source tree whose setup.py builds a real extension.

Standard library only, so tests/test_gpu.py can use it on the device machine (no pytest there).
"""

from __future__ import annotations

from pathlib import Path

FIXTURE_SETUP_PY = r'''"""Fixture upstream: builds vllm._C_stable_libtorch, a real CPython extension, with CMake.

Like vLLM's setup.py it honours VLLM_VERSION_OVERRIDE, MAX_JOBS, TORCH_CUDA_ARCH_LIST, CMAKE_ARGS,
ccache on PATH as the compiler launcher, and VLLM_USE_PRECOMPILED / VLLM_PRECOMPILED_WHEEL_LOCATION
(copy the kernels out of a wheel into the tree instead of compiling).
"""
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
WHEEL = os.environ.get("VLLM_PRECOMPILED_WHEEL_LOCATION")
PRECOMPILED = os.environ.get("VLLM_USE_PRECOMPILED") == "1" or bool(WHEEL)
NAME = "_C_stable_libtorch.abi3.so"


def fill_disk():
    target = os.environ.get("FIXTURE_FILL_DISK")
    if target:
        with open(target, "wb") as fh:
            try:
                while True:
                    fh.write(b"x" * 65536)
                    fh.flush()
            except OSError:
                pass


class cmake_build_ext(build_ext):
    def run(self):
        dest = ROOT / "vllm" / NAME
        if PRECOMPILED:
            with zipfile.ZipFile(WHEEL) as whl:
                for m in whl.namelist():
                    if m.startswith("vllm/") and m.endswith(".so"):
                        print(f"[extract] {m}")
                        (ROOT / m).write_bytes(whl.read(m))
            print("Skipping build_ext: using precompiled extensions.")
            fill_disk()
            return
        build = ROOT / "build" / "cmake"
        args = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython3_EXECUTABLE={sys.executable}"]
        launcher = shutil.which("ccache")
        if launcher:
            args += [f"-DCMAKE_{lang}_COMPILER_LAUNCHER={launcher}" for lang in ("C", "CXX", "CUDA", "HIP")]
        if os.environ.get("FIXTURE_CUDA") == "1":
            archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.6").replace(";", " ").split()
            args += ["-DFIXTURE_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(a.replace(".", "") for a in archs)]
        args += os.environ.get("CMAKE_ARGS", "").split()
        subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", str(build), "-j", os.environ.get("MAX_JOBS", "1"), "--verbose"])
        for _ in range(int(os.environ.get("FIXTURE_SLOW", "0"))):
            print("fixture: still working", flush=True)
            time.sleep(1)
        if not (self.inplace or getattr(self, "editable_mode", False)):
            dest = Path(self.build_lib) / "vllm" / NAME
            dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / NAME, dest)
        fill_disk()


setup(
    version=os.environ.get("VLLM_VERSION_OVERRIDE") or "0.1.dev1+gfixture",
    packages=find_packages(include=["vllm", "vllm.*"]),
    ext_modules=[Extension("vllm._C_stable_libtorch", sources=[])],
    cmdclass={"build_ext": cmake_build_ext},
)
'''

FIXTURE_CMAKE = """cmake_minimum_required(VERSION 3.26)
project(vllm_fixture LANGUAGES C CXX)
option(FIXTURE_CUDA "build the CUDA kernel too" OFF)
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
set(SRC csrc/module.cpp csrc/ops.cpp)
if(FIXTURE_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  list(APPEND SRC csrc/kernel.cu)
endif()
Python3_add_library(_C_stable_libtorch MODULE ${SRC})
set_target_properties(_C_stable_libtorch PROPERTIES PREFIX "" SUFFIX ".abi3.so")
if(FIXTURE_CUDA)
  target_compile_definitions(_C_stable_libtorch PRIVATE FIXTURE_CUDA)
  target_link_libraries(_C_stable_libtorch PRIVATE CUDA::cudart CUDA::cuda_driver)
endif()
"""

FIXTURE_MODULE = r"""#include <Python.h>
int vllm_fixture_op(int x);
#ifdef FIXTURE_CUDA
int fixture_cuda_add(int a, int b);
static PyObject *cuda_add(PyObject *, PyObject *args) {
  int a, b;
  if (!PyArg_ParseTuple(args, "ii", &a, &b)) return NULL;
  return PyLong_FromLong(fixture_cuda_add(a, b));
}
#endif
static PyObject *op(PyObject *, PyObject *args) {
  int x;
  if (!PyArg_ParseTuple(args, "i", &x)) return NULL;
  return PyLong_FromLong(vllm_fixture_op(x));
}
static PyMethodDef methods[] = {
  {"op", op, METH_VARARGS, "the fixture's op"},
#ifdef FIXTURE_CUDA
  {"cuda_add", cuda_add, METH_VARARGS, "a + b on the GPU"},
#endif
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_C_stable_libtorch", NULL, -1, methods};
PyMODINIT_FUNC PyInit__C_stable_libtorch(void) { return PyModule_Create(&mod); }
"""

FIXTURE_KERNEL = r"""#include <cuda.h>
#include <cuda_runtime.h>
__global__ void add_kernel(int a, int b, int *out) { *out = a + b; }
int fixture_cuda_add(int a, int b) {
  if (cuInit(0) != CUDA_SUCCESS) return -1;
  CUdevice dev;
  if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS) return -2;
  int *d = 0, h = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return -3;
  add_kernel<<<1, 1>>>(a, b, d);
  if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) return -4;
  cudaFree(d);
  return h;
}
"""

# The files of the small upstream: vLLM's layout, with a setup.py that builds a real extension.
UPSTREAM_FILES = {
    "CMakeLists.txt": FIXTURE_CMAKE,
    "cmake/utils.cmake": "# helpers\nfunction(fixture_helper)\nendfunction()\n",
    "csrc/ops.cpp": "".join(f"// line {i}\n" for i in range(1, 21)) + "int vllm_fixture_op(int x) { return x + 1; }\n",
    "csrc/module.cpp": FIXTURE_MODULE,
    "csrc/kernel.cu": FIXTURE_KERNEL,
    "setup.py": FIXTURE_SETUP_PY,
    "pyproject.toml": "[build-system]\nrequires = [\"setuptools>=64\"]\nbuild-backend = \"setuptools.build_meta\"\n\n"
                      "[project]\nname = \"vllm\"\ndynamic = [\"version\"]\nrequires-python = \">=3.10\"\n",
    "requirements/build.txt": "cmake>=3.26\nninja\n",
    "requirements/common.txt": "requests\n",
    "vllm/__init__.py": "__version__ = \"0.30.0\"\n",
    "vllm/envs.py": "MAX_JOBS = None\n",
    "vllm/third_party/__init__.py": "",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/api.py": "".join(f"# api line {i}\n" for i in range(1, 31)) + "def serve():\n    return 'ok'\n",
    "README.md": "fixture upstream\n",
}


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
