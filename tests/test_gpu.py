"""GPU-only checks, for the device machine: they skip cleanly where no NVIDIA driver is present.

  python3 tests/test_gpu.py      # without pytest (the device machine has none)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.build import cudastub  # noqa: E402 - standard library only, like this file
from rig.build.cudastub import driver_loadable  # noqa: E402

try:
    import pytest

    pytestmark = pytest.mark.skipif(not driver_loadable(), reason="no NVIDIA driver (libcuda.so.1) here")
except ImportError:  # run as a script
    pytest = None

TINY_CU = r"""
#include <cuda.h>
#include <cuda_runtime.h>
__global__ void add(int a, int b, int *out) { *out = a + b; }
extern "C" int tiny_add(int a, int b) {
    if (cuInit(0) != CUDA_SUCCESS) return -1;          /* the driver API: libcuda.so.1 */
    CUdevice dev; if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS) return -2;
    int *d = 0, h = 0;
    if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return -3;
    add<<<1, 1>>>(a, b, d);
    if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) return -4;
    cudaFree(d);
    return h;
}
"""
LOADER = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
print("tiny_add(2, 40) =", lib.tiny_add(2, 40))
for line in open("/proc/self/maps"):
    if "libcuda.so" in line:
        print("mapped:", line.split()[-1]); break
"""


def cuda_home() -> Path:
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda.h").exists():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    return Path(os.path.realpath(nvcc)).parent.parent


