"""Fixtures: a small upstream vLLM-like git repository, a real mail-format series, and a way to run the rig."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fixture_upstream import UPSTREAM_FILES, write_files  # noqa: E402,F401 - shared with the fixtures

from rig.facts.series import HEADER  # noqa: E402

# The wrapper puts uv's folder on PATH; do the same when pytest is started by hand.
if not shutil.which("uv"):
    for _cand in (Path(sys.executable).parent, Path.home() / ".local" / "bin"):
        if (_cand / "uv").exists():
            os.environ["PATH"] = f"{_cand}{os.pathsep}{os.environ['PATH']}"
            break

IDENT = {
    "GIT_AUTHOR_NAME": "Test Author", "GIT_AUTHOR_EMAIL": "author@example.invalid",
    "GIT_COMMITTER_NAME": "Test Author", "GIT_COMMITTER_EMAIL": "author@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
}
OPS_PATHS = ["csrc", "CMakeLists.txt", "cmake", "setup.py", "pyproject.toml", "requirements/build.txt",
             "vllm/envs.py", "vllm/third_party"]
TAG = "v0.30.0"


def variables_table(text: str, header: str = "| Variable | Default | Meaning |") -> list[tuple[str, str, str]]:
    """The README's variables table below ``header``: (name, default, meaning) per row."""
    block = text.split(header, 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in block.strip().splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


# The files of the small upstream: vLLM's layout, a few lines each.
def git(cwd: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **IDENT})
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {r.stderr}")
    return r.stdout.strip()


@dataclass
class Series:
    """A patch series made with git format-patch against the fixture upstream."""

    upstream: Path
    work: Path  # a clone where the series' commits are made
    patches: Path
    ops_paths: list[str] = field(default_factory=lambda: list(OPS_PATHS))

    def commit(self, message: str, files: dict[str, str] | None = None, delete: tuple[str, ...] = ()) -> None:
        """Make one commit in the work clone and re-export the whole series."""
        write_files(self.work, files or {})
        for rel in delete:
            git(self.work, "rm", "-q", rel)
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "-m", message)
        self.export()

    def export(self) -> None:
        for p in self.patches.glob("*.patch"):
            p.unlink()
        if git(self.work, "rev-list", "--count", f"{TAG}..HEAD") != "0":
            git(self.work, "format-patch", "-q", "--zero-commit", "-o", str(self.patches), TAG)

    @property
    def tree(self) -> str:
        """The tree the series must give, as plain git computes it in the work clone."""
        return git(self.work, "rev-parse", "HEAD^{tree}")

    def write_toml(self, expected: dict[str, str] | None = None, **upstream) -> None:
        data = {
            "upstream": {"version": "0.30.0", "tag": TAG, "git": str(self.upstream), **upstream},
            "expected": {src: {"tree": t, "verified": "2026-01-01"} for src, t in (expected or {}).items()},
            "ops": {"paths": self.ops_paths},
        }
        (self.patches / "series.toml").write_text(HEADER + tomli_w.dumps(data))


def make_upstream(path: Path, files: dict[str, str] | None = None) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    write_files(path, files or UPSTREAM_FILES)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "upstream v0.30.0")
    git(path, "tag", "-a", TAG, "-m", "v0.30.0")
    git(path, "commit", "-q", "--allow-empty", "-m", "after the tag (must not be fetched)")
    return path


