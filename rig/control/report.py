"""``nox -s report``: one archive a user attaches to a bug report, with no secret in it.

It holds, as text files under ``vllm-rig-report-<time>/``: the doctor's report, the build records, the series
(``series.toml`` and the patches' names and sizes), the profile and the profiles it inherits from, the engine's
command and environment as a start would run them, the engine's record, the versions (the rig's commit, Python,
the build's vLLM and torch, the kernel, the NVIDIA driver), the rig's metrics, and the last lines of the log. A
part that cannot be read says why in its file; the archive is written all the same, atomically.

No secret goes in. Every value of a variable whose name says it is one (KEY, TOKEN, SECRET, PASSWORD, PASS,
CREDENTIAL, AUTH) in this environment and in the checkout's ``.env`` (compose's env file) is replaced by
``<redacted>`` wherever it appears, and so is whatever follows ``Bearer``, ``--api-key`` or ``token=``, before a
byte is written.
"""

from __future__ import annotations

import io
import platform
import re
import subprocess
import tarfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rig.base import atomic
from rig.base.console import say
from rig.control import control, logview
from rig.facts import config, profiles, record
from rig.facts.config import Settings
from rig.plan import serve
from rig.running import enginerec, metrics

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASS|CREDENTIAL|AUTH", re.I)
#: what follows these is a secret whoever wrote it
SECRET_AFTER = re.compile(r"(?i)(bearer\s+|--api-key[=\s]+|api[_-]?key[\"']?\s*[:=]\s*[\"']?|token=)[^\s\"',&]+")
REDACTED = "<redacted>"
LOG_LINES = 400
MIN_SECRET = 4  # shorter values ("1", "on") would blank out ordinary text, and are no secret worth the name


def secrets(env: Mapping[str, str], env_file: Path) -> set[str]:
    """The values to keep out: those of secret-named variables here and in ``env_file``."""
    found = {v for k, v in env.items() if SECRET_NAME.search(k)}
    try:
        for line in env_file.read_text(errors="replace").splitlines():
            key, eq, value = line.strip().removeprefix("export ").partition("=")
            if eq and SECRET_NAME.search(key):
                found.add(value.strip().strip("'\""))
    except OSError:
        pass
    return {v for v in found if len(v.strip()) >= MIN_SECRET}


def redact(text: str, hidden: set[str]) -> str:
    """``text`` with every secret value, and what follows a Bearer, --api-key or token=, replaced."""
    for value in sorted(hidden, key=len, reverse=True):  # a secret inside a longer one: the longer first
        text = text.replace(value, REDACTED)
    return SECRET_AFTER.sub(lambda m: m[1] + REDACTED, text)


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def _log_tail(path: Path) -> str:
    """The log's last lines, read from its end (a log can be large)."""
    with open(path, "rb") as fh:
        return "\n".join(logview.tail(fh, LOG_LINES)) + "\n"


def _run(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cmd[0]}: {exc}"
    return (r.stdout + r.stderr).strip()


def _versions(s: Settings) -> str:
    lines = [f"rig commit: {_run(['git', '-C', str(s.root), 'rev-parse', 'HEAD'])}",
             f"python: {platform.python_version()} ({platform.python_implementation()})",
             f"kernel: {platform.platform()}", f"device: {s.device}"]
    for device in ("cuda", "cpu"):
        inst = record.load(s.record_dir, device).install
        if inst:
            lines.append(f"{device} build: vLLM {inst.vllm_version}, torch {inst.torch}, kernels {inst.route}")
    lines.append("NVIDIA driver: " + _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                           "--format=csv,noheader"]))
    return "\n".join(lines) + "\n"


def _engine(s: Settings, env: Mapping[str, str]) -> str:
    v, p = serve.inputs(s, env)
    plan = serve.plan(s, v, p, serve.check_box(s, v, p, check=False))
    full = plan.engine.full_env(env)
    shown = {k: full[k] for k in sorted(full) if k.startswith(("VLLM_", "CUDA_", "OMP_")) or k in config.VAR_NAMES}
    return (" ".join(plan.engine.argv) + "\n\n" + "\n".join(f"{k}={val}" for k, val in shown.items()) + "\n")


def _profile(s: Settings) -> str:
    out, name, seen = [], s.profile, set()
    while name and name not in seen:
        seen.add(name)
        p = profiles.load(name)
        out.append(f"# {p.path}\n{_read(p.path)}")
        name = p.base
    return "\n".join(out)


def _series(s: Settings) -> str:
    patches = sorted(s.patches_dir.glob("*.patch"))
    listing = "\n".join(f"{p.name} {p.stat().st_size} bytes" for p in patches)
    return f"{_read(s.patches_dir / 'series.toml')}\n# patches\n{listing}\n"


def parts(s: Settings, env: Mapping[str, str]) -> dict[str, Callable[[], str]]:
    """Each file of the archive and how it is read (a part that fails says why in its file)."""
    v = config.serve_settings(env)
    return {
        "doctor.txt": lambda: "\n".join(control.doctor(s, profiles.load(s.profile), v)) + "\n",
        "build.toml": lambda: _read(record.path(s.record_dir, "cuda")),
        "build-cpu.toml": lambda: _read(record.path(s.record_dir, "cpu")),
        "series.txt": lambda: _series(s),
        "profile.toml": lambda: _profile(s),
        "engine-command.txt": lambda: _engine(s, env),
        "engine-record.toml": lambda: _read(enginerec.pid_path(s)),
        "versions.txt": lambda: _versions(s),
        "metrics.prom": lambda: _read(metrics.folder(s.state_dir) / metrics.FILE),
        "log-tail.txt": lambda: _log_tail(Path(s.log)) if s.log else "LOG is empty: the engine's output went "
                                                                                "to its terminal\n",
    }


def write(s: Settings, env: Mapping[str, str], out_dir: Path) -> Path:
    """The archive in ``out_dir``; its path."""
    hidden = secrets(env, s.root / ".env")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    top = f"vllm-rig-report-{stamp}"
    path = out_dir / f"{top}.tar.gz"
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_open(path, "wb") as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
        for name, read in parts(s, env).items():
            try:
                text = read()
            except Exception as exc:  # noqa: BLE001 - a part that cannot be read is reported, not fatal
                text = f"not available: {type(exc).__name__}: {exc}\n"
            data = redact(text, hidden).encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    say(f"report: {path} ({path.stat().st_size:,} bytes; secrets replaced by {REDACTED}): attach it to the issue")
    return path
