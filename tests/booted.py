"""A booted systemd for the service's tests: Debian 12 made by debootstrap, booted by systemd-nspawn.

This box (and CI's) runs no systemd, so the unit is driven where one runs: a container whose PID 1 is systemd,
booted in about a second. The root file system is made once (about 2 minutes, kept in ``RIG_CACHE``) and booted
with ``--volatile=overlay``, so what a test writes there (the unit, the journal) goes with the container. There is
no machined on the host (``--register=no --keep-unit``), so commands reach the container with ``nsenter``, and
systemd-nspawn makes its cgroups (``payload``, ``supervisor``) under its own: it is started in a cgroup of its
own, removed at the end with everything in it. The host's ``/sys/fs/cgroup`` is never bound in: the container's
systemd would remount it and change the host's hierarchy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
#: systemd as PID 1, and what the rig's build and the tests use on a serving host (git and a C compiler for the
#: build's tools step, libnuma for vLLM's CPU kernels, logrotate for the policy, procps for pgrep).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "procps", "iproute2", "logrotate", "ca-certificates",
            "git", "gcc", "g++", "libnuma1")


def root_fs(cache: Path) -> Path:
    """The container's root file system, made once per package list: debootstrap into a folder beside it, renamed
    when complete (an interrupted run leaves a ``.part`` folder that the next one removes)."""
    key = hashlib.sha256(" ".join((SUITE, *PACKAGES)).encode()).hexdigest()[:12]
    root = cache / "systemd-root" / f"{SUITE}-{key}"
    if (root / "usr" / "lib" / "systemd" / "systemd").exists():
        return root
    part = root.with_name(root.name + ".part")
    _unmount_under(part)
    shutil.rmtree(part, ignore_errors=True)
    part.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(part),
                        MIRROR], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        _unmount_under(part)
        raise RuntimeError(f"debootstrap {SUITE} failed: {(r.stdout + r.stderr)[-3000:]}")
    os.rename(part, root)
    return root


def _unmount_under(path: Path) -> None:
    """debootstrap mounts /proc and /sys in its target while it works: an interrupted one leaves them."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m == str(path) or m.startswith(f"{path}/")), reverse=True):
        subprocess.run(["umount", "-l", m], check=False)


def _own_cgroups(name: str) -> list[Path]:
    """A cgroup named ``name`` beside this process's, in each hierarchy systemd-nspawn writes to (the named systemd
    one and the unified one)."""
    mounts = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, where, fstype, opts = line.split()[:4]
        if fstype == "cgroup2":
            mounts[""] = where
        elif fstype == "cgroup" and "name=systemd" in opts.split(","):
            mounts["name=systemd"] = where
    out = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers in mounts:
            out.append(Path(mounts[controllers] + path.rstrip("/")) / name)
    return out


class Booted:
    """One container with systemd as PID 1; ``binds``: (host path, container path, read-only)."""

    def __init__(self, root: Path, binds: list[tuple[Path, Path, bool]], name: str) -> None:
        self.root, self.binds, self.name = root, binds, name
        self.cgroups = _own_cgroups(name)
        self.proc: subprocess.Popen | None = None
        self.log = Path(f"/tmp/{name}.nspawn.log")
        self.made_run_nspawn = not Path("/run/systemd/nspawn").exists()

    def boot(self, timeout: float = 60) -> None:
        for cg in self.cgroups:
            cg.mkdir(exist_ok=True)

        def enter() -> None:  # in the child, before exec: systemd-nspawn's cgroups go under ours
            for cg in self.cgroups:
                (cg / "cgroup.procs").write_text("0")

        cmd = ["systemd-nspawn", "-D", str(self.root), "--volatile=overlay", "--boot", "--register=no",
               "--keep-unit", "--console=passive", f"--machine={self.name}"]
        cmd += [f"--bind{'-ro' if ro else ''}={src}:{dst}" for src, dst, ro in self.binds]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=enter)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.pid1() and self.sh("systemctl", "is-system-running", "--wait", timeout=timeout).stdout.strip() \
                    in ("running", "degraded"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the container's systemd did not come up in {timeout:.0f} s")

    def pid1(self) -> int | None:
        """The container's PID 1 (systemd) as the host numbers it: systemd-nspawn's child."""
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except (FileNotFoundError, AttributeError):
            return None
        return int(kids[0]) if kids else None

    def sh(self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 600,
           check: bool = False) -> subprocess.CompletedProcess:
        """A command in every namespace of the container, as root with a bare environment (a login's)."""
        base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                "LANG": "C.UTF-8"}
        envs = [f"{k}={v}" for k, v in {**base, **(env or {})}.items()]
        return subprocess.run(["nsenter", "-t", str(self.pid1()), "-a", "env", "-i", *envs, *cmd],
                              capture_output=True, text=True, timeout=timeout, check=check, cwd="/")

    def pids(self) -> list[int]:
        """Every process in the container (host PIDs), systemd included."""
        return [int(p) for cg in self.cgroups for p in _procs_under(cg)]

    def shutdown(self, timeout: float = 60) -> None:
        """Power the container off (SIGTERM to systemd-nspawn: the container's systemd halts), then SIGKILL what is
        left, and remove the cgroups and the runtime folder it made."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for cg in self.cgroups:
            for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                d.rmdir()
            if cg.exists():
                cg.rmdir()
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)
        if self.made_run_nspawn:
            shutil.rmtree("/run/systemd/nspawn", ignore_errors=True)
        self.log.unlink(missing_ok=True)


def _procs_under(cg: Path) -> set[str]:
    if not cg.exists():
        return set()
    return {pid for f in cg.rglob("cgroup.procs") for pid in f.read_text().split()} | \
        set((cg / "cgroup.procs").read_text().split())
