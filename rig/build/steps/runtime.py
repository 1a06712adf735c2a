"""Step 4, runtime: the hash-pinned requirements, installed with hash checking.

The lock (``scripts/runtime.lock``) pins every requirement of the official
``vllm==0.30.0`` wheel, plus vLLM's build requirements, for CPython 3.13 on
manylinux x86_64, each with ``==`` and its hashes. ``nox -s lock`` makes it
with ``uv pip compile --generate-hashes``. The step is current when the
venv's installed set holds every pin; a re-run needs no network.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rig.base import atomic, proc, venvs
from rig.base.console import note, say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.venvs import WANT_TEXT, norm
from rig.build import bundle
from rig.build.steps.base import Context, Status, Step
from rig.facts import record
from rig.facts.config import Settings
from rig.facts.uv import absent as uv_absent

PLATFORM = "x86_64-manylinux_2_28"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")
#: vLLM v0.30.0's [build-system].requires: needed in the venv to build with --no-build-isolation.
BUILD_REQUIRES = ("cmake>=3.26.1", "ninja", "packaging>=24.2", "setuptools>=77.0.3,<81", "setuptools-scm>=8",
                  "setuptools-rust>=1.9", "wheel", "jinja2")
HEARTBEAT_S = 30.0
#: Written into the venv before an install and removed after it: present at the next run, it means the install
#: was cut short (kill -9, power loss), and a .dist-info folder no longer proves its package is whole.
MARKER = ".rig-install-incomplete"
#: The one pin of Ray, for DIST_BACKEND=ray: ``nox -s lock`` makes scripts/ray.in and scripts/ray.lock from it, and
#: rig/nodes/raycluster.py installs that lock on the nodes that use it.
RAY = "ray==2.60.0"


@dataclass
class Lock:
    path: Path
    python: str | None  # from the '# python: X.Y' header
    pins: dict[str, tuple[str, tuple[str, ...]]]  # name -> (version, hashes)
    sha256: str

    def pin_digest(self, name: str) -> str:
        version, hashes = self.pins[name]
        return hashlib.sha256(f"{version} {' '.join(sorted(hashes))}".encode()).hexdigest()[:16]


def read_lock(path: Path) -> Lock:
    """Parse the lock: every requirement must be pinned with == and carry a hash."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(problem(str(path), "the runtime lock", "no such file",
                               "restore it from git, or make it with nox -s lock")) from None
    m = re.search(r"^# python: (\d+\.\d+)\s*$", text, re.M)
    pins: dict[str, tuple[str, tuple[str, ...]]] = {}
    # Join continuation lines so each requirement is one logical line.
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        pm = PIN.match(line)
        hashes = tuple(HASH.findall(line))
        if not pm or not hashes:
            raise BadInput(problem(f"{path}: requirement {line.split()[0]!r}", "a pin NAME==VERSION with --hash",
                                   line[:80], "make the lock with nox -s lock instead of editing it"))
        pins[norm(pm[1])] = (pm[2], hashes)
    return Lock(path, m[1] if m else None, pins, hashlib.sha256(text.encode()).hexdigest())


def for_venv(lock: Lock, s: Settings) -> Lock:
    """The pins this venv installs: all of them, or with ``TORCH=host`` all but the torch family the host brings
    (written beside the venv as a requirements file of its own, the hashes kept)."""
    if s.torch != "host":
        return lock
    pins = {n: p for n, p in lock.pins.items() if not venvs.torch_family(n)}
    out = s.venv_dir / "rig-runtime-host.lock"
    lines = [f"{n}=={v} " + " ".join(f"--hash={h}" for h in hs) + "\n" for n, (v, hs) in pins.items()]
    atomic.write_text(out, f"# {lock.path.name} less the torch family (TORCH=host): written by the runtime step.\n"
                      + "".join(lines))
    return Lock(out, lock.python, pins, lock.sha256)


def differences(lock: Lock, have: dict[str, str]) -> list[str]:
    """Pins the venv does not satisfy, as 'name==want (found X)'."""
    return [f"{n}=={v} (found {have.get(n, 'none')})" for n, (v, _) in lock.pins.items() if have.get(n) != v]


