"""git, run as a program, isolated from the user's own git configuration.

Only git's own commands are used (plumbing where it can be), through one small runner: a
library wrapper would cost more to import (GitPython: 150 ms, a fifth of a no-op build) than
every git call of a no-op build together.

Commits the rig makes carry a fixed identity (so a box with no ``user.name``
works) and options that could change how a patch applies are pinned.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rig.base.errors import WorkFailed, problem

IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-rig",
    "GIT_AUTHOR_EMAIL": "vllm-rig@localhost",
    "GIT_COMMITTER_NAME": "vllm-rig",
    "GIT_COMMITTER_EMAIL": "vllm-rig@localhost",
}
# Options that would make `git am` fuzzier or change the bytes it writes.
PINNED = (
    "-c", "core.autocrlf=false",
    "-c", "am.threeWay=false",
    "-c", "am.keepcr=false",
    "-c", "commit.gpgSign=false",
    "-c", "tag.gpgSign=false",
    "-c", "core.hooksPath=/dev/null",
    "-c", "advice.detachedHead=false",
    "-c", "init.defaultBranch=rig",
    "-c", "gc.auto=0",
)


class Git:
    """Run git in one repository (or folder) and return its output."""

    def __init__(self, path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        # No optional locks: `git status` must not write index.lock (a full disk, a read-only tree).
        self._env = {**IDENTITY, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", **(extra_env or {})}

    def run(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float | None = None) -> tuple[int, str, str]:
        """Run ``git ARGS``; return (status, stdout, stderr); raise on failure if ``check``."""
        cmd = ["git", *PINNED, *args]
        try:
            r = subprocess.run(cmd, cwd=self.path, capture_output=True, text=True, errors="replace",
                               env={**os.environ, **self._env, **(env or {})}, timeout=timeout)
            status, out, err = r.returncode, r.stdout, r.stderr
        except FileNotFoundError as exc:  # no git, or no such folder
            status, out, err = 127, "", str(exc)
        except subprocess.TimeoutExpired:
            status, out, err = 124, "", f"no answer within {timeout} s"
        if check and status != 0:
            raise WorkFailed(problem(f"git {' '.join(args)} in {self.path}", "exit 0",
                                     f"exit {status}: {err.strip() or 'no message'}",
                                     "see git's message; a network command may pass when run again"))
        return status, out, err

    def out(self, *args: str, **kw) -> str:
        """Run ``git ARGS`` and return its stdout, stripped."""
        return self.run(*args, **kw)[1].strip()

    def rev(self, ref: str) -> str | None:
        """The object id ``ref`` names, or None."""
        status, out, _ = self.run("rev-parse", "--verify", "--quiet", ref, check=False)
        return out.strip() if status == 0 else None

    def is_repo(self) -> bool:
        """Whether ``path`` is the top of a git work tree of its own."""
        if not (self.path / ".git").exists():
            return False
        status, out, _ = self.run("rev-parse", "--show-toplevel", check=False)
        return status == 0 and Path(out.strip()).resolve() == self.path.resolve()

    def tracked_changes(self) -> list[str]:
        """Tracked files that differ from HEAD (untracked build products do not count)."""
        out = self.run("status", "--porcelain=v1", "--untracked-files=no", "-z")[1]
        return [entry[3:] for entry in out.split("\0") if entry]

    def git_path(self, name: str) -> Path:
        """A path inside this work tree's git dir (worktree-aware)."""
        rel = self.out("rev-parse", "--git-path", name)
        return (self.path / rel) if not os.path.isabs(rel) else Path(rel)
