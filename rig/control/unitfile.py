"""The service's unit file run as systemd runs it, where no systemd runs (tests, benchmarks/soak.py, a container).

One reading of the unit for everything that plays systemd's part: its settings, its ``Exec*=`` command lines,
the clean environment it gives the service, the notify socket of a ``Type=notify`` service, and a stop with
``KillMode=control-group``. What it models is what systemd 252 (Debian 12) does with ``systemd/vllm.service``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a system service's PATH


def settings(unit: str) -> dict[str, list[str]]:
    """Each setting of a unit file with its values in order (the sections' keys do not overlap in ours)."""
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def commands(unit: dict[str, list[str]], key: str) -> list[list[str]]:
    """The argv of each ``Exec*=`` line: systemd's prefixes (-, @, :, +, !) dropped, words split as it does."""
    return [shlex.split(v.lstrip("-@:+!")) for v in unit.get(key, [])]


def clean_exits(unit: dict[str, list[str]]) -> set[int]:
    """The main process's exit codes systemd counts as a clean stop: 0 and ``SuccessExitStatus=``."""
    return {0, *(int(c) for v in unit.get("SuccessExitStatus", []) for c in v.split() if c.isdigit())}


def environment(unit: dict[str, list[str]], root: Path, notify: str) -> dict[str, str]:
    """The environment systemd gives the service: a clean one (PATH; no HOME without User=), NOTIFY_SOCKET for
    Type=notify, then Environment=, then EnvironmentFile= (read under ``root``), which wins."""
    env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "INVOCATION_ID": "0" * 32, "NOTIFY_SOCKET": notify}
    for value in unit.get("Environment", []):
        env.update(word.split("=", 1) for word in shlex.split(value))
    for value in unit.get("EnvironmentFile", []):
        path = root / value.lstrip("-").lstrip("/")
        if not path.exists() and value.startswith("-"):
            continue
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith(("#", ";")):
                key, _, val = line.partition("=")
                env[key.strip()] = " ".join(shlex.split(val))
    return env


class NotifySocket:
    """What systemd listens on for a Type=notify service: an abstract datagram socket; each message is kept
    with the sender's pid (SO_PASSCRED), as systemd checks it against NotifyAccess=."""

    def __init__(self) -> None:
        self.name = f"@vllm-rig-unit-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[float, int, str]] = []
        self.ready = threading.Event()
        self.on_ready: list[Callable] = []  # checks run the moment READY=1 arrives, before anything can change
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except OSError:
                return
            pid = next((struct.unpack("3i", d[:12])[0] for lvl, typ, d in anc
                        if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS), 0)
            text = data.decode()
            self.messages.append((time.monotonic(), pid, text))
            if "READY=1" in text.split("\n") and not self.ready.is_set():
                self.on_ready = [check() for check in self.on_ready]
                self.ready.set()

    def rearm(self) -> None:
        """For the next start of the service (a restart): READY=1 is awaited again."""
        self.ready.clear()

    def close(self) -> None:
        self.sock.close()


def cgroup_of(main: subprocess.Popen, pgids: set[int]) -> list[psutil.Process]:
    """The service's cgroup, approximated: the main process, its descendants, and every process of their process
    groups (a process that left the tree by a double fork still has its group); ``pgids`` collects the groups."""
    procs = {}
    try:
        top = psutil.Process(main.pid)
        for p in [top, *top.children(recursive=True)]:
            procs[p.pid] = p
            pgids.add(os.getpgid(p.pid))
    except (psutil.NoSuchProcess, ProcessLookupError):
        pass
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids:
                procs.setdefault(p.pid, p)
        except (ProcessLookupError, PermissionError):
            continue
    return [p for p in procs.values() if p.pid != os.getpid()]


def stop(main: subprocess.Popen, unit: dict[str, list[str]], env: dict[str, str], cwd: str,
         stop_timeout: float) -> tuple[list[subprocess.CompletedProcess], list[int]]:
    """A stop as systemd does it with KillMode=control-group: each ExecStop=, then KillSignal (SIGTERM) to every
    process of the cgroup at once, ``stop_timeout`` (TimeoutStopSec), then SIGKILL to what is left. Returns
    the ExecStop= runs and the pids that needed the SIGKILL."""
    runs = [subprocess.run(argv, env=env, cwd=cwd, start_new_session=True, timeout=stop_timeout * 4,
                           capture_output=True, text=True) for argv in commands(unit, "ExecStop")]
    pgids: set[int] = set()
    for p in cgroup_of(main, pgids):
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    end = time.monotonic() + stop_timeout

    def alive() -> list[psutil.Process]:
        out = []
        for p in cgroup_of(main, pgids):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    killed = alive()
    for p in killed:
        p.kill()
    main.wait(10)
    return runs, [p.pid for p in killed]
