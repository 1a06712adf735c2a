"""``nox -s image``: the rig's image, built by the Dockerfile's route 1 from the kernels ``./build.sh`` packed.

``DEVICE`` picks the variant: the GPU host's image from ``artifacts/``, or with ``DEVICE=cpu`` the CPU build's from
``artifacts-cpu/`` (``vllm:cpu``), which serves the demo model on any box.

Plan, then act. :func:`plan` reads the settings and asks the box what it has: which builder answers (BuildKit
through ``docker buildx``, podman, or buildah), whether that builder holds the base image or a registry answers
for it, and the host's CA store; it returns every command, and ``--dry-run`` prints them. :func:`act` makes the
base where it must (``debootstrap`` of Debian trixie, imported into the builder), runs the build with the
kernels as the ``ops`` context and the CA store as the ``host_ca`` secret, and records the image's size, its
build time and the kernels it holds in ``RIG_STATE/image-DEVICE.json`` (written atomically).

Route 2 (the full compile inside the image) stays the Dockerfile's own: hours on a small box, so this command
refuses to start without packed kernels.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rig.base import atomic
from rig.base.console import header, say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.build import artifacts, verify
from rig.facts.config import Image, Settings

BUILDERS = ("docker", "podman", "buildah")
#: The Dockerfile's own default base (its ARG BASE_IMAGE), and what debootstrap makes in its place.
DEFAULT_BASE = "debian:trixie-slim"
MADE_BASE = "localhost/rig-base:trixie"
SUITE, MIRROR = "trixie", "http://deb.debian.org/debian"
REGISTRY = "https://registry-1.docker.io/v2/"
#: The image's size before a build of its variant has recorded one (docs/container.md: 10.2 GB, 9.2 GB).
EXPECTED_BYTES = {"cuda": 10.2e9, "cpu": 9.2e9}
#: The builder storage a build needs free, in images: the venv layer is written, then committed as a layer of
#: about its size (two builds that ran out of disk did so mid-commit, with no useful message).
NEED_IMAGES = 2.0
PRUNE = {"docker": "docker system prune", "podman": "podman system prune", "buildah": "buildah rmi --prune"}


def _ok(cmd: list[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def usable(name: str) -> str | None:
    """Why ``name`` cannot build here, or None when it can."""
    if not shutil.which(name):
        return "not installed"
    if name == "docker":
        if not _ok(["docker", "buildx", "version"]):
            return "no buildx plugin (BuildKit)"
        if not _ok(["docker", "info"]):
            return "no docker daemon answers"
    return None


def choose_builder(want: str) -> tuple[str, list[str]]:
    """(the builder, why each one before it was passed over)."""
    passed = []
    for name in ([want] if want != "auto" else BUILDERS):
        why = usable(name)
        if why is None:
            return name, passed
        passed.append(f"{name}: {why}")
    raise BadInput(problem("BUILDER", f"{want if want != 'auto' else 'docker (with buildx), podman or buildah'} "
                           "able to build", "; ".join(passed),
                           "apt-get install -y buildah (or podman), or start the docker daemon"))


def has_image(builder: str, ref: str) -> bool:
    return _ok({"docker": ["docker", "image", "inspect", ref], "podman": ["podman", "image", "exists", ref],
                "buildah": ["buildah", "inspect", "--type", "image", ref]}[builder])


def registry_answers(url: str = REGISTRY, timeout: float = 5) -> bool:
    """Whether the registry the base would come from answers at all (401 is an answer)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


@dataclass(frozen=True)
class Plan:
    """Everything the build will do, decided before any of it is done."""

    builder: str
    passed: list[str]
    base: str
    make_base: bool  # True: debootstrap makes MADE_BASE first
    base_why: str
    ca: Path | None
    ops: Path
    key: str  # sha256 of the kernels' manifest and sums: what the image's route-1 layer is keyed by
    tag: str
    build: list[str]  # the builder's command line
    storage: str = ""  # the builder's storage folder, its free bytes, and what the build needs there


def kernels_key(ops: Path) -> str:
    """The image's route-1 key, as the Dockerfile's opskey stage makes it (manifest, then sums)."""
    return hashlib.sha256((ops / artifacts.MANIFEST).read_bytes() + (ops / artifacts.SUMS).read_bytes()).hexdigest()


