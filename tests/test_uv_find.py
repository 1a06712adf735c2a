"""rig.facts.uv.find: the uv a benchmark runs, found as scripts/nox.sh finds it (UV, PATH, .rig/uv, else fetched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rig.base.errors import BadInput, WorkFailed
from rig.facts import uv


def fake_uv(folder: Path, name: str = "uv") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text("#!/bin/sh\necho 'uv 0.0.0'\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository root with no uv of its own yet, and a PATH (one empty folder) that has no uv."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "empty").mkdir()
    return tmp_path / "repo"


def env_of(repo: Path, **extra: str) -> dict[str, str]:
    return {"PATH": str(repo.parent / "empty"), **extra}


def test_the_rigs_own_uv_is_found_when_path_has_none(repo):
    own = fake_uv(repo / ".rig" / "uv")
    assert uv.find(repo, env_of(repo)) == str(own)


def test_uv_on_path_comes_before_the_rigs_own(repo, tmp_path):
    fake_uv(repo / ".rig" / "uv")
    on_path = fake_uv(tmp_path / "bin")
    assert uv.find(repo, {"PATH": f"{tmp_path / 'empty'}:{tmp_path / 'bin'}"}) == str(on_path)


def test_uv_set_to_a_path_wins(repo, tmp_path):
    fake_uv(repo / ".rig" / "uv")
    on_path = fake_uv(tmp_path / "bin")
    chosen = fake_uv(tmp_path / "chosen", "my-uv")
    assert uv.find(repo, {"PATH": str(on_path.parent), "UV": str(chosen)}) == str(chosen)


@pytest.mark.parametrize("value", ["", "0"])
def test_uv_empty_or_0_is_skipped_as_the_wrapper_skips_it(repo, tmp_path, value):
    on_path = fake_uv(tmp_path / "bin")
    assert uv.find(repo, {"PATH": str(on_path.parent), "UV": value}) == str(on_path)
    own = fake_uv(repo / ".rig" / "uv")
    assert uv.find(repo, env_of(repo, UV=value)) == str(own)


def bootstrap(repo: Path, body: str) -> None:
    """A stand-in for scripts/bootstrap_uv.py (the real one downloads): same arguments, same output."""
    (repo / "scripts").mkdir(exist_ok=True)
    (repo / "scripts" / "bootstrap_uv.py").write_text(f"import sys\nfrom pathlib import Path\n{body}\n")


def test_with_no_uv_anywhere_the_pinned_one_is_fetched_into_the_rigs_folder(repo, capfd):
    bootstrap(repo, "dest = Path(sys.argv[1]); dest.mkdir(parents=True)\n"
                    "(dest / 'uv').write_text('#!/bin/sh\\n'); (dest / 'uv').chmod(0o755)\n"
                    "print('uv not found: fetching uv 0.0.0 into', dest, file=sys.stderr); print(dest / 'uv')")
    env = env_of(repo)  # no python3 on this PATH either: the bootstrap runs with this interpreter
    got = uv.find(repo, env)
    assert got == str(repo / ".rig" / "uv" / "uv") and Path(got).is_file()
    assert "uv not found: fetching uv 0.0.0" in capfd.readouterr().err
    assert uv.find(repo, env) == got  # fetched once: the next call finds it there


@pytest.mark.parametrize("code,error", [(1, WorkFailed), (2, BadInput)])
def test_a_failed_fetch_says_what_the_bootstrap_said_with_its_exit_code(repo, code, error):
    bootstrap(repo, f"print('error: uv 0.0.0: the index did not answer', file=sys.stderr); raise SystemExit({code})")
    with pytest.raises(error, match="the index did not answer"):
        uv.find(repo, env_of(repo))
