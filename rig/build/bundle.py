"""The offline bundle: everything a box with no network needs to build this tree, in one folder.

``nox -s pack -- --offline DIR [--part-size 50M] [--python X.Y]`` writes it on a box with a network, after a
build: the patched tree at its recorded commit (a git bundle with the base tag), the kernels tarball with its
manifest and sha256 list, a wheelhouse of the runtime lock for the target Python (less the torch family with
``TORCH=host``), the wheels of the noxfile's own script environment, and the pinned uv. ``bundle.json`` says what
it is for; ``SHA256SUMS`` lists every file as it lies in DIR. With ``--part-size`` no file is larger than that: the
big ones are cut into numbered parts, joined again on the other side.

``OFFLINE=DIR ./build.sh`` (``scripts/nox.sh``) first runs ``python3 -m rig.build.bundle open DIR``: it checks every
sha256, refuses a bundle of another tree, lock, torch route, device or Python (naming the item), and joins the
parts under ``RIG_STATE/offline``; uv then runs offline from there, and the build takes its base, kernels and wheels
from it. Opening is standard library only: it runs before uv or any dependency exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from rig.base import atomic
from rig.base.console import guard, plain, say
from rig.base.errors import BadInput, problem
from rig.base.hashing import sha256_file as sha256
from rig.facts import config, series

FORMAT = 1
INFO = "bundle.json"
SUMS = "SHA256SUMS"
TREE = "tree.bundle"
KERNELS = "kernels"
WHEELS = "wheels"
UV = "uv/uv"
#: Where an opened bundle lies, under RIG_STATE.
OPENED = "offline"
#: Written into the opened folder last: the bundle files it was opened from, as they were.
STAMP = ".opened.json"
PART = re.compile(r"^(?P<name>.+)\.part(?P<n>\d{3})$")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- what the build reads of an opened bundle ----------------------------------------------------------------------

def opened(s: config.Settings) -> Path | None:
    """The opened bundle's folder when ``OFFLINE`` is set (``RIG_STATE/offline``), else None."""
    return s.state_dir / OPENED if s.offline else None


def wheels(s: config.Settings) -> Path | None:
    d = opened(s)
    return d / WHEELS if d else None


def uv_args(s: config.Settings) -> list[str]:
    """uv's switches for an install from the bundle alone: no index, no network."""
    w = wheels(s)
    return ["--offline", "--no-index", "--find-links", str(w)] if w else []


def pip_args(s: config.Settings) -> list[str]:
    w = wheels(s)
    return ["--no-index", "--find-links", str(w)] if w else []


def info(s: config.Settings) -> dict | None:
    """The opened bundle's ``bundle.json``; refused when OFFLINE is set but the bundle was not opened."""
    d = opened(s)
    if d is None:
        return None
    try:
        return json.loads((d / INFO).read_text())
    except (OSError, ValueError):
        raise BadInput(problem(f"OFFLINE={s.offline}", f"a bundle opened into {d}", "none opened there",
                               "run the build through ./build.sh or scripts/nox.sh, which open it first")) from None


# -- sizes, sums and parts -----------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``50M``, ``1G``, ``512K`` or bytes; at least 1 MiB, so a bundle never becomes thousands of files."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.I)
    size = int(m[1]) * UNITS[m[2].upper()] if m else 0
    if size < UNITS["M"]:
        raise BadInput(problem("--part-size", "a size of at least 1M (like 50M or 1G)", repr(text),
                               "give the largest file size the transfer allows, e.g. --part-size 50M"))
    return size


def split(path: Path, size: int) -> list[Path]:
    """Cut ``path`` into ``NAME.part000``, ``NAME.part001`` ... of at most ``size`` bytes; remove it."""
    parts = []
    with open(path, "rb") as src:
        while chunk := src.read(size):
            part = path.with_name(f"{path.name}.part{len(parts):03d}")
            part.write_bytes(chunk)
            parts.append(part)
    path.unlink()
    return parts


def sums_of(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != SUMS}


# -- opening (standard library only) -------------------------------------------------------------------------------