def build_command(builder: str, s: Settings, tag: str, base: str, ca: Path | None) -> list[str]:
    head = {"docker": ["docker", "buildx", "build", "--load"],
            # chroot isolation: the RUN steps need no OCI runtime, so they run where the default one cannot (in a
            # container; crun on a host with hybrid cgroups)
            "podman": ["podman", "build", "--format", "docker", "--layers", "--isolation", "chroot"],
            "buildah": ["buildah", "bud", "--format", "docker", "--layers", "--isolation", "chroot"]}[builder]
    build_args = {"BASE_IMAGE": base, "DEVICE": s.device, "ARCH": s.arch, "MAX_JOBS": s.max_jobs,
                  "OPS_ROUTE": s.ops_route}
    args = [*head, "-f", str(s.root / "Dockerfile"), "-t", tag, "--build-context", f"ops={s.artifacts_dir}",
            *(x for k, val in build_args.items() for x in ("--build-arg", f"{k}={val}"))]
    if ca:
        args += ["--secret", f"id=host_ca,src={ca}"]
    return [*args, str(s.root)]


def plan(s: Settings, im: Image) -> Plan:
    """Decide the build: refuse what cannot work before anything starts (exit 2)."""
    ops = s.artifacts_dir
    if not (ops / artifacts.MANIFEST).is_file() or not (ops / artifacts.SUMS).is_file():
        raise BadInput(problem(f"the kernels in {ops}", f"{artifacts.MANIFEST} and {artifacts.SUMS} (route 1)",
                               "none", f"run {'DEVICE=cpu ' if s.device == 'cpu' else ''}./build.sh first (it packs "
                               "them; with PACK=0, scripts/nox.sh -s pack does); route 2, the compile inside the "
                               "image, is the Dockerfile's own: docs/container.md"))
    builder, passed = choose_builder(im.builder)
    storage = disk_check(builder, s)
    base, make, why = im.base_image, False, "the builder holds it"
    if not has_image(builder, base):
        if registry_answers():
            why = "a registry answers: the builder pulls it"
        elif base == DEFAULT_BASE:
            if not shutil.which("debootstrap"):
                raise BadInput(problem("the base image", f"{DEFAULT_BASE} in the builder, a registry, or "
                                       "debootstrap to make it", "none of them", "apt-get install -y debootstrap"))
            base, make, why = MADE_BASE, True, f"no registry answers: debootstrap makes {SUITE} as {MADE_BASE}"
            if has_image(builder, MADE_BASE):
                make, why = False, f"no registry answers: {MADE_BASE}, made by an earlier run"
        else:
            raise BadInput(problem("BASE_IMAGE", "an image the builder holds or can pull", f"{base}: neither",
                                   f"load it into {builder}, or unset BASE_IMAGE to make {SUITE} with debootstrap"))
    ca = im.host_ca_file if im.host_ca_file and im.host_ca_file.is_file() else None
    return Plan(builder, passed, base, make, why, ca, ops, kernels_key(ops), im.tag,
                build_command(builder, s, im.tag, base, ca), storage)


def storage_root(builder: str) -> Path | None:
    """Where ``builder`` keeps its layers (its own answer), or None when it does not say."""
    cmd = {"docker": ["docker", "info", "-f", "{{.DockerRootDir}}"],
           "podman": ["podman", "info", "-f", "{{.Store.GraphRoot}}"], "buildah": ["buildah", "info"]}[builder]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        root = json.loads(out)["store"]["GraphRoot"] if builder == "buildah" else out
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return None
    return Path(root) if root else None


