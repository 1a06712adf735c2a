"""``nox -s image`` (rig/build/image.py): its refusals before anything starts (CI), and the real images built by the
real builder of this box (marked ``image``: minutes and about 10 GB each; ``-m image`` runs them alone): the CUDA
image, and the CPU variant, run with podman and podman-compose serving the demo model.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, run_rig
from test_serve import free_port

from rig.base import testdeps
from rig.build import artifacts, demo
from rig.build import image as rig_image
from rig.control import bundlewrite
from rig.facts import config
from rig.running import health


def env_with(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "RIG_STATE": str(tmp_path / "state"), **extra}


def test_without_packed_kernels_it_refuses_naming_the_folder_and_the_fix(tmp_path):
    r = run_rig(env_with(tmp_path, ARTIFACTS_DIR=str(tmp_path / "none")), "image", "--dry-run")
    assert r.code == 2, r.text
    assert f"the kernels in {tmp_path / 'none'}" in r.err and "manifest.toml and ops.sha256" in r.err
    assert "run ./build.sh first" in r.err
    cpu = run_rig(env_with(tmp_path, DEVICE="cpu", ARTIFACTS_DIR=str(tmp_path / "none")), "image", "--dry-run")
    assert cpu.code == 2 and "run DEVICE=cpu ./build.sh first" in cpu.err, cpu.text


def packed(tmp_path: Path) -> Path:
    ops = tmp_path / "artifacts"
    ops.mkdir()
    (ops / artifacts.MANIFEST).write_text("tarball = 'ops.tar.zst'\n")
    (ops / artifacts.SUMS).write_text("0" * 64 + "  a.so\n")
    return ops


def test_the_cpu_variant_is_planned_from_the_cpu_builds_kernels_under_its_own_tag(tmp_path):
    """DEVICE=cpu: artifacts-cpu/ (where the CPU build packs), DEVICE=cpu to the Dockerfile, the tag vllm:cpu, so
    the two images never overwrite each other; the record is image-cpu.json."""
    s = config.settings({"DEVICE": "cpu"})
    assert s.artifacts_dir == ROOT / "artifacts-cpu" and config.image_settings({"DEVICE": "cpu"}).tag == "vllm:cpu"
    assert config.image_settings({}).tag == "vllm:latest"
    cmd = rig_image.build_command("buildah", s, "vllm:cpu", rig_image.DEFAULT_BASE, None)
    assert cmd[cmd.index("--build-context") + 1] == f"ops={ROOT / 'artifacts-cpu'}"
    assert "DEVICE=cpu" in cmd and cmd[cmd.index("-t") + 1] == "vllm:cpu"
    # the route the build took goes to the Dockerfile too: the adopt's refusal names OPS_ROUTE as the fix
    assert "OPS_ROUTE=auto" in cmd
    routed = rig_image.build_command("buildah", config.settings({"OPS_ROUTE": "compile"}), "vllm:latest",
                                     rig_image.DEFAULT_BASE, None)
    assert routed[routed.index("OPS_ROUTE=compile") - 1] == "--build-arg"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG DEVICE=cuda" in dockerfile and "ENV DEVICE=${DEVICE}" in dockerfile


def test_a_builder_that_cannot_build_is_named_with_why(tmp_path):
    why = {b: rig_image.usable(b) for b in rig_image.BUILDERS}
    unable = next((b for b in rig_image.BUILDERS if why[b]), None)
    if unable is None:
        pytest.skip("every builder can build here")
    r = run_rig(env_with(tmp_path, BUILDER=unable, ARTIFACTS_DIR=str(packed(tmp_path))), "image", "--dry-run")
    assert r.code == 2, r.text
    assert f"BUILDER: expected {unable} able to build, found {unable}: {why[unable]}" in r.err


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
    s = config.settings(env)
    return r, json.loads((s.state_dir / f"image-{s.device}.json").read_text())


def start_inside(rec: dict, tmp_path: Path) -> str:
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
        env = podman_env(tmp_path, rec["tag"]) if rec["builder"] == "podman" else None
        run = subprocess.run([rec["builder"], "run", "--rm", rec["tag"], "./start.sh", "--dry-run",
                              "--skip-box-check"], capture_output=True, text=True, timeout=600, env=env)
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
    out = start_inside(rec, tmp_path)
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


# -- the CPU variant, run: podman and podman-compose serve the demo model from the image ---------------------

CPU_TAG = "localhost/rig-test:cpu"


def podman_env(tmp_path: Path, image: str) -> dict[str, str]:
    """podman as this box lets it run: a containers.conf of the test's own (CONTAINERS_CONF), never the host's.

    Root without CAP_SYS_RESOURCE cannot grant podman's default open-file and process limits, and the start fails:
    the container gets this process's own open-file limit and the first process limit that a container here
    starts with (this process's, else 32768: where podman's runtime caps it on such a box). crun refuses a host
    with hybrid cgroups (v1 controllers, a v2 mount beside them): runc runs it there."""
    def hard(which: int) -> int:
        n = resource.getrlimit(which)[1]
        return -1 if n == resource.RLIM_INFINITY else n

    nofile = hard(resource.RLIMIT_NOFILE)
    conf = tmp_path / "containers.conf"
    for nproc in dict.fromkeys((hard(resource.RLIMIT_NPROC), 32768)):
        lines = ["[containers]", f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]']
        if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            lines += ["[engine]", 'runtime = "runc"']
        conf.write_text("\n".join(lines) + "\n")
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        if subprocess.run(["podman", "run", "--rm", "--entrypoint", "true", image], env=env, capture_output=True,
                          timeout=120).returncode == 0:
            return env
    pytest.skip(f"no container starts with podman here (tried {conf.read_text()!r})")


def podman(env: dict[str, str], *args: str, check: bool = True, timeout: float = 120) -> str:
    r = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 or not check, f"podman {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r.stdout


def inspect(env: dict[str, str], name: str) -> dict:
    return json.loads(podman(env, "inspect", name))[0]


def tree(pid: int) -> list[psutil.Process]:
    """The container's processes as the host sees them (podman here is root's: its pids are this box's)."""
    top = psutil.Process(pid)
    return [top, *top.children(recursive=True)]