def _read_info(src: Path) -> dict:
    try:
        data = json.loads((src / INFO).read_text())
    except FileNotFoundError:
        raise BadInput(problem(f"OFFLINE={src}", f"a bundle folder with {INFO} (nox -s pack -- --offline DIR)",
                               f"no {INFO} in it", "point OFFLINE at the folder the pack wrote, copied whole"
                               )) from None
    except (OSError, ValueError) as exc:
        raise BadInput(problem(f"{src / INFO}", "the bundle's JSON description", f"{type(exc).__name__}: {exc}",
                               "copy the bundle again from where it was written")) from None
    if data.get("format") != FORMAT:
        raise BadInput(problem(f"{src / INFO}: format", str(FORMAT), repr(data.get("format")),
                               "write the bundle with this checkout's nox -s pack -- --offline"))
    return data


def _check_sums(src: Path) -> dict[str, str]:
    """Every file SHA256SUMS lists, as it lies in ``src``, against its sha256; the list."""
    try:
        lines = (src / SUMS).read_text().splitlines()
    except FileNotFoundError:
        raise BadInput(problem(f"OFFLINE={src}", f"a {SUMS} list", "none", "copy the bundle again, whole")) from None
    listed = {}
    for line in lines:
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name or ".." in Path(name).parts:
            raise BadInput(problem(f"{src / SUMS}", "lines 'SHA256  NAME'", repr(line[:80]),
                                   "copy the bundle again from where it was written"))
        listed[name] = digest
    for n, (name, digest) in enumerate(sorted(listed.items()), 1):
        path = src / name
        if not path.is_file():
            raise BadInput(problem(f"{path}", f"a file of the bundle ({SUMS} lists it)", "missing",
                                   "copy the missing file (or part) from the bundle's source; nothing was used"))
        found = sha256(path)
        if found != digest:
            raise BadInput(problem(f"sha256 of {path}", digest, found, "copy that file again (a transfer broke or "
                                   "changed it); nothing was used"))
        if n % 25 == 0 or n == len(listed):
            say(f"bundle: {n}/{len(listed)} files checked", err=True)
    return listed


