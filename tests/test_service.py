"""The systemd service files, checked by the real systemd-analyze and logrotate, installed into a temp root."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import test_serve
from conftest import ROOT, run_rig

from rig.control import service, unitfile
from rig.control.unitfile import NotifySocket, commands
from rig.control.unitfile import environment as unit_env
from rig.control.unitfile import settings as settings_of
from rig.facts import config, profiles
from rig.running import enginerec, health

rig_env = test_serve.rig_env  # the engine double as .venv/bin/vllm

needs_systemd = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
needs_logrotate = pytest.mark.skipif(not shutil.which("logrotate"), reason="logrotate not installed")


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def install(root: Path, *extra: str, env: dict | None = None):
    return run_rig({**os.environ, **(env or {})}, "service", "install", "--root", str(root), *extra)


def test_install_writes_the_three_files_with_this_repo_in_place(tmp_path):
    r = install(tmp_path, env={"LOG": "/var/log/rig-test.log"})
    assert r.code == 0, r.text
    assert files_under(tmp_path) == {service.UNIT, service.ENV_FILE, service.LOGROTATE, service.RECORD}
    unit = (tmp_path / service.UNIT).read_text()
    assert "/opt/vllm" not in unit and f"\nExecStart={ROOT}/start.sh --foreground --no-build\n" in unit
    assert f"\nExecStartPre={ROOT}/build.sh --pre-start\n" in unit
    assert "Environment=LOG=/var/log/rig-test.log" in unit and f"ReadWritePaths={ROOT} /var/log " in unit
    for key in ("KillMode=control-group", "Type=notify", "NotifyAccess=all", "LimitMEMLOCK=infinity",
                "EnvironmentFile=-/etc/default/vllm", "NoNewPrivileges=yes",
                "ProtectSystem=strict", "PrivateTmp=yes", "DevicePolicy=closed", "Restart=on-failure"):
        assert key in unit, key
    assert not re.search(r"^(PrivateDevices|MemoryDenyWriteExecute)=", unit, re.M)
    assert "AF_UNIX" in unit and "char-nvidia* rwm" in unit
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M)[1])
    served = config.serve_settings({})
    assert stop > served.stop_timeout  # the drain fits before systemd's SIGKILL
    start = int(re.search(r"^TimeoutStartSec=(\d+)", unit, re.M)[1])
    assert start > served.start_timeout + served.stop_timeout  # the rig's own limit, and its message, come first
    assert not re.search(r"^(RestartSteps|RestartMaxDelaySec)=", unit, re.M)
    env = tmp_path / service.ENV_FILE
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    text = env.read_text()
    assert "\nMODEL_NAME=Hinata\n" in text and "\n#CKPT=" in text and "\n#VLLM_API_KEY=" in text
    assert "/var/log/rig-test.log {" in (tmp_path / service.LOGROTATE).read_text()


@needs_systemd
def test_systemd_analyze_verifies_the_unit_and_scores_it(tmp_path):
    assert install(tmp_path).code == 0
    unit = tmp_path / service.UNIT
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    mine = [ln for ln in v.stderr.splitlines() if "vllm.service" in ln]
    assert v.returncode == 0 and not mine, v.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True,
                         text=True)
    m = re.search(r"Overall exposure level for vllm.service: ([\d.]+) (\w+)", sec.stdout)
    assert m, sec.stdout[-2000:] + sec.stderr
    print(f"systemd-analyze security: {m[1]} {m[2]}")
    assert float(m[1]) <= 5.0
    # read as meant: the supervisor, a child of uv, may notify (NotifyAccess=all); 0.2 of the score
    assert re.search(r"✗ NotifyAccess=\s+Service child processes may alter service state", sec.stdout)


@needs_logrotate
def test_logrotate_accepts_the_policy(tmp_path):
    conf = tmp_path / "vllm"
    conf.write_text(service.render_logrotate(ROOT, str(tmp_path / "vllm.log")))
    r = subprocess.run(["logrotate", "-d", "-s", str(tmp_path / "state"), str(conf)], capture_output=True, text=True)
    assert r.returncode == 0 and "error" not in r.stderr.lower(), r.stderr
    for want in ("after 1 days (14 rotations)", "log files >= 104857600 are rotated earlier", "old logs are removed"):
        assert want in r.stderr, want


PRODUCER = """
import sys, time
for i in range(int(sys.argv[1])):
    sys.stdout.write(f"line {i:06d} {'x' * 60}\\n")
    sys.stdout.flush()
    time.sleep(0.002)
