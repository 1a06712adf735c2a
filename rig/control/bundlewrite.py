"""Writing the offline bundle (rig/build/bundle.py says what it holds and how a box with no network opens it).

Runs after a build, on a box with a network: every wheel comes from the index named by ``INDEX_URL``, is picked
for the target Python and the lock's platform among the files whose sha256 the lock pins, and is kept in
``RIG_CACHE/wheels`` so a second bundle downloads nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import gzip
import json
import os
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

from packaging import tags as wheel_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from rig import REPO_ROOT
from rig.base import atomic, venvs
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.gitutil import Git
from rig.base.hashing import sha256_file
from rig.build import artifacts, bundle, upstream, verify, worktree
from rig.build.kernels import target
from rig.build.steps import runtime
from rig.facts import record
from rig.facts.config import Settings
from rig.facts.uv import absent as uv_absent

NOXFILE = REPO_ROOT / "noxfile.py"


def glibc() -> int:
    """This box's glibc minor (2.36 -> 36): the newest manylinux tag a bundle's wheels may carry. The lock names
    manylinux_2_28, but some of its pins publish x86_64 wheels only for newer glibc (llguidance: 2_31)."""
    text = os.confstr("CS_GNU_LIBC_VERSION") or "glibc 2.28"
    return int(text.split()[-1].split(".")[1])


def platforms(newest: int) -> list[str]:
    """The x86_64 manylinux platform tags up to glibc 2.``newest``, best first."""
    return [f"manylinux_2_{m}_x86_64" for m in range(newest, 4, -1)] + \
        ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def needs_glibc(filename: str) -> int:
    """The glibc minor a wheel needs (the lowest of its manylinux tags; 5 for the old aliases, 0 for pure ones)."""
    found = [int(m) for m in re.findall(r"manylinux_2_(\d+)_", filename)]
    found += [{"2014": 17, "2010": 12, "1": 5}[m] for m in re.findall(r"manylinux(2014|2010|1)_", filename)]
    return min(found, default=0)


def tags_for(python: str, newest: int) -> list[wheel_tags.Tag]:
    """The wheel tags CPython ``python`` (``3.12``) takes on x86_64 with glibc up to 2.``newest``, best first."""
    major, minor = (int(x) for x in python.split("."))
    cp = f"cp{major}{minor}"
    plats = platforms(newest)
    return [*wheel_tags.cpython_tags((major, minor), [cp, "abi3", "none"], plats),
            *wheel_tags.compatible_tags((major, minor), cp, plats)]


def pick(files: list[dict], hashes: set[str], ranks: dict[wheel_tags.Tag, int]) -> dict | None:
    """The best wheel among ``files`` whose sha256 is one of ``hashes`` and whose tags the target takes."""
    best, rank = None, len(ranks)
    for f in files:
        sha = (f.get("hashes") or {}).get("sha256")
        if f"sha256:{sha}" not in hashes or not f.get("filename", "").endswith(".whl"):
            continue
        try:
            got = parse_wheel_filename(f["filename"])[3]
        except InvalidWheelFilename:
            continue
        r = min((ranks[t] for t in got if t in ranks), default=len(ranks))
        if r < rank:
            best, rank = f, r
    return best


def fetch_wheel(s: Settings, name: str, version: str, hashes: tuple[str, ...], python: str,
                ranks: dict[wheel_tags.Tag, int]) -> Path:
    """The wheel of ``name==version`` for the target, from the cache or the index, its sha256 checked."""
    url = f"{s.index_url}/{name}/"
    f = pick(upstream.index_files(url, "set INDEX_URL to an index that has the lock's files"), set(hashes), ranks)
    if f is None:
        raise BadInput(problem(f"{name}=={version} of {s.runtime_lock.name}", f"a wheel for CPython {python} on "
                               f"x86_64 with glibc up to 2.{glibc()} among the lock's hashes", "none on the index",
                               "make the lock again with nox -s lock, or write the bundle for another --python"))
    path = Path(s.cache) / "wheels" / f["filename"]
    want = f["hashes"]["sha256"]
    if not (path.exists() and sha256_file(path) == want):
        upstream.download(urllib.parse.urljoin(url, f["url"]), path)
        found = sha256_file(path)
        if found != want:
            path.unlink()
            raise WorkFailed(problem(f"sha256 of the downloaded {f['filename']}", want, found, "run again"))
    return path


def script_requirements(noxfile: Path = NOXFILE) -> list[str]:
    """The dependencies of the noxfile's inline script block (PEP 723), which ``uv run --script`` installs."""
    block = re.search(r"^# /// script\s*$(.*?)^# ///\s*$", noxfile.read_text(), re.M | re.S)
    text = "\n".join(line[2:] for line in block[1].splitlines()) if block else ""
    m = re.search(r"dependencies\s*=\s*\[(.*?)\]", text, re.S)
    return re.findall(r"\"([^\"]+)\"", m[1]) if m else []


