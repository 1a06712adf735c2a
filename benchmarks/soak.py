# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""A soak with faults: the demo served by the unit's own command lines, a request loop, faults at random times.

  uv run benchmarks/soak.py [--faults 50] [--seed 1] [--only KIND,...] [--rig DIR] [--quick]

The demo (CPU build) runs as systemd runs systemd/vllm.service (rig/control/unitfile.py: its ExecStart with the unit's
environment and notify socket, Restart=on-failure after --restart-sec instead of RestartSec=, its ExecStop and
KillMode=control-group at the end); this box runs no systemd. A request loop (one short completion every 0.2 s,
loopback) runs throughout. Each fault comes 3 to 8 s after the engine is healthy, every kind once per round in a
random order (--seed):

  api         kill -9 of the API server          -> the supervisor ends the group, exit 1, restarted
  enginecore  kill -9 of VLLM::EngineCore         -> vLLM's server exits 0; the supervisor says so, exit 1
  worker      kill -9 of a VLLM::Worker (when the executor has one; the CPU demo's has none)
  logwriter   kill -9 of the log writer           -> the group ended, exit 137, restarted
  hang        SIGSTOP of EngineCore in a step (a long request running) -> the watchdog within HANG_WINDOW,
              exit 1, restarted
  diskfull    the log's tmpfs filled for 12 s     -> the engine serves on; the log says what it dropped
  ckpt        the checkpoint folder moved away, then kill -9 of the server -> each start exits 2 naming it;
              put back, the next restart serves

After each: the rig's words for it are in the journal (or the log), it recovered (READY=1 again and a request
answered, or the drop note), no process of the old engine is left, none of the old engine's runtime files is,
and the log still begins with every byte it held before the fault. One table: fault, injected, recovered, time to
recover (median, max) and its ratio to the first start to healthy, requests failed. --quick: api and diskfull
once each (CI; a killed EngineCore is tests/test_serve_real.py's). Exit 1 when a fault was not recovered or a
check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.build.demo import ensure as ensure_demo  # noqa: E402
from rig.control import service, unitfile  # noqa: E402
from rig.facts.config import settings  # noqa: E402
from rig.running.enginerec import group_members, load, runtime_dir  # noqa: E402

KINDS = ("api", "enginecore", "worker", "logwriter", "hang", "diskfull", "ckpt")
QUICK = ("api", "diskfull")  # a restart and a fault served through: CI's time (test_serve_real kills EngineCore)
SAID = {  # the rig's words for each fault, in the journal (the log for diskfull)
    "api": "the engine's API server: expected running while its engine runs, found gone",
    "enginecore": "found it ended on its own with exit 0",
    "worker": "error: ",
    "logwriter": "the engine's log writer (pid",
    "hang": "it is hung",
    "diskfull": "the log writer dropped",
    "ckpt": "no such folder",  # the box check's, naming CKPT
}
RECOVER_TIMEOUT = 300.0
FULL_FOR = 12.0  # the disk kept full past vLLM's stats line (every 10 s): output is dropped even when no request logs
NOTE_WAIT = 30.0  # seconds for the log writer's drop note once the disk has room again
PASSED = ("RIG_CACHE", "CACHE_ROOT")  # where the caller keeps the caches: the unit's too


def rounds(kinds: list[str], n: int, rng: random.Random) -> list[str]:
    """``n`` faults: every kind once per round, each round in its own random order (no kind goes untried)."""
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(kinds, len(kinds))
    return out[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Load:
    """One short completion every 0.2 s, each kept as (sent, answered, ok)."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model, self.done = port, model, threading.Event()
        self.results: list[tuple[float, float, bool]] = []
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "one two three", "max_tokens": 4})
        while not self.done.is_set():
            t0, ok = time.monotonic(), False
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                ok = conn.getresponse().status == 200
                conn.close()
            except OSError:
                pass
            self.results.append((t0, time.monotonic(), ok))
            time.sleep(0.2)

    def failed(self, t0: float, t1: float) -> int:
        return sum(1 for s, _, ok in self.results if t0 <= s <= t1 and not ok)

    def answered_since(self, t: float) -> bool:
        return any(ok and s >= t for s, _, ok in self.results)


class Service:
    """The unit's ExecStart run as systemd runs it, restarted on failure; the journal is its output."""

    def __init__(self, unit: dict[str, list[str]], env: dict[str, str], journal: Path, restart_sec: float) -> None:
        self.unit, self.env, self.journal, self.restart_sec = unit, env, journal, restart_sec
        self.notify = unitfile.NotifySocket()
        self.env["NOTIFY_SOCKET"] = self.notify.name
        self.argv = unitfile.commands(unit, "ExecStart")[0]
        self.cwd = unit["WorkingDirectory"][0]
        self.main: subprocess.Popen | None = None
        self.exits: list[tuple[float, int]] = []
        self.starts: list[float] = []
        self.stopping = threading.Event()
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with open(self.journal, "ab") as out:
            while not self.stopping.is_set():
                self.notify.rearm()
                self.starts.append(time.monotonic())
                self.main = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, start_new_session=True,
                                             stdout=out, stderr=subprocess.STDOUT)
                code = self.main.wait()
                self.exits.append((time.monotonic(), code))
                if self.stopping.is_set() or code in unitfile.clean_exits(self.unit):
                    break
                time.sleep(self.restart_sec)  # Restart=on-failure
        self.ended.set()

    def ready_since(self, t: float) -> float | None:
        """When READY=1 came from a start after ``t``."""
        return next((m for m, _, text in self.notify.messages if m >= t and "READY=1" in text.split("\n")), None)

    def stop(self, stop_timeout: float) -> tuple[list[subprocess.CompletedProcess], list[int]]:
        self.stopping.set()
        assert self.main is not None
        out = unitfile.stop(self.main, self.unit, self.env, self.cwd, stop_timeout)
        self.ended.wait(30)
        self.notify.close()
        return out


@dataclass
class Tally:
    injected: int = 0
    recovered: int = 0
    times: list[float] = field(default_factory=list)
    failed: int = 0
    problems: list[str] = field(default_factory=list)


def engine_pick(pgid: int, name: str) -> psutil.Process | None:
    for pid in group_members(pgid):
        try:
            p = psutil.Process(pid)
            cmd = p.cmdline()
            if name == "serve" and "serve" in cmd[:3] or name != "serve" and name in p.name():
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def in_step(load_: Load) -> bool:
    """A long request under way, seen running in vLLM's own gauge: a core stopped while idle reports nothing
    pending, a hang only status's health check sees (docs/service.md); the watchdog's hang has requests pending."""
    body = json.dumps({"model": load_.model, "prompt": "count", "max_tokens": 400, "ignore_eos": True})

    def long_request() -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", load_.port, timeout=120)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            conn.getresponse().read()
        except OSError:
            pass

    threading.Thread(target=long_request, daemon=True).start()

    def running() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", load_.port, timeout=5)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        except OSError:
            return False
        return any(ln.startswith("vllm:num_requests_running") and float(ln.split()[-1]) > 0
                   for ln in text.splitlines())

    return wait_for(running, 10, 0.1)


def files_of(folder: Path) -> set[tuple[str, int]]:
    """The runtime folder's entries (each engine's own folder and what it holds) by path and inode: a new engine
    makes some of the same names anew."""
    try:
        return {(str(p.relative_to(folder)), p.lstat().st_ino) for p in folder.rglob("*")}
    except FileNotFoundError:
        return set()


def digest(path: Path, n: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(n)).hexdigest()


def wait_for(cond, timeout: float, step: float = 0.5) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return False


def since(path: Path, offset: int) -> str:
    """What ``path`` holds after byte ``offset`` (a byte offset: the log holds multi-byte characters, so slicing its
    text at ``offset`` would start past what was written after it)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def inject(kind: str, svc: Service, s, load_: Load, log: Path, ckpt: Path, tmpfs: Path | None, journal: Path,
           tally: Tally) -> None:
    rec = load(s)
    if rec is None:
        tally.problems.append(f"{kind}: no engine record before the fault")
        return
    runtime = files_of(runtime_dir(s))
    size = log.stat().st_size
    before = digest(log, size)
    jpos = journal.stat().st_size
    victim = None
    if kind in ("api", "ckpt"):
        victim = engine_pick(rec.pgid, "serve")
    elif kind in ("enginecore", "hang"):
        victim = engine_pick(rec.pgid, "VLLM::EngineCore")
    elif kind == "worker":
        victim = engine_pick(rec.pgid, "VLLM::Worker")
    elif kind == "logwriter":
        victim = psutil.Process(rec.pid)
    if kind != "diskfull" and victim is None:
        tally.problems.append(f"{kind}: no such process in the engine's group {rec.pgid}")
        return
    if kind == "hang" and not in_step(load_):
        tally.problems.append("hang: no request running in EngineCore to hang on")
        return
    tally.injected += 1
    t0 = time.monotonic()
    if kind == "diskfull":
        assert tmpfs is not None
        filler = tmpfs / "filler"
        try:  # unbuffered: the write that finds the disk full raises here, not at the close
            with open(filler, "wb", buffering=0) as fh:
                while True:
                    fh.write(b"\0" * 65536)
        except OSError:
            pass
        time.sleep(FULL_FOR)
        filler.unlink()
        noted = wait_for(lambda: SAID[kind] in since(log, size), NOTE_WAIT)
        same = (load(s) or rec).pid == rec.pid  # the engine served on: no restart
        recovered = noted and same and wait_for(lambda: load_.answered_since(time.monotonic() - 1), 10)
    else:
        if kind == "ckpt":
            ckpt.rename(ckpt.with_name(ckpt.name + ".away"))
        victim.send_signal(signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
        if kind == "ckpt":  # at least one start refused (exit 2) before it is put back
            wait_for(lambda: any(t > t0 and c == 2 for t, c in svc.exits), 120)
            ckpt.with_name(ckpt.name + ".away").rename(ckpt)
        recovered = wait_for(lambda: svc.ready_since(t0) is not None and load_.answered_since(svc.ready_since(t0)),
                             RECOVER_TIMEOUT)
    t1 = time.monotonic()
    said = since(journal, jpos) + (since(log, size) if kind == "diskfull" else "")
    if SAID[kind] not in said:
        tally.problems.append(f"{kind}: the rig did not say {SAID[kind]!r}")
    if not recovered:
        waited = NOTE_WAIT if kind == "diskfull" else RECOVER_TIMEOUT
        tally.problems.append(f"{kind}: not recovered within {waited:.0f} s")
        return
    tally.recovered += 1
    tally.times.append(t1 - t0)
    tally.failed += load_.failed(t0, t1)
    if digest(log, size) != before:
        tally.problems.append(f"{kind}: the log's first {size} bytes changed")
    if kind != "diskfull":
        if left := group_members(rec.pgid):
            tally.problems.append(f"{kind}: the old engine's processes {left} are left")
        if old := runtime & files_of(runtime_dir(s)):
            tally.problems.append(f"{kind}: the old engine's runtime files {sorted(n for n, _ in old)} are left")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=50, help="how many faults in all (default 50)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated kinds to draw from (default: all)")
    ap.add_argument("--restart-sec", type=float, default=2.0, help="the wait before a restart (the unit's is 30 s)")
    ap.add_argument("--rig", type=Path, default=ROOT, help="the CPU-built copy of the rig (default: this one)")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} once each (CI)")
    a = ap.parse_args()
    rig = a.rig.resolve()
    py = rig / ".venv-cpu" / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no {py}: run DEVICE=cpu ./build.sh in {rig} first")
    kinds = [k for k in (a.only.split(",") if a.only else KINDS) if k]
    if bad := set(kinds) - set(KINDS):
        raise SystemExit(f"--only: expected kinds among {', '.join(KINDS)}, found {', '.join(sorted(bad))}")
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        logdir = tmp / "log"
        logdir.mkdir()
        tmpfs = None
        if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "soak", str(logdir)],
                                                capture_output=True).returncode == 0:
            tmpfs = logdir
        else:
            kinds = [k for k in kinds if k != "diskfull"]
            print("diskfull: left out (a tmpfs for the log needs root)")
        plan = list(QUICK) if a.quick else rounds(kinds, a.faults, rng)
        log, journal, state = logdir / "vllm.log", tmp / "journal.log", tmp / "state"
        root = tmp / "root"
        unit_text = service.render_unit(rig, str(log))
        env_file = root / service.ENV_FILE
        env_file.parent.mkdir(parents=True)
        port = free_port()
        admin = {"PROFILE": "demo", "DEVICE": "cpu", "PORT": str(port), "RIG_STATE": str(state), "HANG_WINDOW": "10",
                 "STOP_TIMEOUT": "10", "HOME": os.environ.get("HOME", "/root")}
        admin |= {k: os.environ[k] for k in PASSED if os.environ.get(k)}
        env_file.write_text("".join(f"{k}={v}\n" for k, v in admin.items()))
        unit = unitfile.settings(unit_text)
        ckpt = Path(settings(admin, root=rig).ckpt)
        ensure_demo(py, ckpt, rig)
        with open(env_file, "a") as fh:  # an admin's checkpoint: the rig makes none where CKPT is set
            fh.write(f"CKPT={ckpt}\n")
        env = unitfile.environment(unit, root, "")
        s = settings(env, root=rig)
        svc = Service(unit, env, journal, a.restart_sec)
        t0 = time.monotonic()
        load_ = None
        tallies = {k: Tally() for k in dict.fromkeys(plan)}
        try:
            if not wait_for(lambda: svc.ready_since(t0) is not None, 600):
                raise SystemExit("the first start: no READY=1 within 600 s:\n" + journal.read_text()[-3000:])
            first = svc.ready_since(t0) - t0
            load_ = Load(port, "demo")
            if not wait_for(lambda: load_.answered_since(t0), 60):
                raise SystemExit("the first start: READY=1 but no request answered within 60 s")
            rec = load(s)
            if "worker" in plan and rec and engine_pick(rec.pgid, "VLLM::Worker") is None:
                plan = [k for k in plan if k != "worker"]
                tallies.pop("worker")
                print("worker: left out (this engine's executor runs no separate worker process)")
            print(f"first start to healthy: {first:.1f} s; {len(plan)} fault(s): {', '.join(plan)}", flush=True)
            for i, kind in enumerate(plan, 1):
                time.sleep(rng.uniform(3, 8))
                tally = tallies[kind]
                n = len(tally.problems)
                inject(kind, svc, s, load_, log, ckpt, tmpfs, journal, tally)
                took = f"{tally.times[-1]:.1f} s" if tally.times and len(tally.problems) == n else "-"
                print(f"  {i}/{len(plan)} {kind}: {'ok' if len(tally.problems) == n else tally.problems[-1]} "
                      f"({took})", flush=True)
        finally:
            if load_:
                load_.done.set()
            runs, killed = svc.stop(10)
            if tmpfs:
                subprocess.run(["umount", "-l", str(tmpfs)], capture_output=True)
        end_problems = []
        if killed:
            end_problems.append(f"the stop needed SIGKILL for {killed}")
        if svc.exits and svc.exits[-1][1] not in unitfile.clean_exits(unit):
            end_problems.append(f"the last exit was {svc.exits[-1][1]}, not a clean stop")
        if any(r.returncode != 0 for r in runs):
            end_problems.append("ExecStop failed: " + "; ".join(r.stdout + r.stderr for r in runs))
        if runtime_dir(s).exists():
            end_problems.append(f"{runtime_dir(s)} left after the stop")
        shutil.rmtree(state, ignore_errors=True)
    print(f"\n| fault | injected | recovered | time to recover, median / max | ratio to the first start "
          f"({first:.1f} s) | requests failed |")
    print("|---|---|---|---|---|---|")
    bad = list(end_problems)
    for kind, t in tallies.items():
        med = statistics.median(t.times) if t.times else 0.0
        mx = max(t.times) if t.times else 0.0
        print(f"| {kind} | {t.injected} | {t.recovered} | {med:.1f} s / {mx:.1f} s | {med / first:.2f}x | "
              f"{t.failed} |")
        bad += t.problems
    total = sum(t.injected for t in tallies.values())
    print(f"\nsoak: {total} fault(s), {sum(t.recovered for t in tallies.values())} recovered, "
          f"{len(load_.results) if load_ else 0} requests, {len(bad)} problem(s)")
    for b in bad:
        print(f"  problem: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
