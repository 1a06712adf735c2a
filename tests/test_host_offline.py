"""TORCH=host and the offline bundle, for real, on this box.

A separate CPython 3.12 (not the lock's 3.13) gets torch 2.11.0 from PyPI, its CUDA build (the H200's torch): the
rig builds on top of it (the lock less the torch family, the official kernels checked against that torch's symbols
with no driver), packs an offline bundle in parts of at most 50 MiB, and a second fresh checkout builds from that
bundle inside a network namespace with no route out (``unshare -n``), with no uv on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import build_env, checkout_copy

from rig.base import venvs
from rig.base.hashing import sha256_file as sha256
from rig.build import bundle

pytestmark = pytest.mark.slow

HOST_TORCH = "2.11.0"
PART = 50 << 20


def host_interpreter() -> Path:
    """A CPython 3.12 of this box: pyenv's (uv cannot download one here)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = sorted(root.glob("versions/3.12*/bin/python3.12"))
    if not found and shutil.which("python3.12"):
        found = [Path(shutil.which("python3.12"))]
    assert found, f"a CPython 3.12 for the host-torch test (pyenv install 3.12, or python3.12 on PATH); none in {root}"
    return found[-1]


def uv() -> str:
    path = shutil.which("uv")
    assert path, "uv on PATH (scripts/nox.sh puts it there)"
    return path


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    """The host: a venv of CPython 3.12 with torch 2.11.0 (CUDA 13.0) from PyPI, as an NGC image would have it."""
    d = tmp_path_factory.mktemp("host") / "torch"
    subprocess.run([uv(), "venv", "--quiet", "--python", str(host_interpreter()), str(d)], check=True)
    subprocess.run([uv(), "pip", "install", "--quiet", "--python", str(d / "bin" / "python"), f"torch=={HOST_TORCH}"],
                   check=True, timeout=1800)
    return d / "bin" / "python"


@pytest.fixture(scope="module")
def host_build(tmp_path_factory, host_python):
    dest = checkout_copy(tmp_path_factory.mktemp("hostbuild") / "rig")
    env = build_env(TORCH="host", PYTHON=str(host_python))
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True, timeout=3600)
    return dest, r, env


@pytest.fixture(scope="module")
def offline_bundle(host_build, tmp_path_factory):
    dest, r, env = host_build
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = tmp_path_factory.mktemp("bundle") / "b"
    env = {k: v for k, v in env.items() if k not in ("TORCH", "PYTHON")}  # the pack follows the build's route
    p = subprocess.run([str(dest / "scripts/nox.sh"), "-s", "pack", "--", "--offline", str(out), "--part-size", "50M"],
                       cwd=dest, env=env, capture_output=True, text=True, timeout=3600)
    return out, p


def no_uv_path() -> str:
    """PATH without any folder holding a uv: the offline build must bring its own."""
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "uv").exists())


