"""Fixtures: a small upstream vLLM-like git repository, a real mail-format series, and a way to run the rig."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.series import HEADER  # noqa: E402

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

# The files of the small upstream: vLLM's layout, a few lines each.
UPSTREAM_FILES = {
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.26)\nproject(vllm_fixture LANGUAGES CXX)\n",
    "cmake/utils.cmake": "# helpers\nfunction(fixture_helper)\nendfunction()\n",
    "csrc/ops.cpp": "".join(f"// line {i}\n" for i in range(1, 21)) + "int vllm_fixture_op(int x) { return x + 1; }\n",
    "setup.py": "from setuptools import setup\nsetup()\n",
    "pyproject.toml": "[project]\nname = \"vllm\"\nversion = \"0.30.0\"\n",
    "requirements/build.txt": "cmake>=3.26\nninja\n",
    "requirements/common.txt": "requests\n",
    "vllm/__init__.py": "__version__ = \"0.30.0\"\n",
    "vllm/envs.py": "MAX_JOBS = None\n",
    "vllm/third_party/__init__.py": "",
    "vllm/entrypoints/api.py": "".join(f"# api line {i}\n" for i in range(1, 31)) + "def serve():\n    return 'ok'\n",
    "README.md": "fixture upstream\n",
}


def git(cwd: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **IDENT})
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {r.stderr}")
    return r.stdout.strip()


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


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