def _check_python(lock: Lock, s: Settings) -> None:
    minor = venvs.minor(s.venv_dir)
    found = f"{minor[0]}.{minor[1]}" if minor else "no venv"
    if lock.python is None:
        raise BadInput(problem(f"{lock.path}", "a '# python: X.Y' header line", "none",
                               "make the lock with nox -s lock"))
    if s.torch == "host":  # the host's minor is what it is: the lock's hashes cover every Python's wheels
        return
    if lock.python != found:
        raise BadInput(problem(f"{lock.path}", f"a lock for the venv's Python {found}",
                               f"a lock for Python {lock.python}", "make the lock for 3.13 with nox -s lock"))


class RuntimeStep(Step):
    name = "runtime"
    summary = "the pinned requirements, hash-checked, into the venv"
    needs = ("venv",)
    facts = ("lock_sha256", "pins")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        lock = read_lock(s.runtime_lock)
        _check_python(lock, s)
        if cut := _cut_short(s.venv_dir):
            return Status(False, f"an install into {s.venv_dir} was cut short ({cut}): its packages are checked "
                                 "file by file and the broken ones installed again")
        rec = ctx.record.runtime
        lock = for_venv(lock, s)
        missing = differences(lock, venvs.installed(s.venv_dir))
        if missing:
            return Status(False, f"{len(missing)} pin(s) not installed, e.g. {missing[0]}")
        if rec is None or rec.lock_sha256 != lock.sha256:
            return Status(False, f"{s.runtime_lock.name} changed since the last install")
        less = " (the torch family from the host)" if s.torch == "host" else ""
        return Status(True, f"{len(lock.pins)} pins of {s.runtime_lock.name} installed{less}", rec)

    def run(self, ctx: Context) -> record.Runtime:
        s = ctx.settings
        lock = read_lock(s.runtime_lock)
        _check_python(lock, s)
        if s.torch == "host":
            minor = venvs.minor(s.venv_dir)
            left = sorted(n for n in lock.pins if venvs.torch_family(n))
            say(f"TORCH=host: {len(left)} pins of the torch family left to the host ({', '.join(left[:6])}, ...); "
                f"the lock's other pins for Python {minor[0]}.{minor[1]} (the lock was made for {lock.python})")
            lock = for_venv(lock, s)
        old = ctx.record.runtime.pin_digests if ctx.record.runtime else {}
        changed = [n for n in lock.pins if n in old and old[n] != lock.pin_digest(n)]
        if not old or ctx.options.force:  # first install here, or --force: every hash, even of what is there
            changed = [n for n in lock.pins if n in venvs.installed(s.venv_dir)]
        broken = venvs.damaged(s.venv_dir)
        if broken:
            first = next(iter(broken.items()))
            say(f"{len(broken)} package(s) with files missing, e.g. {first[0]} ({first[1]}): installed again")
            changed += [n for n in broken if n in lock.pins and n not in changed]
        say(f"installing {len(lock.pins)} pins from {lock.path} with hash checking"
            + (f" from the offline bundle's wheels ({offline})" if (offline := bundle.wheels(s)) else ""))
        marker = s.venv_dir / MARKER
        atomic.write_text(marker, f"pid {os.getpid()} at {dt.datetime.now():%Y-%m-%d %H:%M:%S}\n")
        install(s, ctx.uv, lock, reinstall=changed)
        missing = differences(lock, venvs.installed(s.venv_dir))
        if missing:
            raise WorkFailed(problem(f"{s.venv_dir} after the install", f"every pin of {s.runtime_lock.name}",
                                     f"{len(missing)} pin(s) still missing, e.g. {missing[0]}",
                                     f"remove {s.venv_dir} and run ./build.sh again"))
        marker.unlink()  # the install finished: nothing in the venv is half-written
        size = sum(f.stat().st_size for f in venvs.site_packages(s.venv_dir).rglob("*") if f.is_file()) / 1e9
        say(f"venv size: {size:.2f} GB")
        return record.Runtime(lock_sha256=lock.sha256, pins=len(lock.pins),
                              pin_digests={n: lock.pin_digest(n) for n in lock.pins})