def until_healthy(env: dict[str, str], name: str, port: int, timeout: float = 600) -> float:
    """Seconds until a one-token generation answers on 127.0.0.1:port; fails early when the container exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if health.health("127.0.0.1", port, "demo", timeout=30)[0]:
            return time.monotonic() - t0
        if not inspect(env, name)["State"]["Running"]:
            raise AssertionError(f"{name} exited: {podman(env, 'logs', name, check=False)[-4000:]}")
        time.sleep(2)
    raise AssertionError(f"{name}: not healthy in {timeout:.0f} s: {podman(env, 'logs', name, check=False)[-4000:]}")


def stop_leaves_nothing(env: dict[str, str], procs: list[psutil.Process], stop: list[str], name: str) -> float:
    """Run ``stop`` (SIGTERM, then the stop timeout); the seconds it took, once no process of ``procs`` is left."""
    t0 = time.monotonic()
    r = subprocess.run(stop, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"{name}: left after the stop: {[(p.pid, p.cmdline()[:3]) for p in left]}"
    assert took < 20, f"{name}: the stop took {took:.0f} s: the 20 s timeout's SIGKILL ended it, not the SIGTERM"
    return took


def demo_folder(tmp_path: Path, s: config.Settings) -> Path:
    """The demo checkpoint ./start.sh --demo makes, or one made here with the CPU build's venv."""
    cached = s.cache / "models" / "demo"
    if demo.ready(cached):
        return cached
    made = tmp_path / "demo"
    demo.ensure(s.venv_dir / "bin" / "python", made, ROOT)
    return made