def compile_pins(s: Settings, uv: str | None, python: str, requirements: list[str], out: Path,
                 no_deps: bool = False) -> runtime.Lock:
    """``requirements`` resolved and hashed for CPython ``python`` on the lock's platform, written to ``out``."""
    if not uv:
        raise uv_absent(s, "the bundle resolves the wrappers' own environments with it",
                             "scripts/nox.sh -s pack -- --offline DIR")
    src = out.with_suffix(".in")
    atomic.write_text(src, "\n".join(requirements) + "\n")
    cmd = [uv, "pip", "compile", "--quiet", "--generate-hashes", "--no-header", "--no-annotate", "--python-version",
           python, "--python-platform", runtime.PLATFORM, "--index-url", s.index_url, str(src), "-o", str(out)]
    r = subprocess.run(cmd + (["--no-deps"] if no_deps else []), capture_output=True, text=True)
    src.unlink()
    if r.returncode != 0:
        raise WorkFailed(problem(f"uv pip compile of {', '.join(requirements)[:200]}", "exit 0",
                                 f"exit {r.returncode}: {r.stderr.strip()[-600:]}", "check the network and run again"))
    text = out.read_text()
    atomic.write_text(out, f"# {out.stem} for CPython {python} (the offline bundle).\n# python: {python}\n" + text)
    return runtime.read_lock(out)