"""


@needs_logrotate
def test_forced_rotations_while_the_engine_writes_lose_no_line(tmp_path):
    """The rig's log writer (as start.sh runs the engine) under logrotate -f, several times mid-stream."""
    log = tmp_path / "vllm.log"
    conf = tmp_path / "vllm.conf"
    conf.write_text(service.render_logrotate(ROOT, str(log)).replace("    su root root\n", ""))
    n = 1500
    w = subprocess.Popen([sys.executable, "-m", "rig.running.logpump", str(log), "--", sys.executable, "-c", PRODUCER,
                          str(n)], cwd=ROOT)
    rotations = 0
    while w.poll() is None:
        time.sleep(0.4)
        r = subprocess.run(["logrotate", "-f", "-s", str(tmp_path / "state"), str(conf)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        rotations += 1
    assert w.returncode == 0 and rotations >= 3
    data = b""
    for p in sorted(tmp_path.glob("vllm.log*")):
        data += gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    seen = [int(ln.split()[1]) for ln in data.decode().splitlines()]
    assert sorted(seen) == list(range(n)), f"lost {sorted(set(range(n)) - set(seen))[:10]} of {n}"
    assert list(tmp_path.glob("vllm.log.*.gz"))  # the older ones compressed, the newest one not (delaycompress)


def test_the_log_writer_passes_the_exit_status_and_ignores_sigterm(tmp_path):
    log = tmp_path / "x.log"
    r = subprocess.run([sys.executable, "-m", "rig.running.logpump", str(log), "--", sys.executable, "-c",
                        "print('bye'); raise SystemExit(7)"], cwd=ROOT)
    assert r.returncode == 7 and log.read_text() == "bye\n"
    r = subprocess.run([sys.executable, "-m", "rig.running.logpump", str(log), "--", "/no/such/engine"], cwd=ROOT)
    assert r.returncode == 127 and "could not start /no/such/engine" in log.read_text()


def test_install_twice_then_uninstall_twice(tmp_path):
    before = tmp_path / "etc" / "hosts"
    before.parent.mkdir(parents=True)
    before.write_text("127.0.0.1 localhost\n")
    assert install(tmp_path).code == 0
    first = {f: (tmp_path / f).read_bytes() for f in files_under(tmp_path)}
    again = install(tmp_path)
    assert again.code == 0 and "kept" in again.out
    assert {f: (tmp_path / f).read_bytes() for f in files_under(tmp_path)} == first
    u = run_rig(dict(os.environ), "service", "uninstall", "--root", str(tmp_path))
    assert u.code == 0, u.text
    assert files_under(tmp_path) == {"etc/hosts"}
    u2 = run_rig(dict(os.environ), "service", "uninstall", "--root", str(tmp_path))
    assert u2.code == 0 and "nothing installed" in u2.out
    assert files_under(tmp_path) == {"etc/hosts"}


def test_an_existing_environment_file_survives_install_and_uninstall(tmp_path):
    env = tmp_path / service.ENV_FILE
    env.parent.mkdir(parents=True)
    env.write_text("MODEL_NAME=Mine\nVLLM_API_KEY=keep-me\n")
    r = install(tmp_path)
    assert r.code == 0 and f"kept {env}" in r.out
    assert env.read_text() == "MODEL_NAME=Mine\nVLLM_API_KEY=keep-me\n"
    assert run_rig(dict(os.environ), "service", "uninstall", "--root", str(tmp_path)).code == 0
    assert env.read_text() == "MODEL_NAME=Mine\nVLLM_API_KEY=keep-me\n"


def test_an_edited_file_is_kept_by_uninstall(tmp_path):
    assert install(tmp_path).code == 0
    env = tmp_path / service.ENV_FILE
    env.write_text(env.read_text() + "CKPT=/data/mine\n")
    u = run_rig(dict(os.environ), "service", "uninstall", "--root", str(tmp_path))
    assert u.code == 0 and "changed since install" in u.err
    assert env.exists() and not (tmp_path / service.UNIT).exists()


def test_a_foreign_logrotate_policy_is_replaced_with_a_warning_and_kept(tmp_path):
    rot = tmp_path / service.LOGROTATE
    rot.parent.mkdir(parents=True)
    rot.write_text("/var/log/vllm.log { weekly }\n")
    r = install(tmp_path)
    assert r.code == 0 and "replacing the existing" in r.err
    assert "copytruncate" in rot.read_text()
    assert (tmp_path / "var/lib/vllm-rig/logrotate.vllm.before").read_text() == "/var/log/vllm.log { weekly }\n"


def test_the_wrapper_and_destdir(tmp_path):
    r = subprocess.run([str(ROOT / "scripts/install-as-service.sh"), "install"], cwd=tmp_path,
                       env={**os.environ, "DESTDIR": str(tmp_path / "stage")}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "stage" / service.UNIT).exists()


def test_verbs_that_need_systemd_say_so(tmp_path):
    for verb in ("start", "stop", "update"):
        r = run_rig(dict(os.environ), "service", verb, "--root", str(tmp_path))
        assert r.code == 2, r.text
        assert "expected a running systemd" in r.err and "Fix:" in r.err


def test_logs_of_a_missing_log_is_one_line(tmp_path):
    r = run_rig({**os.environ, "LOG": str(tmp_path / "none.log")}, "service", "logs")
    assert r.code == 2 and "the engine log: expected a file at" in r.err


@pytest.mark.parametrize("verb", ["install", "uninstall"])
def test_without_a_prefix_it_needs_root(monkeypatch, verb):
    from rig.base.errors import BadInput

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("DESTDIR", raising=False)
    with pytest.raises(BadInput) as e:
        service.run(config.settings(), verb, None, 200)
    assert e.value.code == 2
    assert f"service {verb}: expected root" in e.value.message and "found uid 1000" in e.value.message
    assert f"sudo scripts/install-as-service.sh {verb}" in e.value.message


def test_the_environment_file_uncommented_as_written_keeps_every_default():
    """Uncommenting a line must not set a value the default never had (the word 'empty', 'unset')."""
    from rig.control import service
    from rig.facts import config

    env = {}
    for line in service.render_env().splitlines():
        if line.startswith("#") and "=" in line and not line.startswith("# "):
            k, v = line[1:].split("=", 1)
            env[k] = v
        elif "=" in line and not line.startswith("#"):
            env.update([line.split("=", 1)])
    assert {"VLLM_API_KEY", "CUDA_HOME", "SCALES", "HOST", "PORT"} <= set(env)
    assert env["VLLM_API_KEY"] == "" and env["CUDA_HOME"] == ""
    assert config.settings(env) == config.settings({})
    served = config.serve_settings(env)
    assert served == config.serve_settings({"MODEL_NAME": profiles.load("reference").service_name})
    assert served.api_key == ""


def test_a_world_readable_environment_file_is_tightened_with_a_word(tmp_path):
    env = tmp_path / "etc" / "default" / "vllm"
    env.parent.mkdir(parents=True)
    env.write_text("VLLM_API_KEY=s3cret\n")
    env.chmod(0o644)
    r = run_rig({**os.environ, "DESTDIR": str(tmp_path)}, "service", "install")
    assert r.code == 0, r.text
    assert env.read_text() == "VLLM_API_KEY=s3cret\n" and env.stat().st_mode & 0o777 == 0o600
    assert "readable by other users" in r.err and "made it 0600" in r.err


def test_the_compose_env_file_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert r.returncode == 0


# --- the unit's commands, run as systemd runs them --------------------------------------------------------------

def engine_processes(pgid: int, ckpt: str) -> list[str]:
    """The engine's processes still there: by its process group, and by command line (the double's server, and
    its child named like vLLM's ``VLLM::EngineCore``)."""
    left = [f"{p} (group {pgid})" for p in enginerec.group_members(pgid)]
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and ckpt in cmd and ("VLLM::" in cmd or "engine_double" in cmd):
            left.append(f"{p.info['pid']} ({cmd[:80]})")
    return left


def systemd_stop(main: subprocess.Popen, unit: dict[str, list[str]], env: dict, cwd: str,
                 stop_timeout: float) -> list[int]:
    """unitfile.stop, with the rig's ExecStop checked: exit 0 and nothing of the engine left."""
    runs, killed = unitfile.stop(main, unit, env, cwd, stop_timeout)
    for r in runs:
        assert r.returncode == 0 and "no process of it is left" in r.stdout, r.stdout + r.stderr
    return killed


@pytest.fixture
def unit_env_file(tmp_path, rig_env):
    """The unit installed under a temporary root, and the engine double (tests/test_serve.py's) set in the
    service's environment file as an admin would write it: DEVICE=cpu and the demo profile, whose box check
    passes on a box without a GPU (the unit runs start.sh without --skip-box-check)."""
    root = tmp_path / "root"
    log = rig_env["LOG"]
    r = install(root, env={"LOG": log, "PROFILE": "demo"})
    assert r.code == 0, r.text
    keep = ("VENV_DIR", "CKPT", "PORT", "RIG_STATE", "CACHE_ROOT", "START_TIMEOUT", "STOP_TIMEOUT", "DOUBLE_RECORD")
    extra = {k: rig_env[k] for k in keep} | {"DEVICE": "cpu", "DOUBLE_DELAY": "2", "DOUBLE_CHILD": "1"}
    env_file = root / service.ENV_FILE
    env_file.write_text(env_file.read_text() + "".join(f"{k}={v}\n" for k, v in extra.items()))
    return root, settings_of((root / service.UNIT).read_text()), rig_env


def test_the_unit_starts_notifies_and_stops_as_systemd_would(unit_env_file):
    """ExecStart in its own process group with the unit's environment; READY=1 only once the engine answers a
    one-token generation; a stop with KillMode=control-group leaves no engine process and exits 0. ExecStartPre
    is the real ./build.sh, not run here (a build takes minutes): the next test runs it where it stops at once."""
    root, unit, rig_env = unit_env_file
    assert unit["Type"] == ["notify"] and unit["KillMode"] == ["control-group"]
    assert commands(unit, "ExecStartPre") == [[str(ROOT / "build.sh"), "--pre-start"]]
    notify = NotifySocket()
    env = unit_env(unit, root, notify.name)
    assert env["LOG"] == rig_env["LOG"] and env["PROFILE"] == "demo" and "HOME" not in env
    port = int(env["PORT"])
    notify.on_ready.append(lambda: health.health("127.0.0.1", port, env["MODEL_NAME"]))
    (argv,) = commands(unit, "ExecStart")
    assert argv == [str(ROOT / "start.sh"), "--foreground", "--no-build"]
    assert commands(unit, "ExecStop") == [[str(ROOT / "scripts" / "nox.sh"), "-s", "stop"]]
    main = subprocess.Popen(argv, env=env, cwd=unit["WorkingDirectory"][0], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(main.stdout), daemon=True).start()
    try:
        assert notify.ready.wait(90), "no READY=1:\n" + "".join(out)
        assert notify.on_ready == [(True, "one token generated")]  # healthy at the moment READY=1 came
        first, ready = notify.messages[0], next(m for m in notify.messages if "READY=1" in m[2])
        assert first[2].startswith("STATUS=starting the engine") and first[0] < ready[0]
        assert "Application startup complete" in Path(env["LOG"]).read_text()
        rec = test_serve.record(env)
        sender = ready[1]
        tree = [p.pid for p in psutil.Process(main.pid).children(recursive=True)]
        # the supervisor, a child of uv: not the main process (so NotifyAccess=all), not an engine process
        assert sender in tree and sender != main.pid and os.getpgid(sender) != rec["pgid"]
        stop_timeout = float(unit["TimeoutStopSec"][0]) / 6  # 15 s instead of 90
        killed = systemd_stop(main, unit, env, unit["WorkingDirectory"][0], stop_timeout)
    finally:
        if main.poll() is None:
            main.kill()
        notify.close()
    text = "".join(out)
    clean = {0, *map(int, unit.get("SuccessExitStatus", [""])[0].split() or [])}  # what systemd counts as clean
    assert main.returncode in clean, text
    assert not killed, f"systemd's SIGKILL was needed for {killed}:\n{text}"
    assert "engine stopped by nox -s stop" in text or "engine stopped (exit" in text
    assert not engine_processes(rec["pgid"], env["CKPT"])
    assert any("STOPPING=1" in m[2] for m in notify.messages)


def test_a_failing_exec_start_pre_starts_nothing(unit_env_file):
    """The real ExecStartPre (./build.sh) with the unit's environment, on a bad value in the environment file: it
    stops before any build step, naming the variable, and systemd runs no ExecStart."""
    root, unit, rig_env = unit_env_file
    env_file = root / service.ENV_FILE
    env_file.write_text(env_file.read_text() + "MAX_JOBS=many\n")
    env = unit_env(unit, root, "@unused")
    (argv,) = commands(unit, "ExecStartPre")
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env, cwd=unit["WorkingDirectory"][0], start_new_session=True,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "MAX_JOBS: expected a whole number >= 1, found 'many'" in r.stderr and "[1/" not in r.stdout
    assert time.monotonic() - t0 < 60
    assert not Path(rig_env["DOUBLE_RECORD"]).exists()  # no ExecStart: no engine


def test_a_worker_node_is_installed_with_its_rank_and_the_same_unit(tmp_path):
    """Beyond one box: each node runs the one unit; install --node-rank writes the rank into the environment
    file (the unit says why no ordering across machines is needed), and says what is left to set."""
    r = run_rig(dict(os.environ), "service", "install", "--root", str(tmp_path), "--node-rank", "1")
    assert r.code == 0, r.text
    env = (tmp_path / service.ENV_FILE).read_text()
    assert "\nNODE_RANK=1\n" in env and "\n#NODES=1\n" in env and "\n#HEAD_ADDR=\n" in env
    assert "this node is rank 1: set NODES, HEAD_ADDR and NODES_SECRET there" in r.out
    unit = (tmp_path / service.UNIT).read_text()
    assert "a worker waits for the head's" in unit and "ExecStart=" + str(ROOT) + "/start.sh" in unit
    again = run_rig(dict(os.environ), "service", "install", "--root", str(tmp_path), "--node-rank", "2")
    assert again.code == 0 and "set NODE_RANK=2 (and NODES, HEAD_ADDR) in" in again.err


def test_the_units_limits_are_read_from_the_unit_itself():
    import resource

    from rig.base import limits
    assert limits.asked() == {"LimitNOFILE": 65536, "LimitMEMLOCK": resource.RLIM_INFINITY}


def test_under_the_unit_a_limit_the_box_did_not_grant_is_named(tmp_path):
    """A box whose root lacks CAP_SYS_RESOURCE starts the unit with lower limits than it asks for, silently:
    the foreground start under systemd (NOTIFY_SOCKET set) names each one; outside the unit nothing is said."""
    import resource

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))

    env = {**os.environ, "RIG_STATE": str(tmp_path / "state"), "LOG": "", "NOTIFY_SOCKET": str(tmp_path / "notify")}
    argv = [sys.executable, "-m", "rig.cli", "start", "--demo", "--dry-run", "--foreground", "--no-build",
            "--skip-box-check"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, preexec_fn=lowered)
    assert "LimitNOFILE: the unit asks for 65536, this process got 1024 (hard limit 1024) for open files" in r.stderr, \
        r.stdout + r.stderr
    assert "LimitMEMLOCK: the unit asks for infinity, this process got 65536" in r.stderr
    assert "--ulimit" in r.stderr
    env.pop("NOTIFY_SOCKET")
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, preexec_fn=lowered)
    assert "the unit asks for" not in r.stdout + r.stderr