@pytest.mark.image
def test_the_cpu_image_serves_the_demo_read_only_and_a_stop_or_compose_down_leaves_nothing(tmp_path):
    """The CPU variant built by nox -s image (DEVICE=cpu), then run as a user would: the demo checkpoint mounted
    read-only, the port published on 127.0.0.1, LOG empty (the engine's lines in the container's log); a one-token
    generation answers; SIGTERM (podman stop) ends every process within the stop timeout. Then the same image
    through docker-compose.cpu.yml with podman-compose: its health check (a one-token generation) passes, and
    down leaves nothing."""
    s = config.settings({**os.environ, "DEVICE": "cpu"})
    if not (s.artifacts_dir / artifacts.MANIFEST).exists():
        pytest.skip(f"no {s.artifacts_dir}: run DEVICE=cpu ./build.sh first")
    missing = testdeps.ensure(testdeps.IMAGE_RUN)
    if missing or not shutil.which("podman-compose"):
        pytest.skip(f"needs {' '.join(missing) or 'podman-compose'} (python -m rig.base.testdeps --image; the test "
                    "extras)")
    # the build as a user runs it: its RUN steps (chroot isolation) take no containers.conf of the test's
    build_env = {**os.environ, "DEVICE": "cpu", "IMAGE": CPU_TAG, "RIG_STATE": str(tmp_path / "state")}
    names = ["rig-test-cpu", "rig-test-cpu-compose"]
    env = dict(os.environ)
    try:
        _, rec = nox_image(build_env)
        env = podman_env(tmp_path, CPU_TAG)
        assert rec["tag"] == CPU_TAG and rec["device"] == "cpu" and rec["bytes"] > 1e9
        figures = {"build": rec["seconds"], "GB": rec["bytes"] / 1e9}
        demo_dir = demo_folder(tmp_path, s)
        figures.update(run_and_stop(env, names[0], demo_dir))
        figures.update(compose_up_and_down(env, names[1], demo_dir, tmp_path))
        print("\nCPU image: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    finally:
        for n in names:
            podman(env, "rm", "-f", "-t", "0", n, check=False)
        podman(env, "rmi", CPU_TAG, check=False)


def run_and_stop(env: dict[str, str], name: str, demo_dir: Path) -> dict[str, float]:
    port = free_port()
    args = ["-p", f"127.0.0.1:{port}:8000", "-v", f"{demo_dir}:/models/demo:ro", "-e", "PROFILE=demo", "-e",
            "CKPT=/models/demo", "--stop-timeout", "20"]
    # a container's default /dev/shm (64 MiB) is below what the engine needs: the box check says so, no engine
    small = subprocess.run(["podman", "run", "--rm", *args, CPU_TAG], env=env, capture_output=True, text=True,
                           timeout=300)
    assert small.returncode == 2, small.stdout + small.stderr
    assert "/dev/shm" in small.stdout + small.stderr and "--shm-size=1g" in small.stdout + small.stderr
    podman(env, "run", "-d", "--name", name, "--shm-size=1g", *args, CPU_TAG)
    healthy = until_healthy(env, name, port)
    info = inspect(env, name)
    assert info["HostConfig"]["PortBindings"]["8000/tcp"] == [{"HostIp": "127.0.0.1", "HostPort": str(port)}]
    assert "LOG=" in info["Config"]["Env"] and "DEVICE=cpu" in info["Config"]["Env"]
    [mount] = [m for m in info["Mounts"] if m["Destination"] == "/models/demo"]
    assert mount["RW"] is False
    denied = subprocess.run(["podman", "exec", name, "touch", "/models/demo/x"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied.stderr
    logs = podman(env, "logs", name)
    assert "Serving the model as: demo" in logs, logs[-3000:]  # the engine's own line, on stdout (LOG empty)
    procs = tree(info["State"]["Pid"])
    assert any("EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name() for p in procs), \
        [p.cmdline()[:3] for p in procs]
    stopped = stop_leaves_nothing(env, procs, ["podman", "stop", "-t", "20", name], name)
    assert inspect(env, name)["State"]["ExitCode"] == 0
    return {"to healthy (s)": healthy, "stop (s)": stopped}


def compose_up_and_down(env: dict[str, str], name: str, demo_dir: Path, tmp_path: Path) -> dict[str, float]:
    """docker-compose.cpu.yml as it is, but for the test's image and container names (a user's vllm:cpu and
    vllm-cpu are never touched)."""
    proj = tmp_path / "compose"
    proj.mkdir()
    text = (ROOT / "docker-compose.cpu.yml").read_text()
    text = re.sub(r"(?m)^    image: vllm:cpu$", f"    image: {CPU_TAG}", text)
    text = re.sub(r"(?m)^    container_name: vllm-cpu\b", f"    container_name: {name}", text)
    assert CPU_TAG in text and name in text
    (proj / "docker-compose.cpu.yml").write_text(text)
    port = free_port()
    cenv = {**env, "DEMO_DIR": str(demo_dir), "HOST_PORT": str(port)}
    compose = ["podman-compose", "-f", str(proj / "docker-compose.cpu.yml")]
    up = subprocess.run([*compose, "up", "-d", "--no-build"], cwd=proj, env=cenv, capture_output=True, text=True,
                        timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    healthy = until_healthy(env, name, port)
    check = subprocess.run(["podman", "healthcheck", "run", name], env=env, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0 and "unhealthy" not in check.stdout, check.stdout + check.stderr
    info = inspect(env, name)
    assert info["Config"]["Healthcheck"]["Test"][-3:] == ["python3", "-m", "rig.running.health"], info["Config"]
    procs = tree(info["State"]["Pid"])
    down = stop_leaves_nothing(cenv, procs, [*compose, "down"], name)
    assert subprocess.run(["podman", "container", "exists", name], env=env).returncode == 1  # removed
    return {"compose to healthy (s)": healthy, "compose down (s)": down}


def test_a_builder_storage_without_room_for_the_image_is_refused_with_the_sizes_and_more_room_clears_it(tmp_path,
                                                                                                        monkeypatch):
    """Two builds ran out of disk mid-commit with no useful message. The real buildah, its storage moved by its own
    storage.conf into a 64 MiB tmpfs (in a mount namespace of the test's own): exit 2 before anything starts. The
    fix, the same storage on this disk: the check passes and says what it found."""
    if rig_image.usable("buildah"):
        pytest.skip(f"buildah: {rig_image.usable('buildah')}")
    small = tmp_path / "small"
    small.mkdir()
    conf = tmp_path / "storage.conf"

    def storage(where: Path) -> None:
        conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{where}/graph"\nrunroot = "{where}/run"\n')

    storage(small)
    env = env_with(tmp_path, BUILDER="buildah", ARTIFACTS_DIR=str(packed(tmp_path)), CONTAINERS_STORAGE_CONF=str(conf))
    cmd = f"mount -t tmpfs -o size=64m tmpfs {small} && exec {ROOT / 'scripts' / 'nox.sh'} -s image -- --dry-run"
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"free disk for buildah's storage ({small}/graph): expected >= 20.4 GB" in r.stderr, r.stderr
    assert "GB free" in r.stderr and "buildah rmi --prune" in r.stderr
    storage(tmp_path / "roomy")
    monkeypatch.setenv("CONTAINERS_STORAGE_CONF", str(conf))
    state = tmp_path / "state"  # an earlier build recorded a 1 GB image: what this disk has free is plenty
    state.mkdir(exist_ok=True)
    (state / "image-cuda.json").write_text(json.dumps({"tag": "vllm:latest", "bytes": 1_000_000_000}))
    said = rig_image.disk_check("buildah", config.settings({"RIG_STATE": str(state)}))
    assert said.startswith(f"storage: {tmp_path}/roomy/graph, ") and "the build needs 2.0 GB" in said, said
