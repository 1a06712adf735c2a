"""The systemd service files, checked by the real systemd-analyze and logrotate, installed into a temp root."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_rig

from rig import config, profiles, service

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
    assert "/opt/vllm" not in unit and f"ExecStart={ROOT}/start.sh --foreground" in unit
    assert "Environment=LOG=/var/log/rig-test.log" in unit and f"ReadWritePaths={ROOT} /var/log " in unit
    for key in ("KillMode=mixed", "LimitMEMLOCK=infinity", "EnvironmentFile=-/etc/default/vllm", "NoNewPrivileges=yes",
                "ProtectSystem=strict", "PrivateTmp=yes", "DevicePolicy=closed", "Restart=on-failure"):
        assert key in unit, key
    assert not re.search(r"^(PrivateDevices|MemoryDenyWriteExecute)=", unit, re.M)
    assert "AF_UNIX" in unit and "char-nvidia* rwm" in unit
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M)[1])
    assert stop > config.serve_settings({}).stop_timeout  # the drain fits before systemd's SIGKILL
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
    w = subprocess.Popen([sys.executable, "-m", "rig.logpump", str(log), "--", sys.executable, "-c", PRODUCER,
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
    r = subprocess.run([sys.executable, "-m", "rig.logpump", str(log), "--", sys.executable, "-c",
                        "print('bye'); raise SystemExit(7)"], cwd=ROOT)
    assert r.returncode == 7 and log.read_text() == "bye\n"
    r = subprocess.run([sys.executable, "-m", "rig.logpump", str(log), "--", "/no/such/engine"], cwd=ROOT)
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
    from rig.errors import BadInput

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("DESTDIR", raising=False)
    with pytest.raises(BadInput) as e:
        service.run(config.settings(), verb, None, 200)
    assert e.value.code == 2
    assert f"service {verb}: expected root" in e.value.message and "found uid 1000" in e.value.message
    assert f"sudo scripts/install-as-service.sh {verb}" in e.value.message


def test_the_environment_file_uncommented_as_written_keeps_every_default():
    """Uncommenting a line must not set a value the default never had (the word 'empty', 'unset')."""
    from rig import config, service

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