def tools(s: Settings, uv: str | None, python: str, folder: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    """The pins of what the wrappers install for themselves: the noxfile's script environment, the bench venv
    (llama-benchy without its dependencies, then the ones it imports, and the rig itself, built with setuptools),
    and pip, which ``uv venv --seed`` puts in the serving venv (a box with no network has no uv cache to seed from)."""
    from rig.control.bench.tool import TOOL, TOOL_DEPS  # the bench's pins: one source with noxfile.py's bench session

    locks = [compile_pins(s, uv, python, [*script_requirements(), *TOOL_DEPS, "setuptools>=69", "wheel", "pip"],
                          folder / "tools.lock"),
             compile_pins(s, uv, python, [TOOL], folder / "bench-tool.lock", no_deps=True)]
    return {(n, v): h for lock in locks for n, (v, h) in lock.pins.items()}


def pinned_uv(s: Settings, dest: Path) -> None:
    """The uv ``scripts/bootstrap_uv.py`` pins, copied from the rig's own or fetched with that script."""
    boot = REPO_ROOT / "scripts" / "bootstrap_uv.py"
    version = re.search(r'^VERSION = "([^"]+)"', boot.read_text(), re.M)[1]
    have = s.state_dir / "uv" / "uv"
    if have.exists():
        r = subprocess.run([str(have), "--version"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split()[1:2] == [version]:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(have, dest)
            return
    r = subprocess.run(["python3", str(boot), str(dest.parent)], capture_output=True, text=True)
    if r.returncode != 0:
        raise WorkFailed(problem(f"uv {version} for the bundle", "fetched by scripts/bootstrap_uv.py",
                                 r.stderr.strip()[-400:], "check the network and run again"))


def _place(src: Path, dest: Path) -> None:
    """A hard link where the file system allows (the cache and the bundle on one disk), else a copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def kernels(src: Path, manifest: dict, dest: Path) -> None:
    """The kernels pack into ``dest``, its tarball as gzip: a box with no network may have neither the zstd
    program nor Python's zstandard module (whose wheel is per CPython), and every Python reads gzip."""
    dest.mkdir(parents=True, exist_ok=True)
    _place(src / artifacts.SUMS, dest / artifacts.SUMS)
    tar = src / manifest["tarball"]
    if manifest["compression"] == "gzip":
        for f in (artifacts.MANIFEST, tar.name):
            _place(src / f, dest / f)
        return
    if (found := sha256_file(tar)) != manifest["tarball_sha256"]:
        raise BadInput(problem(str(tar), f"sha256 {manifest['tarball_sha256']} (its manifest's)", found,
                               "pack it again: scripts/nox.sh -s pack -- --force"))
    gz = dest / artifacts.TARBALLS[1]
    say(f"bundle: the kernels recompressed as {gz.name} ({manifest['bytes'] / 1e6:.0f} MB to read)")
    with verify.decompressed(tar) as raw, open(gz, "wb") as fh, \
            gzip.GzipFile(filename="", mode="wb", compresslevel=6, fileobj=fh, mtime=0) as out:
        shutil.copyfileobj(raw, out, 1 << 20)
    artifacts.write_manifest(dest / artifacts.MANIFEST, {**manifest, "tarball": gz.name, "compression": "gzip",
                                                         "tarball_sha256": sha256_file(gz)})


def serves(manifest_python: str, python: str) -> bool:
    """Whether kernels whose manifest says ``manifest_python`` load under CPython ``python``."""
    return manifest_python == "abi3" or python in manifest_python.split()


def write(s: Settings, dest: Path, part_size: int | None, python: str | None, uv: str | None) -> Path:
    """Write the bundle of this build into ``dest``: a new folder beside it, renamed over it when complete."""
    rec = record.load(s.record_dir, s.device)
    kt = target.of_build(s, rec)
    python = python or kt.python
    if not re.fullmatch(r"3\.\d+", python):
        raise BadInput(problem("--python", "a CPython minor like 3.12", repr(python), "give the offline box's minor"))
    tree = worktree.read_record(s.vllm_dir)
    if tree is None or rec.tree is None or tree.head != rec.tree.head:
        raise BadInput(problem(f"the tree record of {s.vllm_dir}", "the tree this build made", "none or another",
                               "run ./build.sh first"))
    manifest = artifacts.read_manifest(s.artifacts_dir / artifacts.MANIFEST)
    if manifest.get("ops_obj") != kt.ops_obj or manifest.get("torch") != kt.torch:
        raise BadInput(problem(f"{s.artifacts_dir}", f"the kernels of this build (OPS_OBJ {kt.ops_obj[:12]}, torch "
                               f"{kt.torch})", f"OPS_OBJ {str(manifest.get('ops_obj'))[:12]}, torch "
                               f"{manifest.get('torch')}", "run scripts/nox.sh -s pack first (./build.sh packs "
                               "too, unless PACK=0)"))
    if not serves(str(manifest.get("python")), python):
        raise BadInput(problem("--python", f"a Python the kernels load under ({manifest.get('python')})", python,
                               "write the bundle for one of those, or build for that Python"))
    host = venvs.torch_route(kt.torch) == "host"  # the build's route, whatever TORCH says now
    lock = runtime.read_lock(s.runtime_lock)
    pins = {n: p for n, p in lock.pins.items() if not (host and venvs.torch_family(n))}
    dest = Path(dest).expanduser().resolve()
    work = dest.with_name(f".{dest.name}.new-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        say(f"bundle: the pinned uv, the tree {tree.head[:12]} ({tree.tag} + series), the kernels, "
            f"{len(pins)} wheels of {s.runtime_lock.name} for CPython {python}"
            + (" (the torch family left to the host)" if host else ""))
        pinned_uv(s, work / bundle.UV)
        Git(s.vllm_dir).run("bundle", "create", "--quiet", str(work / bundle.TREE), "HEAD", f"refs/tags/{tree.tag}")
        kernels(s.artifacts_dir, manifest, work / bundle.KERNELS)
        ranks = {t: i for i, t in enumerate(tags_for(python, glibc()))}
        wanted = {**{(n, v): h for n, (v, h) in pins.items()}, **tools(s, uv, python, work)}  # both where they differ
        with cf.ThreadPoolExecutor(8) as ex:
            jobs = [ex.submit(fetch_wheel, s, n, v, h, python, ranks) for (n, v), h in wanted.items()]
            for job in jobs:
                path = job.result()
                _place(path, work / bundle.WHEELS / path.name)
        data = describe(s, kt, tree, python, work)
        data["target"]["glibc"] = f"2.{max(needs_glibc(w.name) for w in (work / bundle.WHEELS).iterdir())}"
        if part_size:
            cut(work, data, part_size)
        atomic.write_text(work / bundle.INFO, json.dumps(data, indent=1) + "\n")
        sums = bundle.sums_of(work)
        atomic.write_text(work / bundle.SUMS, "".join(f"{h}  {n}\n" for n, h in sums.items()))
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        if dest.exists():
            os.replace(dest, old)
        os.replace(work, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    say(f"bundle written: {dest}, {len(sums) + 1} files, {size / 1e6:.0f} MB"
        + (f", none over {part_size / (1 << 20):.0f} MiB" if part_size else ""))
    return dest


def describe(s: Settings, kt: target.KernelTarget, tree: worktree.TreeRecord, python: str, work: Path) -> dict:
    """``bundle.json``: what the bundle is for (the target a box's checkout is compared with) and its files."""
    files = {str(p.relative_to(work)): {"sha256": sha256_file(p), "size": p.stat().st_size}
             for p in sorted(work.rglob("*")) if p.is_file()}
    return {
        "format": bundle.FORMAT, "made": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tree": {"head": tree.head, "base": tree.base, "tag": tree.tag, "source": tree.source, "tree": tree.tree,
                 "origin": tree.origin},
        "target": {"series": tree.series, "lock_sha256": runtime.read_lock(s.runtime_lock).sha256,
                   "device": s.device, "torch_route": venvs.torch_route(kt.torch), "torch": kt.torch, "python": python,
                   "platform": runtime.PLATFORM, "ops_obj": kt.ops_obj},
        "files": files,
    }


def cut(work: Path, data: dict, size: int) -> None:
    """Cut every file over ``size`` into parts, and list the parts in ``data``."""
    for name, meta in data["files"].items():
        if meta["size"] > size:
            parts = bundle.split(work / name, size)
            meta["parts"] = [str(p.relative_to(work)) for p in parts]
