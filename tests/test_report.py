"""``nox -s report`` (rig/control/report.py): one archive with what a maintainer asks for, and no secret in it:
secrets planted in the environment, the env file, the engine's record and the log are all replaced."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import checkout_copy

from rig.control import report

PLANTED = {"VLLM_API_KEY": "sk-planted-api-key-0001", "NODES_SECRET": "planted-nodes-secret-0002",
           "HF_TOKEN": "hf_plantedtoken0003", "MY_SERVICE_PASSWORD": "planted-password-0004"}
IN_ENV_FILE = "planted-env-file-secret-0005"
UNNAMED = "planted-bearer-only-0006"  # named by no variable: only the Bearer before it gives it away


def test_the_archive_has_each_part_and_no_planted_secret(tmp_path):
    root = checkout_copy(tmp_path / "rig")
    (root / ".env").write_text(f"# compose's env file\nexport OTHER_API_KEY='{IN_ENV_FILE}'\nPORT=8000\n")
    state, log = tmp_path / "state", tmp_path / "vllm.log"
    state.mkdir()
    (state / "engine.toml").write_text(f'pid = 1\nmodel = "demo"\nnote = "{PLANTED["NODES_SECRET"]}"\n')
    log.write_text("INFO started\n" + "".join(f"line {i}\n" for i in range(600))
                   + f"client sent Authorization: Bearer {UNNAMED}\nenv {PLANTED['HF_TOKEN']} {IN_ENV_FILE}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "PROFILE", "RIG_STATE", "LOG")}
    env.update(PLANTED, RIG_STATE=str(state), LOG=str(log), PROFILE="demo", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "rig.cli", "report", "--out", str(tmp_path / "out")], cwd=root,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    [archive] = (tmp_path / "out").glob("vllm-rig-report-*.tar.gz")
    assert str(archive) in r.stdout + r.stderr and not list((tmp_path / "out").glob(".*"))  # no temporary left
    with tarfile.open(archive) as tar:
        files = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    for name in ("doctor.txt", "build.toml", "series.txt", "profile.toml", "engine-command.txt",
                 "engine-record.toml", "versions.txt", "metrics.prom", "log-tail.txt"):
        assert name in files, sorted(files)
    everything = "\n".join(files.values())
    for secret in (*PLANTED.values(), IN_ENV_FILE, UNNAMED):
        assert secret not in everything, secret
    assert "Bearer <redacted>" in files["log-tail.txt"] and "line 599" in files["log-tail.txt"]
    assert "line 100\n" not in files["log-tail.txt"]  # the last lines only
    assert "vllm serve" in files["engine-command.txt"] and "--max-model-len" in files["engine-command.txt"]
    assert "VLLM_API_KEY=<redacted>" in files["engine-command.txt"]  # the engine's environment holds it
    assert 'base = ' in files["profile.toml"] or "demo" in files["profile.toml"]
    assert "0001-" in files["series.txt"] and "rig commit:" in files["versions.txt"]
    assert files["build.toml"].startswith("not available: FileNotFoundError")  # nothing built there: said


def test_redact_takes_the_longer_secret_first_and_what_follows_a_bearer():
    hidden = report.secrets({"A_KEY": "abcd", "B_TOKEN": "abcdefgh", "PORT": "8000", "X_SECRET": "no"}, Path("/nx"))
    assert hidden == {"abcd", "abcdefgh"}  # PORT is no secret; "no" too short to be one
    text = report.redact("t=abcdefgh u=abcd --api-key zzz9 Authorization: Bearer q.w-e token=t0k&x=1", hidden)
    assert text == ("t=<redacted> u=<redacted> --api-key <redacted> Authorization: Bearer <redacted> "
                    "token=<redacted>&x=1")