@pytest.fixture
def series(tmp_path: Path) -> Series:
    """An upstream repo, a work clone at the tag, and an empty patches/ with series.toml."""
    up = make_upstream(tmp_path / "upstream")
    work = tmp_path / "work"
    git(tmp_path, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", "-B", "series", TAG)
    patches = tmp_path / "patches"
    patches.mkdir()
    s = Series(up, work, patches)
    s.write_toml({"git": s.tree})
    return s


@pytest.fixture
def rig_env(tmp_path: Path, series: Series) -> dict[str, str]:
    """The environment of a rig run on the fixture: its own vllm/, state and cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("FETCH", "UV", "PACK", "VLLM_UPSTREAM_URL")}
    env.update(IDENT)
    env.update({
        "PATCHES_DIR": str(series.patches), "VLLM_DIR": str(tmp_path / "vllm"),
        "RIG_STATE": str(tmp_path / "state"), "RIG_CACHE": str(tmp_path / "cache"),
        "VLLM_SOURCE": "git", "VLLM_UPSTREAM_URL": str(series.upstream),
    })
    return env


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def fact(self, key: str) -> str:
        for line in self.out.splitlines():
            if line.startswith(f"{key}: "):
                return line.split(": ", 1)[1]
        raise AssertionError(f"no '{key}:' line in:\n{self.text}")


def free_port() -> int:
    """A port nothing listens on now, on the loopback (the engines, registries and servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rig(env: dict[str, str], *args: str, timeout: float = 600) -> Result:
    """``python -m rig.cli ARGS`` as the nox sessions run it."""
    r = subprocess.run([sys.executable, "-m", "rig.cli", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return Result(r.returncode, r.stdout, r.stderr)


@pytest.fixture(scope="session")
def tools_state(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """One run of the real tools step (cmake >= 3.26 and ninja from PyPI when the system's are old)."""
    state = tmp_path_factory.mktemp("tools-state")
    env = {**os.environ, "RIG_STATE": str(state)}
    env.pop("UV", None)
    r = run_rig(env, "build", "--only", "tools")
    assert r.code == 0, r.text
    return state, {"cmake": r.fact("cmake"), "ninja": r.fact("ninja"), "out": r.out, "err": r.err}


class Index:
    """A PEP 691 simple index on loopback serving vLLM files, each with the sha256 it is told."""

    def __init__(self, root: Path, files: dict[str, bytes], listed: dict[str, str] | None = None) -> None:
        from rig.build.upstream import project_of

        (root / "files").mkdir(parents=True)
        (root / "simple" / "vllm").mkdir(parents=True)
        projects: dict[str, list[dict]] = {"vllm": []}
        for name, data in files.items():
            (root / "files" / name).write_bytes(data)
            sha = (listed or {}).get(name) or hashlib.sha256(data).hexdigest()
            projects.setdefault(project_of(name), []).append(
                {"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": sha}})
        self.sha = {e["filename"]: e["hashes"]["sha256"] for entries in projects.values() for e in entries}
        for project, entries in projects.items():
            page = {"meta": {"api-version": "1.1"}, "name": project, "files": entries}
            (root / "simple" / project).mkdir(parents=True, exist_ok=True)
            (root / "simple" / project / "index.html").write_text(json.dumps(page))

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(root), **k)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


WHEEL = "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl"


@pytest.fixture(scope="session")
def real_venv(tmp_path_factory):
    """Steps 1, 3, 4, 5 for real: the committed lock (CUDA torch, from the uv cache) in a venv of the tests."""
    d = tmp_path_factory.mktemp("real-venv")
    env = {k: v for k, v in os.environ.items() if k not in ("UV", "PYTHON", "UV_PYTHON", "CUDA_HOME")}
    env.update({"VENV_DIR": str(d / ".venv"), "RIG_STATE": str(d / "state")})
    r = run_rig(env, "build", "--only", "tools,venv,runtime,toolchain", timeout=3000)
    return r, env, d


@pytest.fixture(scope="session")
def fixture_wheel(tmp_path_factory, real_venv) -> bytes:
    """The fixture's 'official wheel': its extension compiled once, zipped under the official name."""
    r, env, d = real_venv
    assert r.code == 0, r.text[-2000:]
    src = tmp_path_factory.mktemp("wheel-src")
    write_files(src, UPSTREAM_FILES)
    cmake = r.fact("cmake")
    py = str(d / ".venv" / "bin" / "python")
    build = src / "build"
    configure = [cmake, "-S", str(src), "-B", str(build), f"-DPython3_EXECUTABLE={py}"]
    for cmd in (configure, [cmake, "--build", str(build)]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
    whl = src / WHEEL
    with zipfile.ZipFile(whl, "w") as z:
        z.write(build / "_C_stable_libtorch.abi3.so", "vllm/_C_stable_libtorch.abi3.so")
        z.writestr("vllm-0.30.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: cp38-abi3-manylinux_2_28_x86_64\n")
    return whl.read_bytes()


@pytest.fixture
def ops_env(tmp_path, series, rig_env, real_venv, fixture_wheel):
    """The fixture tree built on the real venv: its own vllm/, state (steps 1-5 done) and wheel index."""
    _, venv_env, d = real_venv
    state = Path(rig_env["RIG_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    shutil.copy(d / "state" / "build.toml", state / "build.toml")
    idx = Index(tmp_path / "index", {WHEEL: fixture_wheel})
    env = {**rig_env, "VENV_DIR": venv_env["VENV_DIR"], "INDEX_URL": idx.url, "BUILD_LOG_DIR": str(tmp_path / "logs"),
           "CCACHE_DIR": str(tmp_path / "ccache")}
    yield env, idx
    idx.stop()


@pytest.fixture(scope="session")
def checkout(tmp_path_factory) -> Path:
    """The repository's files as a fresh clone has them (tracked and new), no build output yet: the one copy the
    session's real builds and engines share. The lane ``serve`` (rig/base/testlanes.py) serves on the CPU only:
    its copy never makes the CUDA build, which it does not need."""
    return checkout_copy(tmp_path_factory.mktemp("fresh") / "rig")


@pytest.fixture(scope="session")
def fresh(checkout):
    """./build.sh in the fresh copy: the real CUDA build of test_real_build.py, which test_real_cpu.py builds the
    CPU target beside."""
    dest = checkout
    env = build_env()
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True, timeout=3600)
    return dest, r, env


@pytest.fixture(scope="session")
def cpu_build(checkout):
    """The fresh copy's first ``DEVICE=cpu ./build.sh`` (or a no-op one, after ``./start.sh --demo`` built it):
    made once, by whichever test needs it first (tests/test_real_cpu.py, which asks for the CUDA build first,
    reads what this first build printed beside it; the PLE tests serve on it). Python writes no bytecode in its
    processes (``PYTHONDONTWRITEBYTECODE=1``, as some boxes set): the build's import check writes the engine's
    anyway, which the engines of the benchmarks started on this copy then read."""
    dest, env = checkout, build_env()
    cpu_env = {**env, "DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=cpu_env, capture_output=True, text=True,
                       timeout=3600)
    return dest, r, cpu_env


def checkout_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked and new), no build output: ``dest``."""
    files = git(ROOT, "ls-files", "-co", "--exclude-standard", "-z").split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def build_env(**extra: str) -> dict[str, str]:
    """This process's environment less the rig's build variables, plus ``extra``."""
    drop = ("VLLM_DIR", "PATCHES_DIR", "RIG_STATE", "VENV_DIR", "RUNTIME_LOCK", "BUILD_LOG_DIR", "FETCH", "UV",
            "PYTHON", "UV_PYTHON", "CUDA_HOME", "OPS_ROUTE", "DEVICE", "ARTIFACTS_DIR", "CPU_WHEEL", "TORCH", "OFFLINE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def pytest_collection_modifyitems(session, config, items):
    """The benchmarks' slow runs go last: they time and change the shared copies (the fresh build, the real venv),
    so every test that asserts on those copies' first builds runs before them."""
    last = {id(i) for i in items if i.path.name == "test_benchmarks.py" and i.get_closest_marker("slow")}
    items[:] = [i for i in items if id(i) not in last] + [i for i in items if id(i) in last]


def engine_like(match, *roots: Path) -> list[psutil.Process]:  # noqa: ANN001 - (process, its command line) -> bool
    """Live processes (zombies aside) that ``match`` accepts, or named like vLLM's engine core and workers and
    working in one of ``roots`` (the rig starts its engine in its checkout): the engines of another copy, those of
    the suite's other lane (rig/base/testlanes.py), are not these."""
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if match(p, cmd) or ("VLLM::" in (p.info["name"] or "") or "VLLM::" in cmd) and works_in(p, roots):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def works_in(p: psutil.Process, roots: tuple[Path, ...]) -> bool:
    """Whether ``p``'s working folder is one of ``roots`` or below one."""
    try:
        cwd = Path(p.cwd())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(cwd == r or r in cwd.parents for r in roots)


def vllm_named(*roots: Path) -> list[str]:
    """The live processes named like vLLM's engine core and workers that work in one of ``roots``."""
    return [f"{p.pid} {p.info['name']}" for p in engine_like(lambda p, cmd: False, *roots)]