def test_extension_built_against_the_stub_loads_the_real_driver(tmp_path: Path | None = None) -> None:
    tmp = Path(tmp_path or tempfile.mkdtemp())
    home = cuda_home()
    stubs = tmp / "lib" / "stubs"
    lib, n = cudastub.build(home / "include" / "cuda.h", stubs)
    print(f"stub: {lib} ({n} entry points)")
    so = tmp / "libtiny.so"
    r = subprocess.run([str(home / "bin" / "nvcc"), "-shared", "-Xcompiler", "-fPIC", "-o", str(so),
                        str(_write(tmp / "tiny.cu", TINY_CU)), f"-L{stubs}", "-lcuda"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    assert "[libcuda.so.1]" in dyn and str(stubs) not in dyn
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"} | {"LD_LIBRARY_PATH": str(home / "lib64")}
    run = subprocess.run([sys.executable, "-c", LOADER, str(so)], capture_output=True, text=True, env=env)
    print(run.stdout + run.stderr)
    assert "tiny_add(2, 40) = 42" in run.stdout
    mapped = run.stdout.split("mapped: ", 1)[1].split()[0]
    assert not mapped.startswith(str(stubs)), f"the stub was loaded at run time: {mapped}"
    assert os.path.realpath(mapped) != os.path.realpath(lib)


def test_fixture_kernel_compiled_by_the_ops_step_for_sm90_runs_on_the_gpu(tmp_path: Path | None = None) -> None:
    """The compile route of rig/build/steps/ops.py on the fixture upstream with ARCH=9.0 and a real CUDA kernel."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixture_upstream import UPSTREAM_FILES, write_files

    from rig.build.kernels import pip
    from rig.facts import config, products, record

    tmp = Path(tmp_path or tempfile.mkdtemp())
    tree, venv = tmp / "vllm", tmp / "venv"
    write_files(tree, UPSTREAM_FILES)
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "f"]):
        subprocess.run(["git", *args], cwd=tree, check=True)
    # The device machine's Python (with torch) stands in for the serving venv here.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    s = config.settings({"VLLM_DIR": str(tree), "VENV_DIR": str(venv), "ARCH": "9.0", "MAX_JOBS": "8",
                         "BUILD_LOG_DIR": str(tmp), "STATUS_INTERVAL": "30"})
    home = cuda_home()
    rec = record.BuildRecord(
        tools=record.Tools(cmake=shutil.which("cmake") or "", ninja=shutil.which("ninja") or "",
                           ccache=shutil.which("ccache") or ""),
        toolchain=record.Toolchain(cuda_home=str(home)))
    os.environ["FIXTURE_CUDA"] = "1"
    log = pip.install(s, rec, "compile", "0.30.0", None, "compile")
    made = products.collect(tree, {"route": "compile"})
    so = tree / "vllm" / "_C_stable_libtorch.abi3.so"
    assert list(made.files) == ["vllm/_C_stable_libtorch.abi3.so"], made.files
    text = log.read_text()
    assert "nvcc" in text and "arch=compute_90,code=[compute_90,sm_90]" in text, text[-3000:]
    elf = subprocess.run(["cuobjdump", "--list-elf", str(so)], capture_output=True, text=True).stdout
    print(elf.strip())
    assert "sm_90" in elf
    run = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import vllm._C_stable_libtorch as m; print('cuda_add(40, 2) =', m.cuda_add(40, 2))"
                          "\nprint([l.split()[-1] for l in open('/proc/self/maps') if 'libcuda.so' in l][0])"],
                         capture_output=True, text=True, cwd="/")
    print(run.stdout + run.stderr)
    assert "cuda_add(40, 2) = 42" in run.stdout


def test_nvml_reading_and_doctor_on_the_real_driver() -> None:
    """The real NVML path of rig/plan/box.py: every card read, and the doctor report printed for the note."""
    from rig.facts import config
    from rig.plan import box

    r = box.read_nvml()
    assert r.gpus and r.cuda_driver >= 13000 and r.driver
    g = r.gpus[0]
    assert g.memory_total > 0 and g.pcie_width_max > 0 and g.compute_capability[0] >= 7
    from rig.facts import profiles

    lines = box.doctor(config.settings({"CUDA_VISIBLE_DEVICES": ""}), profiles.load("reference"))
    print("\n".join(lines))
    assert lines[0].startswith("profile reference") and any(ln.startswith("driver ") for ln in lines)
    assert any(ln.startswith("pass  GPUs") or "GPUs" in ln for ln in lines)


HOLD = ('import torch; x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); print("ready", flush=True); '
        'import time; time.sleep(60)')


def test_the_free_gpu_gate_on_the_real_driver() -> None:
    """rig/running/gpugate.py on real NVML: a free card passes at once; a child holding 2 GiB is named when the wait
    runs out; once it is killed, the gate sees the card free again (and says how long the release took)."""
    import time

    from rig.base.errors import WorkFailed
    from rig.plan import box
    from rig.running import gpugate

    t0 = time.monotonic()
    assert gpugate.wait_free(box.read_nvml, [0], 10) == 0.0, "card 0 is not free: run this on an idle card"
    took = time.monotonic() - t0
    print(f"free card: passed in {took:.2f} s (one NVML read)")
    assert took < 5
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", f"the child did not allocate (exit {child.poll()})"
        listed = box.read_nvml().gpus[0]
        print(f"NVML lists pids {listed.compute_processes}, memory {listed.process_memory}, "
              f"{listed.memory_used / 2**30:.1f} GiB used; the child is pid {child.pid}")
        t0 = time.monotonic()
        try:
            gpugate.wait_free(box.read_nvml, [0], 3)
            raise AssertionError("the gate passed while the child held 2 GiB")
        except WorkFailed as exc:
            msg = exc.message
        print(msg)
        assert 3 <= time.monotonic() - t0 < 10 and "card 0" in msg and "GPU_WAIT=3 s" in msg
        if child.pid in listed.compute_processes:  # this PID namespace is the driver's
            assert f"pid {child.pid} python" in msg, msg
            assert listed.process_memory.get(child.pid, 2 << 30) >= 2 << 30
        else:  # a container: NVML gives host pids, or none; the memory still shows
            assert "not in this PID namespace" in msg or "no compute process" in msg, msg
    finally:
        child.kill()
        child.wait()
    waited = gpugate.wait_free(box.read_nvml, [0], 30)
    print(f"after the kill: free after {waited:.1f} s")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


if __name__ == "__main__":
    if not driver_loadable():
        print("skip: no NVIDIA driver here")
        raise SystemExit(0)
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            print(f"== {name}")
            fn()
            print(f"PASS {name}")
