"""The service under a booted systemd: ``scripts/install-as-service.sh`` and ``systemd/vllm.service`` as they are,
serving the demo on the CPU build, in a Debian 12 container whose PID 1 is systemd (tests/booted.py).

A fresh copy of the checkout is bound in at ``/opt/vllm``, the unit's own path (not under /tmp: the unit's
PrivateTmp= hides it), and the unit's ``ExecStartPre`` builds it there on the first start, as on a new host. The
warm caches (uv's, the rig's) are bound in so that build takes about a minute. One container and one installed
unit serve the whole module, in order: install, start, status, the log's rotation, ``kill -9`` of the API server
and of EngineCore, the updates, stop, a refused configuration (not restarted) and a busy port (restarted until
the start limit), uninstall.

Marked ``systemd``: run alone with ``scripts/nox.sh -s tests -- -m systemd`` (about 15 minutes; not in CI, whose
45 minutes the rest of the suite nearly fills: docs/testing.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from booted import Booted, root_fs
from conftest import ROOT, checkout_copy
from test_serve_real import KEY, bare_env, completion, free_port
from test_update_real import series_with

from rig.base import testdeps

pytestmark = pytest.mark.systemd

REPO = Path("/opt/vllm")  # the unit's template path: where a host keeps the rig
SVC = str(REPO / "scripts" / "install-as-service.sh")
LOG = "/var/log/vllm.log"


class Unit:
    """The container, the copy bound in, and the client's view of the service (its port)."""

    def __init__(self, box: Booted, copy: Path, port: int) -> None:
        self.box, self.copy, self.env = box, copy, {"PORT": str(port)}

    def svc(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        return self.box.sh(SVC, *args, timeout=timeout)

    def show(self, *props: str) -> dict[str, str]:
        out = self.box.sh("systemctl", "show", "-p", ",".join(props), "vllm.service").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, since: str = "") -> str:
        args = ["journalctl", "-u", "vllm.service", "--no-pager", "-o", "cat"] + (["--cursor", since] if since else [])
        return self.box.sh(*args).stdout

    def cursor(self) -> str:
        out = self.box.sh("journalctl", "-u", "vllm.service", "-n", "0", "--show-cursor", "--no-pager").stdout
        m = re.search(r"-- cursor: (\S+)", out)
        return m[1] if m else ""

    def processes(self) -> list[tuple[int, str, str]]:
        """(pid, name, command line) of every process in the container, as its own PID namespace numbers them."""
        out = self.box.sh("ps", "-eo", "pid=,comm=,args=").stdout
        rows = [ln.split(None, 2) for ln in out.splitlines() if ln.strip()]
        return [(int(r[0]), r[1], r[2] if len(r) > 2 else "") for r in rows]

    def engine(self) -> list[tuple[int, str, str]]:
        """The engine's processes: the API server (``vllm serve`` under the venv's python), EngineCore, workers."""
        return [p for p in self.processes()
                if p[1].startswith("VLLM::") or ("/bin/vllm serve" in p[2] and "logpump" not in p[2])]

    def cgroup_procs(self) -> list[str]:
        """The processes systemd holds in the service's cgroup."""
        cg = self.show("ControlGroup")["ControlGroup"]
        return self.box.sh("sh", "-c", f"cat /sys/fs/cgroup/systemd{cg}/cgroup.procs 2>/dev/null").stdout.split()

    def answers(self) -> bool:
        try:
            code, _ = completion(self.env, {"model": "demo", "prompt": "hello", "max_tokens": 1})
        except OSError:  # nothing listening
            return False
        return code == 200

    def wait(self, pred, timeout: float, what: str, step: float = 1.0):  # noqa: ANN001 - () -> value
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(step)
        raise AssertionError(f"{what}: not within {timeout:.0f} s; journal: {self.journal()[-3000:]}")


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: systemd-nspawn boots the container")
    missing = testdeps.ensure(testdeps.BOOTED)
    if missing:
        pytest.skip(f"needs {' '.join(missing)} (python -m rig.base.testdeps --booted installs them)")
    cache = Path(os.environ.get("RIG_CACHE", Path.home() / ".cache" / "vllm-rig"))
    root = root_fs(cache)
    copy = checkout_copy(tmp_path_factory.mktemp("unit") / "rig")
    host = bare_env(Path("/root"))  # the warm caches' host paths, as the other real-engine tests find them
    binds = [(copy, REPO, False), (Path(host["UV_CACHE_DIR"]), Path("/root/.cache/uv"), False),
             (Path(host["RIG_CACHE"]), Path("/root/.cache/vllm-rig"), False)]
    if "PYENV_ROOT" in host:  # this machine's CPython 3.13, for the build's venv step
        binds.append((Path(host["PYENV_ROOT"]), Path("/root/.pyenv"), True))
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if ca.exists():  # the host's trust store (a TLS-inspecting proxy's CA), for the build's downloads
        binds.append((ca, ca, True))
    box = Booted(root, binds, f"vllm-rig-test-{os.getpid()}")
    try:
        box.boot()
        yield Unit(box, copy, free_port())
    finally:
        box.shutdown()
        left = [cg for cg in box.cgroups if cg.exists()]
        assert not left, f"cgroups left behind: {left}"