def need_bytes(s: Settings) -> int:
    """Free builder storage the build needs: NEED_IMAGES of the image's size, the last recorded one of this
    variant when there is one."""
    try:
        size = float(json.loads((s.state_dir / f"image-{s.device}.json").read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        size = EXPECTED_BYTES[s.device]
    return int(NEED_IMAGES * size)


def disk_check(builder: str, s: Settings) -> str:
    """The builder's storage has room for the build, or exit 2 with the sizes (before anything starts)."""
    root = storage_root(builder)
    if root is None:
        return f"storage: {builder} did not say where it keeps its layers; not checked"
    free, need = verify.free_space(root)[1], need_bytes(s)
    if free < need:
        raise BadInput(problem(f"free disk for {builder}'s storage ({root})", f">= {need / 1e9:.1f} GB (the "
                               f"image is about {need / NEED_IMAGES / 1e9:.1f} GB: its venv layer is written, then "
                               "committed)", f"{free / 1e9:.1f} GB free",
                               f"free {(need - free) / 1e9:.1f} GB more there ({PRUNE[builder]} removes what no "
                               "image uses), or give the builder a storage folder on a bigger disk"))
    return f"storage: {root}, {free / 1e9:.1f} GB free, the build needs {need / 1e9:.1f} GB"


def make_base(builder: str, cache: Path) -> None:
    """Debian trixie (minbase) from its archive, imported into the builder as MADE_BASE."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".base-") as tmp:
        root, tar = Path(tmp) / "root", Path(tmp) / "root.tar"
        t0 = time.monotonic()
        r = subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(root), MIRROR], capture_output=True,
                           text=True)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["no output"]
            raise WorkFailed(problem(f"debootstrap {SUITE}", "exit 0", f"{r.returncode} ({tail[0]})",
                                     f"check that {MIRROR} answers"))
        subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "."], check=True)
        if builder == "buildah":
            ctr = subprocess.run(["buildah", "from", "scratch"], capture_output=True, text=True,
                                 check=True).stdout.strip()
            try:
                subprocess.run(["buildah", "add", ctr, str(tar), "/"], capture_output=True, check=True)
                subprocess.run(["buildah", "commit", "-q", ctr, MADE_BASE], capture_output=True, check=True)
            finally:
                subprocess.run(["buildah", "rm", ctr], capture_output=True)
        else:
            subprocess.run([builder, "import", str(tar), MADE_BASE], capture_output=True, check=True)
        say(f"base: {MADE_BASE} made in {time.monotonic() - t0:.0f} s")


#: The decimal units buildah writes an image's size in ("10.2 GB").
UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def image_bytes(builder: str, tag: str) -> int:
    if builder == "buildah":  # its JSON gives the size only as text, to three digits
        out = subprocess.run(["buildah", "images", "--json", tag], capture_output=True, text=True).stdout
        number, _, unit = str(json.loads(out or "[{}]")[0].get("size", "0 B")).partition(" ")
        return int(float(number) * UNITS.get(unit, 1))
    fmt = "{{.Size}}"
    cmd = ["docker", "image", "inspect", "-f", fmt, tag] if builder == "docker" else \
        ["podman", "image", "inspect", "--format", fmt, tag]
    return int(subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or 0)


def show(p: Plan) -> None:
    say(f"kernels: {p.ops} (route 1; key {p.key[:12]})")
    say(f"builder: {p.builder}" + (f" ({'; '.join(p.passed)})" if p.passed else ""))
    say(f"base: {p.base}: {p.base_why}")
    say(f"host CA: {p.ca} as the build secret host_ca" if p.ca else "host CA: none found (HOST_CA_FILE)")
    say(p.storage)
    say("build: " + " ".join(p.build))


def act(s: Settings, p: Plan) -> dict:
    """Build the image and record it; the record is written only for a build that succeeded."""
    if p.make_base:
        make_base(p.builder, s.cache / "image-base")
    t0 = time.monotonic()
    r = subprocess.run(p.build, cwd=s.root)  # the builder's own progress, as it prints it
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise WorkFailed(problem(f"the image build ({p.builder})", "exit 0", str(r.returncode),
                                 "read the builder's output above; the record of the last good image is kept"))
    rec = {"tag": p.tag, "builder": p.builder, "base": p.base, "device": s.device, "kernels_key": p.key,
           "seconds": round(took, 1), "bytes": image_bytes(p.builder, p.tag),
           "built": datetime.now(UTC).isoformat(timespec="seconds")}
    atomic.write_text(s.state_dir / f"image-{s.device}.json", json.dumps(rec, indent=1) + "\n")
    say(f"image: {p.tag}, {rec['bytes'] / 1e9:.2f} GB, built in {took:.0f} s by {p.builder}; recorded in "
        f"{s.state_dir / f'image-{s.device}.json'}")
    return rec


def run(s: Settings, im: Image, dry_run: bool) -> int:
    header(1, 1, "image", "the rig's image from the packed kernels (the Dockerfile's route 1)")
    p = plan(s, im)
    show(p)
    if not dry_run:
        act(s, p)
    return 0
