"""Building a tree in scratch: the upstream base plus the series, beside ``vllm/``, then landed.

The series is applied by ``git am`` (no fuzz, no three-way merge) in a scratch
worktree of ``vllm/`` (when it holds the base) or a scratch repository (a fresh
base from git or the sdist); only a finished tree is moved into ``vllm/``. The
tree step and ``nox -s patches`` both build trees this way.

The tree record ``vllm/.git/rig-tree.toml`` says which source, base and series
made the tree in ``vllm/``.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

import tomli_w

from rig.base import atomic
from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.base.gitutil import Git
from rig.build import bundle, upstream
from rig.facts import products, series
from rig.facts.config import Settings

RECORD = "rig-tree.toml"


@dataclass
class TreeRecord:
    """What made the tree in ``vllm/``."""

    source: str  # git | sdist
    origin: str  # the git URL, or the sdist file name and sha256
    tag: str
    base: str  # the base commit
    head: str  # the base plus the series
    tree: str  # HEAD^{tree}
    series: str  # digest of the patch files


def read_record(vllm_dir: Path) -> TreeRecord | None:
    try:
        data = tomllib.loads((vllm_dir / ".git" / RECORD).read_text())
        return TreeRecord(**{k: str(data[k]) for k in TreeRecord.__dataclass_fields__})
    except (FileNotFoundError, NotADirectoryError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return None


def write_record(vllm_dir: Path, rec: TreeRecord) -> None:
    atomic.write_text(vllm_dir / ".git" / RECORD, "# Written by the rig's tree step.\n" + tomli_w.dumps(asdict(rec)))


def local_edits(repo: Git, rec: TreeRecord | None) -> list[str]:
    """Files in ``vllm/`` that differ from what the rig put there."""
    edits = [f"{f} (uncommitted)" for f in repo.tracked_changes()]
    head = repo.rev("HEAD")
    if rec is None:
        return edits + ["(no tree record: vllm/ was not made by the rig)"]
    if head != rec.head:
        if repo.rev(rec.head) is None:
            return edits + [f"(HEAD {head} is not the rig's commit {rec.head})"]
        changed = repo.out("diff", "--name-only", rec.head, "HEAD").splitlines()
        edits += [f"{f} (committed on top of the series)" for f in changed] or [f"(HEAD moved to {head})"]
    return edits


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def in_the_way(repo: Git, built: Built, vllm_dir: Path) -> list[str]:
    """Untracked files in ``vllm/`` that landing ``built`` would overwrite or remove (the kernels aside).

    ``git reset --hard`` replaces an untracked file silently where the new tree has a file (or a
    folder) of that name; such a file is the user's, so it must stop the landing instead.
    """
    untracked = [p for p in repo.run("ls-files", "--others", "-z")[1].split("\0") if p]
    if not untracked:
        return []
    ours = set(products.product_paths_recorded(vllm_dir))
    new = {p for p in built.repo.run("ls-tree", "-r", "--name-only", "-z", built.head)[1].split("\0") if p}
    new_dirs = {d for p in new for d in _parents(p)}
    return [u for u in untracked if u not in ours and
            (u in new or u in new_dirs or any(d in new for d in _parents(u)))]


@dataclass
class Built:
    """A tree built in scratch, not yet moved into ``vllm/``."""

    scratch: Path
    repo: Git
    source: str
    origin: str
    base: str
    head: str
    tree: str
    worktree_of: Git | None  # the vllm/ repository when scratch is a worktree of it


def scratch_path(vllm_dir: Path, pid: int | str | None = None) -> Path:
    """Where a run builds its tree beside ``vllm_dir``, named by its pid (``"*"``: the pattern of every run's),
    so rig/build/leftovers.py can tell a killed run's scratch from a live one's."""
    return vllm_dir.parent / f".{vllm_dir.name}.scratch-{os.getpid() if pid is None else pid}"


def build(s: Settings, sr: series.Series, files: list[Path], repo: Git, rec: TreeRecord | None,
           accept: bool) -> Built:
    """The base plus the series, in scratch; vllm/ is not touched."""
    built = base(s, sr, repo, rec, scratch_path(s.vllm_dir), accept)
    try:
        apply(built.repo, files, s.patches_dir)
        built.head = built.repo.rev("HEAD") or ""
        built.tree = built.repo.rev("HEAD^{tree}") or ""
    except BaseException:
        drop_scratch(built)
        raise
    return built


def base(s: Settings, sr: series.Series, repo: Git, rec: TreeRecord | None, scratch: Path, accept: bool) -> Built:
    """The series' base in ``scratch``: a worktree of vllm/ when it holds that base, else fetched afresh."""
    if reusable(s, sr, rec, accept) and repo.rev(rec.base):
        say(f"base: {rec.tag} from the {rec.source} ({rec.base[:12]}), already in {s.vllm_dir}")
        repo.run("worktree", "add", "--quiet", "--detach", str(scratch), rec.base)
        return Built(scratch, Git(scratch), rec.source, rec.origin, rec.base, "", "", repo)
    return fresh_base(s, sr, scratch, accept)


def reusable(s: Settings, sr: series.Series, rec: TreeRecord | None, accept: bool) -> bool:
    """Whether the base already in vllm/ serves: the series' tag, the same source, and (auto) one series.toml
    has a tree for."""
    if rec is None or s.fetch or rec.tag != sr.tag:
        return False
    if s.source != "auto":
        return s.source == rec.source
    return accept or not sr.expected or rec.source in sr.expected


def auto_source(url: str, sr: series.Series, accept: bool) -> str:
    """VLLM_SOURCE=auto: git when reachable, else the sdist, among the sources series.toml has a tree for."""
    recorded = [src for src in ("git", "sdist") if src in sr.expected]
    if recorded == ["sdist"] and not accept:
        say("source: the PyPI sdist (VLLM_SOURCE=auto; series.toml records an expected tree for the sdist only)")
        return "sdist"
    ok, why = upstream.git_reachable(url, sr.tag)
    if ok:
        say(f"source: git {url} (VLLM_SOURCE=auto; reachable, tag {sr.tag})")
        return "git"
    if recorded == ["git"] and not accept:
        raise BadInput(problem(
            f"VLLM_SOURCE=auto in {sr.path}", "a reachable source with an expected tree",
            f"git {url} unreachable ({why}), and no [expected.sdist] tree",
            "set VLLM_UPSTREAM_URL to a reachable mirror, or record the sdist's tree once: "
            "VLLM_SOURCE=sdist ./build.sh --only tree --accept"))
    say(f"git source {url} unreachable ({why}); falling back to the PyPI sdist")
    return "sdist"


def bundle_base(s: Settings, sr: series.Series, scratch: Path) -> Built:
    """The base from the offline bundle's tree (OFFLINE): its base tag, checked against the commit the bundle
    records; the series is then applied as always, and the tree compared with series.toml."""
    data = bundle.info(s)
    assert data is not None, "called with OFFLINE set"
    got = data["tree"]
    if got["tag"] != sr.tag:
        raise BadInput(problem(f"OFFLINE={s.offline}: the tree's tag", f"{sr.tag} (series.toml)", got["tag"],
                               "write the bundle from a build of this series"))
    repo = upstream.new_repo(scratch)
    try:
        repo.run("fetch", "--quiet", "--no-tags", str(bundle.opened(s) / bundle.TREE),
                 f"+refs/tags/{sr.tag}:refs/tags/{sr.tag}")
        base = repo.rev(f"refs/tags/{sr.tag}^{{commit}}")
        if base != got["base"]:
            raise BadInput(problem(f"OFFLINE={s.offline}: the base commit of {bundle.TREE}", got["base"], str(base),
                                   "copy the bundle again from where it was written"))
        repo.run("checkout", "--quiet", "-B", "rig", base)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    say(f"base: {sr.tag} from the offline bundle ({got['source']}, {base[:12]})")
    return Built(scratch, repo, got["source"], f"offline bundle: {got['origin']}", base, "", "", None)


def fresh_base(s: Settings, sr: series.Series, scratch: Path, accept: bool) -> Built:
    if s.offline:
        return bundle_base(s, sr, scratch)
    url = s.upstream_url or sr.git_url or upstream.DEFAULT_GIT_URL
    source = s.source
    if source == "auto":
        source = auto_source(url, sr, accept)
    elif source == "git":
        ok, why = upstream.git_reachable(url, sr.tag)
        if not ok:
            raise BadInput(problem(f"the git source {url}", f"a repository with tag {sr.tag}", why,
                                   "set VLLM_UPSTREAM_URL to a reachable mirror, or VLLM_SOURCE=sdist"))
    repo = upstream.new_repo(scratch)
    try:
        if source == "git":
            base = upstream.base_from_git(repo, url, sr.tag)
            repo.run("checkout", "--quiet", "-B", "rig", base)
            origin = url
        else:
            sdist, sha = upstream.fetch_file(s.cache, s.index_url, upstream.sdist_name(sr.version),
                                             sr.sdist_sha256, "[upstream].sdist_sha256")
            base = upstream.base_from_sdist(repo, sdist, sr.version, sr.tag, sha)
            origin = f"{sdist.name} sha256:{sha}"
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Built(scratch, repo, source, origin, base, "", "", None)


def apply(repo: Git, files: list[Path], patches_dir: Path) -> None:
    """``git am`` the series with no fuzz; on failure name the patch and its hunks."""
    if not files:
        return
    status, _, err = repo.run("am", "--quiet", "--no-3way", "--keep-non-patch", "--committer-date-is-author-date",
                              *map(str, files), check=False)
    if status == 0:
        return
    applying = repo.git_path("rebase-apply")
    try:
        n = int((applying / "next").read_text().strip())
    except (FileNotFoundError, ValueError):
        n = 0
    bad = files[n - 1] if 1 <= n <= len(files) else None
    details = why_not(repo, bad) if bad else [ln for ln in err.splitlines() if ln.startswith("error:")]
    repo.run("am", "--abort", check=False)
    after = f"after {files[n - 2].name}" if n >= 2 else "on the base"
    raise BadInput(problem(
        f"patch {bad or 'in the series'}", f"to apply {after} with no fuzz",
        "; ".join(details) or err.strip(),
        "rebase the patch onto the series and re-export it with git format-patch; vllm/ was not touched"))


def why_not(repo: Git, patch: Path) -> list[str]:
    """Per-file reasons a patch does not apply, from ``git apply --check -v``."""
    _, out, err = repo.run("apply", "--check", "-v", str(patch), check=False)
    reasons = []
    for line in (out + "\n" + err).splitlines():
        m = re.match(r"^error: patch failed: (.+):(\d+)$", line)
        if m:
            reasons.append(f"{m[1]}: hunk at line {m[2]} does not match")
            continue
        m = re.match(r"^error: (.+?): (does not exist in index|No such file or directory|already exists in "
                     r"(?:index|working directory)|does not match index|wrong type)$", line)
        if m:
            reasons.append(f"{m[1]}: {m[2]}")
    return reasons


def land(vllm_dir: Path, built: Built, tag: str) -> Git:
    """Move a finished tree into ``vllm/``: a rename, or a hard reset of its branch."""
    if built.worktree_of is None and not vllm_dir.exists():
        os.rename(built.scratch, vllm_dir)
        built.scratch = Path()
        return Git(vllm_dir)
    repo = built.worktree_of or Git(vllm_dir)
    if built.worktree_of is None:
        repo.run("fetch", "--quiet", "--no-tags", str(built.scratch),
                 "+HEAD:refs/rig/landing", f"+refs/tags/{tag}:refs/tags/{tag}")
    repo.run("reset", "--quiet", "--hard", built.head)
    repo.run("update-ref", "-d", "refs/rig/landing", check=False)
    return repo


def drop_scratch(built: Built) -> None:
    if built.scratch == Path() or not built.scratch.exists():
        return
    if built.worktree_of is not None:
        built.worktree_of.run("worktree", "remove", "--force", str(built.scratch), check=False)
    shutil.rmtree(built.scratch, ignore_errors=True)
    if built.worktree_of is not None:
        built.worktree_of.run("worktree", "prune", check=False)