@pytest.fixture(scope="module")
def installed(unit):
    r = unit.svc("install")
    assert r.returncode == 0, r.stdout + r.stderr
    env_file = Path(f"/proc/{unit.box.pid1()}/root/etc/default/vllm")  # the container's file, from the host
    text = env_file.read_text()
    for was, now in (("PROFILE=reference", "PROFILE=demo"), ("MODEL_NAME=Hinata", "MODEL_NAME=demo")):
        text = text.replace(f"\n{was}\n", f"\n{now}\n")
    env_file.write_text(text + f"DEVICE=cpu\nPORT={unit.env['PORT']}\nVLLM_API_KEY={KEY}\n")
    return unit, r


@pytest.fixture(scope="module")
def started(installed):
    unit, _ = installed
    t0 = time.monotonic()
    r = unit.svc("start")
    took = time.monotonic() - t0
    answered = unit.answers()  # at once: READY=1 came after a one-token generation
    return unit, r, took, answered


def test_install_writes_and_enables_the_unit(installed):
    unit, r = installed
    assert "wrote /etc/systemd/system/vllm.service" in r.stdout and "enabled vllm.service" in r.stdout, r.stdout
    assert unit.box.sh("systemctl", "is-enabled", "vllm.service").stdout.strip() == "enabled"
    unit_text = unit.box.sh("cat", "/etc/systemd/system/vllm.service").stdout
    assert f"ExecStart={REPO}/start.sh --foreground --no-build" in unit_text


def test_start_builds_the_new_host_and_returns_once_an_answer_came(started):
    unit, r, took, answered = started
    assert r.returncode == 0, r.stdout + r.stderr + unit.journal()[-4000:]
    assert answered, "READY=1 came before the engine answered"
    props = unit.show("ActiveState", "SubState", "StatusText", "Type")
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["StatusText"].startswith("ready: demo on 127.0.0.1:"), props
    log = unit.journal()
    assert "Session build was successful" in log, log[-3000:]  # ExecStartPre built the new host's copy first
    assert re.search(r"ready in [\d.]+ s: http://127\.0\.0\.1:\d+/v1, model demo", log), log[-3000:]
    print(f"\nfirst start under systemd (the build on the new host, then the engine): {took:.0f} s to READY=1")