@pytest.fixture(scope="module")
def offline_build(offline_bundle, host_python, tmp_path_factory):
    out, p = offline_bundle
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    dest = checkout_copy(tmp_path_factory.mktemp("offline") / "rig")
    env = bare_offline_env(tmp_path_factory.mktemp("home"), TORCH="host", PYTHON=str(host_python), OFFLINE=str(out))
    r = subprocess.run(["unshare", "-n", str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True,
                       timeout=3600)
    return dest, r, env


def bare_offline_env(home: Path, **extra: str) -> dict[str, str]:
    """A GPU box's bare user: a new HOME (no uv or pip cache to fall back on), the system's PATH without uv (no
    /sbin: Debian's ldconfig is not on a user's PATH), nothing of this machine's caches or certificates."""
    return {"HOME": str(home), "LANG": "C.UTF-8", **extra,
            "PATH": os.pathsep.join(d for d in ("/usr/local/bin", "/usr/bin", "/bin") if not (Path(d) / "uv").exists())}


def manifest_torch(dest: Path) -> str:
    return re.search(r'^torch = "([^"]+)"', (dest / "artifacts/manifest.toml").read_text(), re.M)[1]


def test_the_host_route_builds_on_the_hosts_torch(host_build, host_python):
    dest, r, _ = host_build
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = r.stdout
    assert f"TORCH=host: torch {HOST_TORCH} of {host_python} (Python 3.12)" in out
    assert "pins of the torch family left to the host" in out and "the lock was made for 3.13" in out
    assert re.search(rf"torch host {re.escape(HOST_TORCH)}\+cu130 \(TORCH=host, .*\): no older than 2\.11\.0; "
                     r"\d+ of \d+ kernel modules find every symbol they need in it", out), out[-3000:]
    # DeepGEMM's _C is built on torch's full C++ ABI (for the lock's torch 2.13): named, left out, not fatal
    assert "deep_gemm/_C.cpython-312-x86_64-linux-gnu.so is built on torch's full C++ ABI" in r.stderr + out
    assert manifest_torch(dest) == f"host {HOST_TORCH}+cu130"
    site = venvs.site_packages(dest / ".venv")
    assert site.parent.name == "python3.12"
    assert not list(site.glob("torch-*.dist-info")) and not list(site.glob("nvidia_cublas*.dist-info"))
    assert list(site.glob("fastapi-*.dist-info"))
    r2 = subprocess.run([str(dest / ".venv/bin/python"), "-c", "import torch; print(torch.__file__)"],
                        capture_output=True, text=True, cwd="/")
    assert r2.stdout.strip().startswith(str(host_python.parent.parent)), r2.stdout + r2.stderr


def test_a_second_host_build_does_nothing(host_build):
    dest, r, env = host_build
    again = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("current") >= 8 and "runs:" not in again.stdout, again.stdout[-3000:]


def test_the_bundle_is_in_parts_with_every_sum(offline_bundle):
    out, p = offline_bundle
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    files = [f for f in out.rglob("*") if f.is_file()]
    assert all(f.stat().st_size <= PART for f in files), max(files, key=lambda f: f.stat().st_size)
    data = json.loads((out / bundle.INFO).read_text())
    sums = dict(reversed(line.split("  ", 1)) for line in (out / bundle.SUMS).read_text().splitlines())
    assert {str(f.relative_to(out)) for f in files} - {bundle.SUMS} == set(sums)
    assert data["target"]["torch"] == f"host {HOST_TORCH}+cu130" and data["target"]["python"] == "3.12"
    assert data["target"]["torch_route"] == "host"
    assert any(meta.get("parts") for meta in data["files"].values())  # the kernels tarball is cut
    kernels = [n for n in data["files"] if n.startswith(f"{bundle.KERNELS}/ops.tar")]
    assert kernels == ["kernels/ops.tar.gz"], kernels  # gzip: a box may lack zstd and the zstandard module
    names = [n for n in data["files"] if n.startswith("wheels/")]
    family = r"wheels/((torch|torchvision|torchaudio|triton)-|nvidia_(?!ml_py))"
    assert names and not [n for n in names if re.match(family, n)]
    assert any(re.match(r"wheels/nox-", n) for n in names) and bundle.UV in data["files"]
    assert any(re.match(r"wheels/pip-", n) for n in names)  # uv seeds the venv with it: no cache to take it from


def test_the_offline_build_needs_no_network(offline_build, host_build):
    dest, r, _ = offline_build
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert "from the offline bundle" in r.stdout
    assert "the offline bundle's kernels:" in r.stdout and "nothing compiled" in r.stdout
    assert manifest_torch(dest) == f"host {HOST_TORCH}+cu130"
    head = subprocess.run(["git", "-C", str(dest / "vllm"), "rev-parse", "HEAD^{tree}"], capture_output=True,
                          text=True).stdout.strip()
    ref = subprocess.run(["git", "-C", str(host_build[0] / "vllm"), "rev-parse", "HEAD^{tree}"],
                         capture_output=True, text=True).stdout.strip()
    assert head == ref


def _open(dest: Path, src: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["python3", "-m", "rig.build.bundle", "open", str(src)], cwd=dest, capture_output=True,
                          text=True, env=build_env(PYTHONPATH=str(dest), **env), timeout=600)


def _copy(src: Path, dest: Path) -> Path:
    """A copy of the bundle whose files are hard links (a test changes a file by replacing it, never in place)."""
    shutil.copytree(src, dest, copy_function=os.link)
    return dest


def test_a_damaged_or_foreign_bundle_is_refused_naming_the_item(offline_bundle, offline_build, host_python,
                                                                tmp_path):
    out, _ = offline_bundle
    dest = offline_build[0]
    host = {"TORCH": "host", "PYTHON": str(host_python)}
    bad = _copy(out, tmp_path / "bad")
    part = next(p for p in sorted(bad.rglob("*.part001")))
    data = part.read_bytes()
    part.unlink()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    r = _open(dest, bad, **host)
    assert r.returncode == 2 and f"sha256 of {part}" in r.stderr and "copy that file again" in r.stderr, r.stderr
    part.unlink()
    r = _open(dest, bad, **host)
    assert r.returncode == 2 and f"{part}: expected a file of the bundle" in r.stderr and "missing" in r.stderr
    r = _open(dest, out)  # the pinned route
    assert r.returncode == 2 and "torch_route: expected pinned (this checkout's), found 'host'" in r.stderr, r.stderr
    r = _open(dest, tmp_path)
    assert r.returncode == 2 and "no bundle.json in it" in r.stderr
    other = checkout_copy(tmp_path / "other")
    patch = sorted((other / "patches").glob("0*.patch"))[0]
    patch.write_text(patch.read_text().replace("Subject: [PATCH", "Subject: [PATCH] changed:", 1))
    r = subprocess.run([str(other / "build.sh"), "--only", "tools"], cwd=other, capture_output=True, text=True,
                       env=build_env(OFFLINE=str(out), **host), timeout=600)
    assert r.returncode == 2 and "bundle.json: series: expected" in r.stderr, r.stderr[-2000:]
    assert not (other / "vllm").exists()


def test_a_torch_older_than_the_kernels_tested_one_is_refused(host_build):
    dest, r, env = host_build
    toml = dest / "patches/series.toml"
    text = toml.read_text()
    try:
        toml.write_text(text.replace('oldest_torch = "2.11.0"', 'oldest_torch = "2.12.0"'))
        bad = subprocess.run([str(dest / "build.sh"), "--only", "install", "--force"], cwd=dest, env=env,
                             capture_output=True, text=True, timeout=900)
    finally:
        toml.write_text(text)
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert (f"torch of PYTHON={env['PYTHON']} (TORCH=host): expected >= 2.12.0" in bad.stderr
            and f"found host {HOST_TORCH}+cu130" in bad.stderr), bad.stderr[-2000:]


def test_a_bundle_without_pip_is_named_before_the_venv_is_touched(offline_bundle, offline_build, tmp_path):
    """A bundle written before it carried pip: the venv step says so, with the fix, and the venv stays."""
    out, _ = offline_bundle
    dest, _, env = offline_build
    old = _copy(out, tmp_path / "old")
    wheel = next((old / "wheels").glob("pip-*.whl"))
    name = str(wheel.relative_to(old))
    wheel.unlink()
    info = json.loads((old / bundle.INFO).read_text())
    del info["files"][name]
    (old / bundle.INFO).unlink()
    (old / bundle.INFO).write_text(json.dumps(info, indent=1))
    sums = [ln for ln in (old / bundle.SUMS).read_text().splitlines() if not ln.endswith(f"  {name}")]
    sums = [ln if not ln.endswith(f"  {bundle.INFO}") else f"{sha256(old / bundle.INFO)}  {bundle.INFO}" for ln in sums]
    (old / bundle.SUMS).unlink()
    (old / bundle.SUMS).write_text("\n".join(sums) + "\n")
    python = dest / ".venv/bin/python"
    before = os.stat(python.parent).st_ino
    r = subprocess.run(["unshare", "-n", str(dest / "build.sh"), "--only", "venv", "--force"], cwd=dest,
                       env={**env, "OFFLINE": str(old)}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert f"pip's wheel in {dest / '.rig/offline/wheels'} (OFFLINE={old})" in r.stderr, r.stderr[-2000:]
    assert "the bundle was written before it carried pip" in r.stderr
    assert "scripts/nox.sh -s pack -- --offline DIR" in r.stderr
    assert os.stat(python.parent).st_ino == before and not list(dest.glob(".venv.old-*"))