def _cut_short(venv: Path) -> str:
    """What the marker of an install that never finished says ('' when there is none)."""
    try:
        return (venv / MARKER).read_text().strip() or "no details"
    except (FileNotFoundError, NotADirectoryError):
        return ""


def install(s: Settings, uv: str | None, lock: Lock, reinstall: list[str]) -> None:
    """Install the lock into the venv, hash-checked; clear errors for bad hashes and missing packages."""
    python = venvs.python(s.venv_dir)
    if uv:
        cmd = [uv, "pip", "install", "--python", str(python), "--require-hashes", "--no-deps",
               *bundle.uv_args(s), "-r", str(lock.path)]
        cmd += [x for n in reinstall for x in ("--reinstall-package", n)]
    else:
        cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off", "--require-hashes",
               "--no-deps", *bundle.pip_args(s), "-r", str(lock.path)]
        if reinstall:
            cmd += ["--force-reinstall", *[f"{n}=={lock.pins[n][0]}" for n in reinstall]]
    code, tail = stream(cmd, label="installing", watch=s.venv_dir, interval=min(HEARTBEAT_S, s.status_interval))
    if code != 0:
        raise _install_error(tail, lock) or WorkFailed(problem(
            f"the install of {lock.path.name}", "exit 0", f"exit {code}: {' '.join(tail[-3:])}",
            "check the network and run again"))


def stream(cmd: list[str], label: str, watch: Path, interval: float) -> tuple[int, list[str]]:
    """Run ``cmd`` showing its output, with a heartbeat so a long download never looks hung."""
    def where() -> Path:
        return watch if watch.exists() else watch.parent

    free0 = shutil.disk_usage(where()).free

    def status(elapsed: float, _tail: list[str]) -> str:
        used = max(free0 - shutil.disk_usage(where()).free, 0) / 1e9
        return f"still {label}: {elapsed:.0f} s, {used:.2f} GB written so far"

    return proc.watch(cmd, status=status, interval=interval)


def _install_error(tail: list[str], lock: Lock) -> BadInput | None:
    text = "\n".join(tail)
    m = re.search(r"Hash mismatch for `([^`]+)`\s*Expected:\s*(.*?)\s*Computed:\s*(sha256:[0-9a-f]{64})", text, re.S)
    if m:
        expected = ", ".join(re.findall(r"sha256:[0-9a-f]{64}", m[2]))
        return BadInput(problem(f"the hash of {m[1]} in {lock.path.name}", expected, m[3],
                                "the lock was edited or the index serves another file: make it again with "
                                "nox -s lock (or git checkout the lock)"))
    m = re.search(r"(\S+==\S+) from .*?:\s*Expected sha256 ([0-9a-f]{64})\s*Got\s+([0-9a-f]{64})", text, re.S)
    if m:  # pip's wording
        return BadInput(problem(f"the hash of {m[1]} in {lock.path.name}", f"sha256:{m[2]}", f"sha256:{m[3]}",
                                "make the lock again with nox -s lock (or git checkout the lock)"))
    m = re.search(r"current Python version \(([\d.]+)\) does not satisfy.*?(\S+?)==(\S+) depends on", text, re.S)
    if m:  # uv's wording when a pin's Requires-Python excludes the venv's (a TORCH=host interpreter, say)
        return BadInput(problem(f"{m[2]}=={m[3]} of {lock.path.name}", "a pin this venv's Python can install",
                                f"it requires another Python than {m[1]}",
                                "point PYTHON at an interpreter of the lock's Python (the '# python:' line of "
                                "scripts/runtime.lock; nox -s lock resolves for that Python only)"))
    m = re.search(r"there is no version of (\S+?)(?:\s|,|$)", text) or re.search(
        r"No matching distribution found for (\S+)", text)
    if m:
        return BadInput(problem(f"the package {m[1]} of {lock.path.name}", "on the package index", "not there",
                                "make the lock again with nox -s lock against the index you use"))
    return None


