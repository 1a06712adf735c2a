"""What a killed run of the rig's own leaves behind, found and removed by the next run, saying so.

A ``kill -9`` (or a power cut) skips every ``finally``: the venv step's
``.venv.old-*``, the tree step's scratch worktree (and git's record of it,
still "locked" when ``git worktree add`` itself was killed), a pack's
``.tmp`` files and verify's scratch destination stay on disk, some of them
gigabytes. The next build removes them under the build lock (so no live run
of the rig owns them) and says what it removed. Only names the rig makes are
touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from rig.base.proc import alive
from rig.build import worktree
from rig.facts.config import Settings

VERIFY_DEST = "verify-dest"  # nox -s verify's scratch destination, under RIG_STATE


def _pid_of(name: str) -> int | None:
    """The pid a scratch name ends with (``.vllm.scratch-123``, ``.ops.tar.zst.123.tmp``), if any."""
    for part in reversed(name.replace("-", ".").split(".")):
        if part.isdigit():
            return int(part)
    return None


def _size(p: Path) -> int:
    if p.is_file() or p.is_symlink():
        return p.lstat().st_size
    return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _remove(p: Path, why: str, say: Callable[[str], None]) -> None:
    size = _size(p) / 1e6
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
    say(f"removed {p} ({size:.0f} MB), left by {why}")


def found(s: Settings) -> list[tuple[Path, str]]:
    """Every leftover of a killed run, with what left it; a live run's (its pid in the name) is not one."""
    out: list[tuple[Path, str]] = []
    for p in s.vllm_dir.parent.glob(worktree.scratch_path(s.vllm_dir, "*").name):
        pid = _pid_of(p.name)
        if pid is None or not alive(pid):
            out.append((p, "a tree step that was killed"))
    out += [(p, "a venv step that was killed") for p in s.venv_dir.parent.glob(f"{s.venv_dir.name}.old-*")]
    if s.artifacts_dir.is_dir():
        for p in s.artifacts_dir.glob(".*.tmp"):
            pid = _pid_of(p.name)
            if pid is None or pid == os.getpid() or not alive(pid):
                out.append((p, "a pack that was killed"))
    if (s.state_dir / VERIFY_DEST).exists():
        out.append((s.state_dir / VERIFY_DEST, "a verify that was killed"))
    return out


def clean(s: Settings, say: Callable[[str], None]) -> int:
    """Remove every leftover, and git's records of scratch worktrees that are gone; return how many."""
    items = found(s)
    for p, why in items:
        _remove(p, why, say)
    _prune_worktrees(s.vllm_dir, say)
    return len(items)


def _prune_worktrees(vllm_dir: Path, say: Callable[[str], None]) -> None:
    """git's entries for the rig's scratch worktrees whose folder is gone, locked ones included (a killed
    ``git worktree add`` leaves its entry locked, and ``git worktree prune`` keeps locked entries)."""
    admin = vllm_dir / ".git" / "worktrees"
    if not admin.is_dir():
        return
    for entry in admin.iterdir():
        try:
            where = Path((entry / "gitdir").read_text().strip()).parent
        except OSError:
            where = None
        if where is not None and (where.exists() or ".scratch-" not in where.name):
            continue
        (entry / "locked").unlink(missing_ok=True)
        say(f"removed git's record of the scratch worktree {where or entry.name}, left by a tree step that was "
            "killed")
    subprocess.run(["git", "-C", str(vllm_dir), "worktree", "prune"], capture_output=True)