def test_status_shows_the_unit_and_the_supervisors_status_line(started):
    unit = started[0]
    r = unit.svc("status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "active (running)" in r.stdout and 'Status: "ready: demo on 127.0.0.1:' in r.stdout, r.stdout


def test_the_unit_warns_of_limits_the_box_did_not_grant(started):
    """This box's root lacks CAP_SYS_RESOURCE: systemd starts the unit with lower limits, without a word."""
    import resource

    unit = started[0]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= 65536:
        pytest.skip("this box grants the unit's LimitNOFILE")
    assert re.search(r"warning: LimitNOFILE: the unit asks for 65536, this process got \d+", unit.journal())


def test_logrotate_rotates_the_real_log_and_the_reader_keeps_following(started):
    unit = started[0]
    reader = subprocess.Popen(["nsenter", "-t", str(unit.box.pid1()), "-a", "env", "-i", "PATH=/usr/bin:/bin",
                               "HOME=/root", f"{REPO}/vllm-logs.sh", "--file", LOG, "-f", "-n", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(reader.stdout or []), daemon=True).start()
    gen = re.compile(r"gen\s+[1-9][\d.]* tok/s")
    try:
        time.sleep(8)  # the reader's own start
        r = unit.box.sh("logrotate", "-f", "/etc/logrotate.d/vllm")
        assert r.returncode == 0, r.stdout + r.stderr
        rotated = unit.box.sh("ls", "/var/log").stdout.split()
        assert "vllm.log.1" in rotated and "vllm.log" in rotated, rotated
        before = len(seen)
        for _ in range(3):
            completion(unit.env, {"model": "demo", "prompt": "count to ten", "max_tokens": 64})
        unit.wait(lambda: any(gen.search(ln) for ln in seen[before:]), 40, "a stats line after the rotation")
    finally:
        reader.terminate()
        reader.wait(30)
    new_log = unit.box.sh("cat", LOG).stdout
    assert "Avg generation throughput" in new_log or "generation throughput" in new_log, new_log[-2000:]


def _kill_and_watch_the_restart(unit: Unit, pick, what: str) -> tuple[float, float]:  # noqa: ANN001
    """``kill -9`` of one engine process; the unit must fail with nothing left in its cgroup, then systemd start it
    again (Restart=on-failure, RestartSec=) and READY=1 come. (seconds to the failure, seconds to ready again)."""
    restarts = int(unit.show("NRestarts")["NRestarts"])
    victim = pick(unit.engine())
    assert victim, f"no {what} among {unit.engine()}"
    t0 = time.monotonic()
    assert unit.box.sh("kill", "-9", str(victim[0])).returncode == 0
    unit.wait(lambda: unit.show("SubState")["SubState"] == "auto-restart", 120, f"the unit failing after {what}",
              step=0.5)
    failed = time.monotonic() - t0
    assert unit.cgroup_procs() == [], "a process of the failed engine is left in the service's cgroup"
    assert unit.engine() == [], f"an engine process outlived {what}: {unit.engine()}"
    unit.wait(lambda: int(unit.show("NRestarts")["NRestarts"]) == restarts + 1
              and unit.show("ActiveState")["ActiveState"] == "active", 600, "systemd's restart to READY=1")
    back = time.monotonic() - t0
    assert unit.answers()
    return failed, back


def test_kill_9_of_the_api_server_ends_in_a_restart_by_systemd_with_no_orphan(started):
    unit = started[0]
    failed, back = _kill_and_watch_the_restart(
        unit, lambda ps: next((p for p in ps if "/bin/vllm serve" in p[2]), None), "the API server")
    print(f"\nkill -9 of the API server: unit failed after {failed:.0f} s, serving again after {back:.0f} s")


def test_kill_9_of_enginecore_ends_in_a_restart_by_systemd_with_no_orphan(started):
    unit = started[0]
    failed, back = _kill_and_watch_the_restart(
        unit, lambda ps: next((p for p in ps if p[1].startswith("VLLM::EngineC")), None), "EngineCore")
    print(f"\nkill -9 of EngineCore: unit failed after {failed:.0f} s, serving again after {back:.0f} s")


def _series(unit: Unit, tmp: Path, name: str, file: str, edit) -> None:  # noqa: ANN001
    """A new series in the bound checkout (as a `git pull` brings one): the copy's patches/ replaced by the
    checkout's own series plus one patch (never on top of an earlier test's)."""
    shutil.rmtree(unit.copy / "patches")
    shutil.copytree(ROOT / "patches", unit.copy / "patches")
    made = series_with(unit.copy, tmp, name, file, edit)
    shutil.rmtree(unit.copy / "patches")
    shutil.copytree(made, unit.copy / "patches")


def test_an_update_whose_engine_fails_is_rolled_back_by_systemd(started, tmp_path):
    unit = started[0]
    marker = "async def run_server(args, **uvicorn_kwargs) -> None:\n"
    _series(unit, tmp_path, "raise when serving", "vllm/entrypoints/launchers/api_server/entry.py",
            lambda text: text.replace(marker, marker + '    raise RuntimeError("broken on purpose: the systemd '
                                      'update test")\n', 1))
    t0 = time.monotonic()
    r = unit.svc("update")
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "with the service's environment" in r.stdout and "building into" in r.stdout, r.stdout[-3000:]
    assert "rolled back: the checkout's own build serves again" in r.stderr, r.stderr[-3000:]
    assert "found failed: error: the engine: expected a healthy start" in r.stderr, r.stderr[-3000:]  # journal
    assert unit.show("ActiveState")["ActiveState"] == "active" and unit.answers()
    assert "broken on purpose" in unit.box.sh("cat", LOG).stdout
    print(f"\nservice update with an engine that fails: rolled back, {took:.0f} s in all")


def test_an_update_switches_the_unit_to_the_new_build_and_rollback_goes_back(started, tmp_path):
    unit = started[0]
    _series(unit, tmp_path, "a comment", "vllm/entrypoints/launchers/api_server/entry.py",
            lambda text: text + "\n# a change of the series: the systemd update test\n")
    t0 = time.monotonic()
    r = unit.svc("update")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + unit.journal()[-6000:]
    assert "is healthy" in r.stdout and "builds kept:" in r.stdout, r.stdout[-3000:]
    served = next(p for p in unit.engine() if "/bin/vllm serve" in p[2])[2]
    assert f"{REPO}/.rig/slots/cpu-" in served, served  # the unit's ExecStart serves the new slot
    assert unit.answers()
    t0 = time.monotonic()
    r = unit.svc("rollback")
    back = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + unit.journal()[-6000:]
    served = next(p for p in unit.engine() if "/bin/vllm serve" in p[2])[2]
    assert served.startswith(f"{REPO}/.venv-cpu/bin/python"), served
    assert unit.answers()
    print(f"\nservice update that switches: {took:.0f} s (the build beside, the restart); rollback: {back:.0f} s")


def test_stop_leaves_no_process(started):
    unit = started[0]
    r = unit.svc("stop")
    assert r.returncode == 0, r.stdout + r.stderr
    props = unit.show("ActiveState", "Result")
    assert props == {"ActiveState": "inactive", "Result": "success"}, props
    assert unit.cgroup_procs() == [] and unit.engine() == []
    assert "no process of it is left" in unit.journal(), unit.journal()[-2000:]
    assert not unit.answers()


class Refusal:
    """A drop-in that shortens RestartSec= (30 s in the unit) and extra lines in the unit's environment file, both
    taken back at the end, with the unit's failed state reset."""

    def __init__(self, unit: Unit, env_lines: str) -> None:
        self.unit, self.root = unit, Path(f"/proc/{unit.box.pid1()}/root")
        self.drop = self.root / "etc/systemd/system/vllm.service.d/zz-test.conf"
        self.env_file, self.lines = self.root / "etc/default/vllm", env_lines

    def __enter__(self) -> Refusal:
        self.unit.svc("stop", timeout=300)  # from a stopped unit (a start of a running one does nothing)
        self.kept = self.env_file.read_text()
        self.drop.parent.mkdir(parents=True, exist_ok=True)
        self.drop.write_text("[Service]\nRestartSec=1\n")
        self.env_file.write_text(self.kept + self.lines)
        self.unit.box.sh("systemctl", "daemon-reload", check=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop.unlink()
        self.env_file.write_text(self.kept)
        self.unit.box.sh("systemctl", "daemon-reload")
        self.unit.box.sh("systemctl", "reset-failed", "vllm.service")


def test_a_configuration_the_rig_refuses_is_not_restarted(started):
    """A checkpoint that is not there: the start exits 2, a configuration to fix, and the unit's
    RestartPreventExitStatus=2 keeps systemd from starting it again: one start, failed, its reason in the journal."""
    unit = started[0]
    with Refusal(unit, "CKPT=/srv/no-such-checkpoint\n"):
        cursor = unit.cursor()
        assert unit.svc("start", timeout=300).returncode != 0
        unit.wait(lambda: unit.show("ActiveState")["ActiveState"] == "failed", 120, "the failed state")
        time.sleep(5)  # five RestartSec= of the drop-in: a restart would have begun
        shown = unit.show("ActiveState", "Result", "ExecMainStatus", "NRestarts")
        log = unit.journal(cursor)
        assert shown["ActiveState"] == "failed" and shown["NRestarts"] == "0", (shown, log[-3000:])
        assert shown["ExecMainStatus"] == "2", (shown, log[-3000:])
        assert log.count("Starting vllm.service") == 1 and "/srv/no-such-checkpoint" in log, log[-3000:]
        assert unit.cgroup_procs() == [] and unit.engine() == []


def test_a_busy_port_is_restarted_until_the_start_limit(started):
    """The port taken by another program: each start exits 75 (busy for now), which systemd restarts, until
    StartLimitBurst= starts in StartLimitIntervalSec=; then it gives up. The limit itself is the unit's."""
    unit = started[0]
    burst = int(re.search(r"^StartLimitBurst=(\d+)", (unit.copy / "systemd" / "vllm.service").read_text(), re.M)[1])
    assert burst == int(unit.show("StartLimitBurst")["StartLimitBurst"])
    holder = None
    try:
        with Refusal(unit, ""):  # the unit stopped first: its engine held the port
            holder = subprocess.Popen(["nsenter", "-t", str(unit.box.pid1()), "-a", "python3", "-c",
                                       "import socket, time; s = socket.socket(); "  # past the engine's TIME_WAIT
                                       "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', "
                                       f"{unit.env['PORT']})); s.listen(); time.sleep(600)"])
            unit.wait(lambda: unit.box.sh("bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{unit.env['PORT']}",
                                          timeout=10).returncode == 0 or holder.poll() is not None, 30, "the holder")
            assert holder.poll() is None, "the port's holder could not bind"
            cursor = unit.cursor()
            t0 = time.monotonic()
            assert unit.svc("start", timeout=300).returncode != 0
            unit.wait(lambda: "Start request repeated too quickly." in unit.journal(cursor)
                      and unit.show("ActiveState")["ActiveState"] == "failed", 300, "the start limit")
            log = unit.journal(cursor)
            assert log.count("Starting vllm.service") == burst, log[-3000:]
            assert unit.show("ExecMainStatus")["ExecMainStatus"] == "75", log[-3000:]
            assert unit.cgroup_procs() == [] and unit.engine() == []
            print(f"\nstart limit: {burst} starts, then systemd gave up ({time.monotonic() - t0:.0f} s)")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def test_uninstall_removes_the_unit(started):
    unit = started[0]
    r = unit.svc("uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    for f in ("/etc/systemd/system/vllm.service", "/etc/logrotate.d/vllm"):
        assert f"removed {f}" in r.stdout, r.stdout
    # the environment file the installed fixture edited: the user's settings, kept with a word
    assert "kept /etc/default/vllm: it changed since install" in r.stderr, r.stderr
    assert unit.box.sh("systemctl", "cat", "vllm.service").returncode != 0
    assert not (Path(f"/proc/{unit.box.pid1()}/root") / "var/lib/vllm-rig/installed.toml").exists()