def _want(s: config.Settings) -> dict[str, str]:
    """What this checkout needs of a bundle: its series, its lock, the device, the torch route and, for the
    host route, the Python minor of PYTHON."""
    files = series.patch_files(s.patches_dir)
    # as rig.build.steps.runtime.read_lock has it
    lock = hashlib.sha256(s.runtime_lock.read_text().encode()).hexdigest()
    want = {"series": series.digest(files), "lock_sha256": lock, "device": s.device, "torch_route": s.torch}
    if s.torch == "host" and s.python:
        r = subprocess.run([s.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            want["python"] = r.stdout.strip()
    elif s.torch != "host":
        want["python"] = "3.13"
    return want


FIXES = {
    "series": "write the bundle from a build of this checkout's patches/ (nox -s pack -- --offline DIR there)",
    "lock_sha256": "write the bundle from a checkout with this scripts/runtime.lock",
    "device": "set DEVICE to the bundle's, or write a bundle for this DEVICE",
    "torch_route": "set TORCH to the bundle's, or write a bundle with this TORCH",
    "python": "point PYTHON at an interpreter of the bundle's Python, or write the bundle with --python X.Y",
}


def check_target(data: dict, want: dict[str, str], src: Path) -> None:
    """The bundle's target against what this checkout needs; the first difference names the item."""
    have = data.get("target", {})
    for key, value in want.items():
        if str(have.get(key)) != value:
            raise BadInput(problem(f"{src / INFO}: {key}", f"{value} (this checkout's)", repr(have.get(key)),
                                   FIXES[key]))


def check_glibc(data: dict, src: Path) -> None:
    """This box's glibc must be at least the newest one the bundle's wheels were picked for."""
    need = str(data.get("target", {}).get("glibc", "2.5"))
    have = (os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0.0").split()[-1]
    if tuple(map(int, have.split(".")[:2])) < tuple(map(int, need.split(".")[:2])):
        raise BadInput(problem(f"{src / INFO}: glibc", f"at most this box's {have}", need,
                               "write the bundle on a box whose glibc is no newer than this one's"))


def _stamp(src: Path) -> dict:
    """What a re-open compares instead of hashing again: the folder, and each file's size and modification time."""
    return {"src": str(src), "files": {str(p.relative_to(src)): [p.stat().st_size, p.stat().st_mtime_ns]
                                       for p in sorted(src.rglob("*")) if p.is_file()}}


def open_bundle(s: config.Settings, src: Path) -> Path:
    """Check the bundle in ``src`` and join its parts into ``RIG_STATE/offline``; that folder.

    A file already there with the right sha256 is kept, so opening the same bundle again costs only the checks."""
    src = Path(src).expanduser().resolve()
    data = _read_info(src)
    check_target(data, _want(s), src)
    check_glibc(data, src)
    dest = s.state_dir / OPENED
    seen = _stamp(src)
    try:
        if json.loads((dest / STAMP).read_text()) == seen:
            return dest  # opened before from these very files (sizes and times): every wrapper call stays fast
    except (OSError, ValueError):
        pass
    listed = _check_sums(src)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / STAMP).unlink(missing_ok=True)
    for name, meta in data["files"].items():
        out = dest / name
        if out.is_file() and out.stat().st_size == meta["size"] and sha256(out) == meta["sha256"]:
            continue
        parts = meta.get("parts") or [name]
        for p in parts:
            if p not in listed:
                raise BadInput(problem(f"{src / INFO}: {name}", f"its parts listed in {SUMS}", f"{p} not listed",
                                       "copy the bundle again from where it was written"))
        with atomic.atomic_open(out, "wb", perms=0o755 if name == UV else 0o644) as fh:
            for p in parts:
                with open(src / p, "rb") as part:
                    shutil.copyfileobj(part, fh, 1 << 20)
        found = sha256(out)
        if found != meta["sha256"]:
            out.unlink()
            raise BadInput(problem(f"{name} joined from {len(parts)} part(s) of {src}", meta["sha256"], found,
                                   "copy the bundle's parts again; nothing was used"))
    stale = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()} - set(data["files"]) - {INFO, STAMP}
    for name in stale:  # a file of an earlier bundle: never mixed into this one's wheelhouse
        (dest / name).unlink()
    atomic.write_text(dest / INFO, json.dumps(data, indent=1) + "\n")
    atomic.write_text(dest / STAMP, json.dumps(seen) + "\n")
    say(f"bundle {src}: {len(data['files'])} files checked and ready in {dest} (tree {data['tree']['head'][:12]}, "
        f"torch {data['target']['torch']}, Python {data['target']['python']})", err=True)
    return dest


def shell(d: Path, uv: str | None, src: Path) -> str:
    """The wrapper's variables for an opened bundle ``d``: uv, pip and the rig install from its wheels alone."""
    w = shlex.quote(str(d / WHEELS))
    lines = [f"export OFFLINE={shlex.quote(str(Path(src).resolve()))}",
             f"export UV_OFFLINE=1 UV_NO_INDEX=1 UV_FIND_LINKS={w} PIP_NO_INDEX=1 PIP_FIND_LINKS={w}"]
    if not uv or uv == "0":
        lines.append(f"uv={shlex.quote(str(d / UV))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m rig.build.bundle", description="Open an offline bundle: check every "
                                 "sha256 and what it was written for, join its parts under RIG_STATE/offline, and "
                                 "print that folder (scripts/nox.sh runs it when OFFLINE is set).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("open", help="check and open the bundle in DIR")
    o.add_argument("dir", type=Path)
    o.add_argument("--shell", action="store_true", help="print, for scripts/nox.sh to eval, the variables that make "
                   "uv and pip install from the bundle alone (and the bundle's uv, unless UV names one)")
    args = ap.parse_args(argv)

    def go() -> int:
        s = config.settings()
        if not args.dir.is_dir():
            raise BadInput(problem(f"OFFLINE={args.dir}", "a bundle folder (nox -s pack -- --offline DIR)",
                                   "no such folder", "point OFFLINE at the copied bundle, or unset it"))
        d = open_bundle(s, args.dir)
        plain(shell(d, s.uv, args.dir) if args.shell else str(d))
        return 0

    return guard(go)


if __name__ == "__main__":
    sys.exit(main())
