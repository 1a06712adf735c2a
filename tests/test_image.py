"""``nox -s image`` (rig/image.py): its refusals before anything starts (CI), and the real image built by the
real builder of this box (marked ``image``: minutes and about 10 GB; ``-m image`` runs it alone).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, run_rig

from rig import artifacts, bundlewrite
from rig import image as rig_image


def env_with(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "RIG_STATE": str(tmp_path / "state"), **extra}


def test_without_packed_kernels_it_refuses_naming_the_folder_and_the_fix(tmp_path):
    r = run_rig(env_with(tmp_path, ARTIFACTS_DIR=str(tmp_path / "none")), "image", "--dry-run")
    assert r.code == 2, r.text
    assert f"the kernels in {tmp_path / 'none'}" in r.err and "manifest.toml and ops.sha256" in r.err
    assert "run ./build.sh first" in r.err


def packed(tmp_path: Path) -> Path:
    ops = tmp_path / "artifacts"
    ops.mkdir()
    (ops / artifacts.MANIFEST).write_text("tarball = 'ops.tar.zst'\n")
    (ops / artifacts.SUMS).write_text("0" * 64 + "  a.so\n")
    return ops


def test_the_cpu_build_is_refused_with_the_device_named(tmp_path):
    r = run_rig(env_with(tmp_path, DEVICE="cpu", ARTIFACTS_DIR=str(packed(tmp_path))), "image", "--dry-run")
    assert r.code == 2 and "DEVICE: expected cuda" in r.err and "found cpu" in r.err, r.text


def test_a_builder_that_cannot_build_is_named_with_why(tmp_path):
    missing = next((b for b in rig_image.BUILDERS if not shutil.which(b)), None)
    if missing is None:
        pytest.skip("every builder is installed here")
    r = run_rig(env_with(tmp_path, BUILDER=missing, ARTIFACTS_DIR=str(packed(tmp_path))), "image", "--dry-run")
    assert r.code == 2, r.text
    assert f"BUILDER: expected {missing} able to build, found {missing}: not installed" in r.err


def test_a_bad_builder_name_is_refused(tmp_path):
    r = run_rig(env_with(tmp_path, BUILDER="kaniko"), "image", "--dry-run")
    assert r.code == 2 and "BUILDER: expected auto or docker or podman or buildah, found 'kaniko'" in r.err, r.text


def test_the_route_1_key_is_the_one_the_dockerfiles_key_stage_makes(tmp_path):
    """The record's key: sha256 of the manifest then the sums, as the opskey stage's `cat` concatenates them."""
    ops = packed(tmp_path)
    cat = subprocess.run(["cat", str(ops / artifacts.MANIFEST), str(ops / artifacts.SUMS)], capture_output=True,
                         check=True).stdout
    assert rig_image.kernels_key(ops) == __import__("hashlib").sha256(cat).hexdigest()
    text = (ROOT / "Dockerfile").read_text()
    assert f"cat /ops/{artifacts.MANIFEST} /ops/{artifacts.SUMS}" in text


TAG = "localhost/rig-test:latest"


def nox_image(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([str(ROOT / "scripts" / "nox.sh"), "-s", "image"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r, json.loads((Path(env.get("RIG_STATE", ROOT / ".rig")) / "image-cuda.json").read_text())


def start_inside(rec: dict) -> str:
    """``./start.sh --dry-run --skip-box-check`` in a container of the image, as its builder runs one."""
    if rec["builder"] == "buildah":
        ctr = subprocess.run(["buildah", "from", rec["tag"]], capture_output=True, text=True,
                             check=True).stdout.strip()
        try:
            run = subprocess.run(["buildah", "run", "--isolation", "chroot", ctr, "--", "./start.sh", "--dry-run",
                                  "--skip-box-check"], capture_output=True, text=True, timeout=600)
        finally:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
    else:
        run = subprocess.run([rec["builder"], "run", "--rm", rec["tag"], "./start.sh", "--dry-run",
                              "--skip-box-check"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout + run.stderr


@pytest.mark.image
def test_the_real_image_builds_records_itself_plans_a_start_and_never_keeps_old_kernels(tmp_path):
    """The real route-1 build of this checkout's kernels (./build.sh first) with this box's builder, the base made
    by debootstrap where no registry answers; ./start.sh --dry-run inside it; the same kernels again (every layer
    reused); then the same kernels repacked (gzip: another tarball, another key), which route 1 verifies and
    installs again instead of reusing the old layer."""
    if not (ROOT / "artifacts" / artifacts.MANIFEST).exists():
        pytest.skip("no artifacts/: run ./build.sh first")
    env = {**os.environ, "IMAGE": TAG, "RIG_STATE": str(tmp_path / "state")}
    try:
        build_and_check(env, tmp_path)
    finally:  # the test's image leaves the builder's storage; the cached layers of the base stay
        for b in rig_image.BUILDERS:
            if shutil.which(b):
                subprocess.run([b, "rmi", TAG], capture_output=True)


def build_and_check(env: dict[str, str], tmp_path: Path) -> None:
    """The steps of the test above, whose image it removes whatever happens here."""
    _, rec = nox_image(env)
    assert rec["tag"] == TAG and rec["bytes"] > 1e9 and rec["seconds"] > 0
    assert rec["kernels_key"] == rig_image.kernels_key(ROOT / "artifacts")
    out = start_inside(rec)
    assert "profile: reference" in out and "command: /opt/vllm/.venv/bin/vllm serve" in out, out[-3000:]
    assert "not current" not in out, out[-3000:]  # the image's kernels read as built (mtimes to the second)
    again, same = nox_image(env)
    assert "verified and installed" not in again.stdout + again.stderr  # the same kernels: route 1 reused
    repack = tmp_path / "gz"
    bundlewrite.kernels(ROOT / "artifacts", artifacts.read_manifest(ROOT / "artifacts" / artifacts.MANIFEST), repack)
    moved, other = nox_image({**env, "ARTIFACTS_DIR": str(repack)})
    assert "verified and installed 2004 files" in moved.stdout + moved.stderr  # never the old route-1 layer
    assert other["kernels_key"] == rig_image.kernels_key(repack) != rec["kernels_key"]
    print(f"\nimage {rec['bytes'] / 1e9:.2f} GB by {rec['builder']}: {rec['seconds']:.0f} s; the same kernels again "
          f"{same['seconds']:.0f} s; repacked kernels {other['seconds']:.0f} s")