def make_lock(s: Settings, uv: str | None, out: Path, inputs: list[str], python: str = WANT_TEXT,
              constraint: Path | None = None, what: str = "The serving runtime") -> int:
    """``nox -s lock``: resolve ``inputs`` for CPython ``python`` on manylinux x86_64, hashed (within the pins of
    ``constraint``, when given); return pin count."""
    if not uv:
        raise uv_absent(s, "nox -s lock resolves with uv pip compile", "scripts/nox.sh -s lock")
    src = out.with_suffix(".in")
    atomic.write_text(src, f"# The inputs of {out.name} (nox -s lock).\n" + "\n".join(inputs) + "\n")
    cmd = [uv, "pip", "compile", "--quiet", "--generate-hashes", "--no-header", "--no-annotate",
           "--python-version", python, "--python-platform", PLATFORM, "--no-emit-package", "vllm",
           "--index-url", s.index_url, str(src)]
    if constraint is not None:
        cmd += ["--constraint", str(constraint)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise WorkFailed(problem(f"uv pip compile of {src.name}", "exit 0", f"exit {r.returncode}: "
                                 f"{r.stderr.strip()[-800:]}", f"check the network and the inputs in {src}"))
    body = r.stdout
    pins = len(re.findall(r"^[A-Za-z0-9][A-Za-z0-9._-]*==", body, re.M))
    uv_version = subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip()
    header = (
        f"# {what}: every requirement pinned with == and hashed ({pins} pins).\n"
        f"# Made by `nox -s lock` on {dt.date.today().isoformat()} with {uv_version}:\n"
        f"#   uv pip compile --generate-hashes --python-version {python} --python-platform {PLATFORM} \\\n"
        f"#     --no-emit-package vllm {src.name}"
        + (f" --constraint {constraint.name}" if constraint is not None else "") + "\n"
        + (f"# {src.name} holds the inputs: the official wheel's requirements (through vllm==...) and\n"
           f"# vLLM's build requirements." if constraint is None else
           f"# {src.name} holds the inputs; {constraint.name} keeps each package both need at one version.")
        + " Do not edit by hand: the install checks every hash.\n"
        f"# python: {python}\n"
        f"# platform: {PLATFORM}\n"
    )
    atomic.write_text(out, header + body)
    return pins


def lock_main(s: Settings, uv: str | None, version: str) -> int:
    inputs = [f"vllm=={version}", "# vLLM's build requirements (pyproject.toml [build-system])", *BUILD_REQUIRES]
    n = make_lock(s, uv, s.runtime_lock, inputs)
    lock = read_lock(s.runtime_lock)
    torch = lock.pins.get("torch")
    cuda = [p for p in lock.pins if p.startswith("nvidia-cuda-runtime")]
    if not torch or not cuda:
        raise WorkFailed(problem(f"{s.runtime_lock}", "torch with its CUDA runtime (nvidia-cuda-runtime)",
                                 f"torch {torch and torch[0]} and no CUDA runtime: a CPU build of torch",
                                 "resolve against PyPI (INDEX_URL), where torch is the CUDA build"))
    note(f"{s.runtime_lock}: {n} pins (torch {torch[0]} with {cuda[0]} {lock.pins[cuda[0]][0]})")
    lock_ray(s, uv)
    return n


def ray_lock_path(s: Settings) -> Path:
    """``scripts/ray.lock``, beside the runtime lock."""
    return s.runtime_lock.with_name("ray.lock")


def lock_ray(s: Settings, uv: str | None) -> int:
    """``scripts/ray.lock``: Ray for DIST_BACKEND=ray, within the runtime lock's pins (one version of each)."""
    out = ray_lock_path(s)
    n = make_lock(s, uv, out, [RAY], constraint=s.runtime_lock,
                  what="Ray for DIST_BACKEND=ray (installed on the nodes that use it)")
    note(f"{out}: {n} pins ({RAY})")
    return n
