"""The systemd service: install, start, stop, status, update, rollback, logs, uninstall.

``install`` writes three files under a root prefix (``/`` by default; ``--root DIR`` or
``DESTDIR`` for a staging tree or the tests): the unit (``systemd/vllm.service`` with the repo's
path and the log path filled in), the environment file (only when absent: an existing one holds
the user's settings and key, and is never overwritten), and the logrotate policy. What it wrote is
recorded with each file's sha256 in ``var/lib/vllm-rig/installed.toml``, so ``uninstall`` removes
only those files, keeps one the user has edited since, and is a no-op the second time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from rig import REPO_ROOT
from rig.base import atomic
from rig.base.console import say, warn
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.hashing import sha256_file
from rig.control import unitfile, update
from rig.facts import config, profiles

TEMPLATE_ROOT = "/opt/vllm"
TEMPLATE_LOG = "/var/log/vllm.log"
UNIT = "etc/systemd/system/vllm.service"
ENV_FILE = "etc/default/vllm"
LOGROTATE = "etc/logrotate.d/vllm"
RECORD = "var/lib/vllm-rig/installed.toml"


@dataclass(frozen=True)
class Target:
    root: Path  # the prefix: "/" for the real system
    repo: Path
    log: str

    @property
    def real(self) -> bool:
        return self.root == Path("/")

    def path(self, rel: str) -> Path:
        return self.root / rel


def render_unit(repo: Path, log: str) -> str:
    text = (repo / "systemd" / "vllm.service").read_text()
    text = text.replace(TEMPLATE_LOG, log).replace(TEMPLATE_ROOT, str(repo))
    return text.replace("ReadWritePaths=" + str(repo) + " /var/log ",
                        f"ReadWritePaths={repo} {Path(log).parent} ")


def render_logrotate(repo: Path, log: str) -> str:
    return (repo / "systemd" / "vllm.logrotate").read_text().replace(TEMPLATE_LOG, log)


def render_env(profile: str = "reference", node_rank: int | None = None) -> str:
    """The service's environment file: every service variable as a commented default, and the one value the
    service sets differently from start.sh: the profile's service name (and this node's rank, for a node of a
    multi-node engine: NODES, HEAD_ADDR and NODES_SECRET are then to be set, the same on every node)."""
    env_set = {"PROFILE": profile, "MODEL_NAME": profiles.load(profile).service_name}
    if node_rank is not None:
        env_set["NODE_RANK"] = str(node_rank)
    lines = ["# Settings of the vllm service (scripts/install-as-service.sh), read by systemd at each start.",
             "# Mode 0600: it can hold VLLM_API_KEY and NODES_SECRET. Uncomment a line to change that default; then",
             "# scripts/install-as-service.sh stop && scripts/install-as-service.sh start.", ""]
    for v in config.VARS:
        if not v.service:
            continue
        lines.append(f"# {v.name}: {v.meaning.replace('`', '')}"
                     + (f" Default: {v.default.replace('`', '')}." if v.literal is None else ""))
        if v.name in env_set:
            lines.append(f"{v.name}={env_set[v.name]}")
        else:  # uncommented as written, each line keeps the default (a derived one is left empty)
            lines.append(f"#{v.name}={v.literal or ''}")
    return "\n".join(lines) + "\n"


def _load_record(t: Target) -> dict:
    try:
        return tomllib.loads(t.path(RECORD).read_text())
    except FileNotFoundError:
        return {}


def _need_root(t: Target, verb: str) -> None:
    if t.real and os.geteuid() != 0:
        raise BadInput(problem(f"service {verb}", "root (it writes /etc/systemd/system, /etc/default, "
                               "/etc/logrotate.d)", f"uid {os.geteuid()}",
                               f"sudo scripts/install-as-service.sh {verb}, or --root DIR to stage the files"))


def _systemd_running(t: Target) -> bool:
    return t.real and Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def _require_systemd(t: Target, what: str) -> None:
    if not _systemd_running(t):
        where = f"files staged under {t.root}" if not t.real else "systemd is not running on this machine"
        raise BadInput(problem(what, "a running systemd", where,
                               "run this on the serving host itself (booted with systemd)"))


def _systemctl(t: Target, *args: str, check: bool = True) -> int:
    _require_systemd(t, f"systemctl {' '.join(args)}")
    r = subprocess.run(["systemctl", *args])
    if check and r.returncode != 0:
        raise WorkFailed(problem(f"systemctl {' '.join(args)}", "exit 0", f"exit {r.returncode}",
                                 "journalctl -u vllm -n 50 tells why"))
    return r.returncode


#: Folders the unit's PrivateTmp=yes replaces with the service's own, empty ones.
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def check_repo_path(repo: Path) -> None:
    """The service runs the repository in place; under a folder PrivateTmp= hides it would not exist for the
    service (systemd fails each start with 226/NAMESPACE and nothing else)."""
    real = repo.resolve()
    for hidden in PRIVATE_TMP:
        if real == hidden or hidden in real.parents:
            raise BadInput(problem("the repository's path for the service",
                                   f"outside {' and '.join(map(str, PRIVATE_TMP))}",
                                   f"{real} (the unit's PrivateTmp=yes gives the service its own empty {hidden})",
                                   "clone or move the rig elsewhere (/opt/vllm, as the unit's template has it) and "
                                   "install from there"))


def install(t: Target, node_rank: int | None = None) -> int:
    _need_root(t, "install")
    if t.real:
        check_repo_path(t.repo)
    record = _load_record(t)
    files = record.get("files", {})
    unit = t.path(UNIT)
    atomic.write_text(unit, render_unit(t.repo, t.log), 0o644)
    files[UNIT] = sha256_file(unit)
    say(f"wrote {unit} (runs {t.repo}/build.sh, then {t.repo}/start.sh --foreground --no-build; log {t.log})")

    env = t.path(ENV_FILE)
    if env.exists():
        say(f"kept {env}: it exists, and holds your settings (never overwritten)")
        if node_rank is not None and f"\nNODE_RANK={node_rank}\n" not in f"\n{env.read_text()}":
            warn(f"set NODE_RANK={node_rank} (and NODES, HEAD_ADDR) in {env} yourself: it was kept as it is")
        mode = env.stat().st_mode & 0o777
        if mode & 0o077:  # it can hold VLLM_API_KEY: readable by its owner only
            env.chmod(0o600)
            warn(f"{env} was mode {mode:04o}, readable by other users, and can hold VLLM_API_KEY: made it 0600")
    else:
        atomic.write_text(env, render_env(config.settings().profile, node_rank), 0o600)
        files[ENV_FILE] = sha256_file(env)
        say(f"wrote {env} (mode 0600; edit it to set MODEL_NAME, CKPT, VLLM_API_KEY, ...)"
            + (f"; this node is rank {node_rank}: set NODES, HEAD_ADDR and NODES_SECRET there, as on "
               "every node"
               if node_rank is not None else ""))

    rot = t.path(LOGROTATE)
    new = render_logrotate(t.repo, t.log)
    if rot.exists() and rot.read_text() != new and LOGROTATE not in files:
        saved = t.path(RECORD).parent / "logrotate.vllm.before"
        atomic.write_bytes(saved, rot.read_bytes())
        warn(f"replacing the existing {rot} (a policy the rig did not write); the old one is kept as {saved}")
    atomic.write_text(rot, new, 0o644)
    files[LOGROTATE] = sha256_file(rot)
    say(f"wrote {rot} (daily or at 100 MB, 14 kept, compressed, 60 days)")

    atomic.write_text(t.path(RECORD), "# Files scripts/install-as-service.sh installed, with their sha256.\n"
                      + tomli_w.dumps({"repo": str(t.repo), "files": files}), 0o644)
    if _systemd_running(t):
        _systemctl(t, "daemon-reload")
        _systemctl(t, "enable", "vllm.service")
        say("enabled vllm.service (starts at boot); start it: scripts/install-as-service.sh start")
    elif t.real:
        say("systemd is not running here: run `systemctl daemon-reload && systemctl enable vllm` on the host")
    return 0


def uninstall(t: Target) -> int:
    _need_root(t, "uninstall")
    record = _load_record(t)
    if not record:
        say(f"nothing installed (no {t.path(RECORD)}); nothing to remove")
        return 0
    if _systemd_running(t):
        _systemctl(t, "disable", "--now", "vllm.service", check=False)
    for rel, digest in record.get("files", {}).items():
        p = t.path(rel)
        if not p.exists():
            continue
        if sha256_file(p) != digest:
            warn(f"kept {p}: it changed since install (your edits); remove it by hand if you no longer want it")
            continue
        p.unlink()
        say(f"removed {p}")
    t.path(RECORD).unlink()
    if _systemd_running(t):
        _systemctl(t, "daemon-reload")
    return 0


#: What the update keeps of the caller's environment; every other variable is the service's own.
CALLER_KEEPS = ("HOME", "TERM", "NO_COLOR", "USER", "LOGNAME")


def service_env(t: Target, verb: str) -> dict[str, str]:
    """The environment the service runs with (the installed unit's Environment= and its environment file), for an
    update or rollback run from a shell: the shell's own variables (DEVICE, PROFILE, ... or none) would build and
    switch a different build from the one the unit's ExecStartPre checks and its ExecStart serves."""
    unit = t.path(UNIT)
    if not unit.exists():
        raise BadInput(problem(f"service {verb}", f"the unit installed at {unit}", "no such file",
                               "scripts/install-as-service.sh install first, or nox -s update for an engine started "
                               "with ./start.sh"))
    env = unitfile.environment(unitfile.settings(unit.read_text()), t.root, notify="")
    for key in ("NOTIFY_SOCKET", "INVOCATION_ID"):
        env.pop(key, None)
    say(f"service {verb}: with the service's environment ({unit}'s Environment= and {t.path(ENV_FILE)})")
    return {**{k: os.environ[k] for k in CALLER_KEEPS if k in os.environ}, **env}


VERBS = ("install", "start", "stop", "status", "update", "rollback", "logs", "uninstall")


def run(s: config.Settings, verb: str, root: str | None, lines: int, node_rank: int | None = None) -> int:
    """``scripts/install-as-service.sh VERB``; ``root``: a prefix instead of / (else DESTDIR, else /)."""
    prefix = Path(root or s.destdir).resolve()
    t = Target(prefix, REPO_ROOT, s.log or TEMPLATE_LOG)
    if verb == "install":
        return install(t, node_rank)
    if verb == "uninstall":
        return uninstall(t)
    if verb == "logs":
        log = Path(t.log)
        if not log.exists():
            raise BadInput(problem("the engine log", f"a file at {log}", "no such file",
                                   "start the service first, or set LOG to where it writes"))
        os.execvp("tail", ["tail", "-n", str(lines), "-F", str(log)])
    if verb in ("update", "rollback"):
        _need_root(t, verb)
        _require_systemd(t, f"service {verb}")  # before a build that could take an hour
        env = service_env(t, verb)
        engine = update.systemd("vllm.service")
        return update.update(env, engine) if verb == "update" else update.rollback(env, engine)
    if verb == "status":
        return _systemctl(t, "status", "--no-pager", "vllm.service", check=False)
    _need_root(t, verb)
    if verb == "start":  # the operator's own start: a crash loop's start limit must not refuse it
        _systemctl(t, "reset-failed", "vllm.service", check=False)
    return _systemctl(t, verb, "vllm.service")