STEADY = """
import sys, time
for i in range(int(sys.argv[1])):
    sys.stdout.write(f"line {i:06d}\\n")
    sys.stdout.flush()
    time.sleep(0.001)
"""


def test_a_full_log_disk_drops_lines_and_says_so_and_the_engine_never_blocks(tmp_path):
    """The log on a 256 KiB tmpfs, filled while the engine writes, then freed: the log writer keeps reading (the
    writer finishes, exit 0), keeps every line written before, drops what it cannot write, and says how much
    once it can write again."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        log = disk / "vllm.log"
        n = 3000
        w = subprocess.Popen([sys.executable, "-m", "rig.running.logpump", str(log), "--", sys.executable, "-c", STEADY,
                              str(n)], cwd=ROOT)
        time.sleep(1.0)
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
            except OSError:
                pass
        time.sleep(1.5)
        filler.unlink()
        assert w.wait(timeout=60) == 0  # the producer never met a closed or a full pipe
        text = log.read_text()
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    notes = [ln for ln in text.splitlines() if "the log writer dropped" in ln]
    assert len(notes) == 1 and "No space left on device" in notes[0], notes
    dropped = int(re.search(r"dropped (\d+) line\(s\)", notes[0])[1])
    seen = [int(m[1]) for m in re.finditer(r"^line (\d{6})$", text, re.M)]
    assert seen == sorted(seen) and seen[-1] == n - 1 and dropped > 0
    assert len(seen) + dropped == n, (len(seen), dropped)
    before = [int(m[1]) for m in re.finditer(r"^line (\d{6})$", text.split(notes[0])[0], re.M)]
    assert before and before == list(range(len(before)))  # what was written before the disk filled is all there


def test_the_service_update_builds_with_the_services_environment_not_the_shells(tmp_path, monkeypatch):
    """``install-as-service.sh update`` from a root shell: the build and switch it makes must be the ones the unit's
    ExecStartPre checks and its ExecStart serves, so the unit's variables win and the shell's rig variables are
    not read at all."""
    assert install(tmp_path, env={"LOG": "/var/log/rig-test.log"}).code == 0
    env_file = tmp_path / service.ENV_FILE
    env_file.write_text(env_file.read_text() + "DEVICE=cpu\nPORT=18123\n")
    for key, value in {"DEVICE": "cuda", "VENV_DIR": "/elsewhere", "HOME": "/root", "NOTIFY_SOCKET": "/run/x"}.items():
        monkeypatch.setenv(key, value)
    t = service.Target(tmp_path, ROOT, "/var/log/rig-test.log")
    env = service.service_env(t, "update")
    assert env["DEVICE"] == "cpu" and env["PORT"] == "18123" and env["LOG"] == "/var/log/rig-test.log"
    assert env["PROFILE"] == config.settings({}).profile and env["HOME"] == "/root"
    assert "VENV_DIR" not in env and "NOTIFY_SOCKET" not in env and "INVOCATION_ID" not in env


def test_a_service_update_with_no_unit_installed_says_to_install_it(tmp_path):
    with pytest.raises(service.BadInput) as e:
        service.service_env(service.Target(tmp_path, ROOT, "/var/log/vllm.log"), "update")
    assert "no such file" in e.value.message and "install-as-service.sh install first" in e.value.message


@pytest.mark.parametrize("where", ["/tmp/rig", "/var/tmp/x/rig"])
def test_a_repository_the_units_private_tmp_hides_is_refused(where):
    with pytest.raises(service.BadInput) as e:
        service.check_repo_path(Path(where))
    assert where in e.value.message and "PrivateTmp=yes" in e.value.message and "/opt/vllm" in e.value.message


def test_a_repository_elsewhere_is_accepted():
    service.check_repo_path(Path("/opt/vllm"))
    service.check_repo_path(Path("/tmpfoo/rig"))
