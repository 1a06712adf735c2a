"""Series tooling: check the series, try it on another upstream version, export new commits.

Everything happens in a scratch worktree or scratch repository beside ``vllm/``; ``check`` and
``rebase`` never touch ``vllm/`` or ``patches/``. ``new`` writes new patch files into the series
and moves ``vllm/`` only after the rebuilt tree is proven to be the tree you committed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rig.base import atomic
from rig.base.console import say, warn
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.gitutil import Git
from rig.build import worktree
from rig.build.buildlock import BuildLock
from rig.build.kernels import route
from rig.build.steps.base import Context
from rig.facts import config, series

#: A commit message "says why" when its body has at least this many words.
WHY_WORDS = 8
VERSION = re.compile(r"^v?(\d+\.\d+\.\d+(?:\.post\d+|rc\d+)?)$")


@dataclass
class PatchReport:
    name: str
    result: str  # applies | applies with 3-way | conflict | not tried
    files: list[str] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)  # touched compiled inputs ([ops].paths)
    overwritten: list[str] = field(default_factory=list)  # touched files the precompiled kernels overwrite
    why: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def forces_compile(self) -> bool:
        return bool(self.compiled or self.overwritten)

    def line(self) -> str:
        parts = [f"{self.name}: {self.result}"]
        if self.problems:
            parts.append("; ".join(self.problems))
        if self.files:
            parts.append(f"{len(self.files)} file(s): {', '.join(self.files[:6])}"
                         + (" ..." if len(self.files) > 6 else ""))
        if self.forces_compile:
            what = self.compiled + [f"{p} (overwritten by the precompiled kernels)" for p in self.overwritten]
            parts.append("forces a compile: " + ", ".join(what[:4]))
        elif self.files:
            parts.append("Python only: keeps the precompiled kernels")
        parts.append("says why" if self.why else "commit message does not say why (add a body)")
        return " | ".join(parts)


def _touched(repo: Git, patch: Path) -> list[str]:
    status, out, _ = repo.run("apply", "--numstat", str(patch), check=False)
    return [ln.split("\t", 2)[2] for ln in out.splitlines() if ln.count("\t") >= 2] if status == 0 else []


def _says_why(patch: Path) -> bool:
    text = patch.read_text(errors="replace")
    head = text.split("\n---\n", 1)[0]
    body = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    body = re.sub(r"^Subject:.*(\n[ \t].*)*", "", body, flags=re.M)
    return len(re.findall(r"[A-Za-z]{2,}", body)) >= WHY_WORDS


def _in(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _report(repo: Git, patch: Path, sr: series.Series, result: str) -> PatchReport:
    files = _touched(repo, patch) or repo.out("diff", "--name-only", "HEAD~1", "HEAD").splitlines()
    return PatchReport(patch.name, result, files, [f for f in files if _in(f, sr.ops_paths)],
                       route.overwritten(files), _says_why(patch))


def _am(repo: Git, patch: Path, three_way: bool) -> bool:
    args = ["am", "--quiet", "--keep-non-patch", "--committer-date-is-author-date",
            "--3way" if three_way else "--no-3way", str(patch)]
    if repo.run(*args, check=False)[0] == 0:
        return True
    repo.run("am", "--abort", check=False)
    return False


def walk(repo: Git, files: list[Path], sr: series.Series, three_way: bool, keep_going: bool) -> list[PatchReport]:
    """Apply ``files`` one by one in ``repo``; one report each."""
    reports: list[PatchReport] = []
    stopped = False
    for p in files:
        if stopped:
            reports.append(PatchReport(p.name, "not tried", why=_says_why(p)))
            continue
        if _am(repo, p, False):
            reports.append(_report(repo, p, sr, "applies"))
            continue
        why = worktree.why_not(repo, p) or ["git am refused it (see git am's message)"]
        if three_way and _am(repo, p, True):
            r = _report(repo, p, sr, "applies with 3-way")
            r.problems = [f"no clean apply: {'; '.join(why)}"]
            reports.append(r)
            continue
        r = PatchReport(p.name, "conflict", _touched(repo, p) or _files_of(p), why=_says_why(p), problems=why)
        r.compiled = [f for f in r.files if _in(f, sr.ops_paths)]
        r.overwritten = route.overwritten(r.files)
        reports.append(r)
        stopped = not keep_going
    return reports


def _files_of(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), re.M)


def _scratch_base(s: config.Settings, sr: series.Series, where: Path) -> worktree.Built:
    """The base of ``sr`` in a scratch repository: from vllm/ when it holds that base, else fetched."""
    rec = worktree.read_record(s.vllm_dir) if s.vllm_dir.exists() else None
    return worktree.base(s, sr, Git(s.vllm_dir), rec, where, accept=True)  # inspected, not compared


def check(ctx: Context) -> int:
    """``nox -s patches -- check``: one line per patch on the current base; exit 1 if one fails."""
    s, sr, files = ctx.settings, ctx.series, ctx.patches
    scratch = Path(tempfile.mkdtemp(prefix=".rig-check-", dir=s.vllm_dir.parent)) / "wt"
    built = _scratch_base(s, sr, scratch)
    try:
        reports = walk(built.repo, files, sr, three_way=False, keep_going=False)
    finally:
        worktree.drop_scratch(built)
        shutil.rmtree(scratch.parent, ignore_errors=True)
    for r in reports:
        say(r.line())
    bad = [r for r in reports if r.result == "conflict"]
    compile_n = sum(r.forces_compile for r in reports)
    say(f"{len(reports)} patch(es) on {sr.tag} ({built.source}): {len(reports) - len(bad)} apply, "
        f"{compile_n} force a compile, {sum(not r.why for r in reports)} without a why")
    if bad:
        raise WorkFailed(problem(f"patch {bad[0].name}", f"a clean apply on {sr.tag}", f"it does not apply: "
                                 f"{'; '.join(bad[0].problems)}", "rebase it onto the series and re-export it with "
                                 "git format-patch"))
    return 0


def _markdown(reports: list[PatchReport], frm: str, to: str, out: Path | None) -> str:
    lines = [f"# Rebase of the series from {frm} to {to}", "",
             f"{dt.date.today().isoformat()}: {sum(r.result == 'applies' for r in reports)} apply as they are, "
             f"{sum(r.result == 'applies with 3-way' for r in reports)} with a three-way merge, "
             f"{sum(r.result == 'conflict' for r in reports)} conflict, "
             f"{sum(r.result == 'not tried' for r in reports)} not tried.", "",
             "| Patch | Result | Files | Forces a compile | Details |", "| --- | --- | --- | --- | --- |"]
    for r in reports:
        compiled = ", ".join(r.compiled + r.overwritten) or "no"
        lines.append(f"| {r.name} | {r.result} | {', '.join(r.files[:5]) or '-'} | {compiled} | "
                     f"{'; '.join(r.problems).replace('|', '/') or '-'} |")
    lines.append("")
    lines.append(f"The rebased series is in `{out}`." if out else "No rebased series was written: not every patch "
                 "applied.")
    return "\n".join(lines) + "\n"


def rebase(ctx: Context, version: str, keep_going: bool, out: Path | None) -> int:
    """``nox -s patches -- rebase vX.Y.Z``: the series on another upstream version, in scratch."""
    m = VERSION.match(version)
    if not m:
        raise BadInput(problem("rebase VERSION", "an upstream version like v0.31.0", repr(version),
                               "nox -s patches -- rebase v0.31.0"))
    ver = m[1]
    s, sr, files = ctx.settings, ctx.series, ctx.patches
    target = dataclasses.replace(sr, version=ver, tag=f"v{ver}", sdist_sha256=None, expected={})
    out = out or s.root / f"patches-v{ver}"
    if out.exists() and any(out.iterdir()):
        raise BadInput(problem(f"the output folder {out}", "absent or empty (a rebase never overwrites)",
                               "a folder with files", "move it away, or name another with --out DIR"))
    scratch = Path(tempfile.mkdtemp(prefix=".rig-rebase-", dir=s.vllm_dir.parent)) / "repo"
    fresh = dataclasses.replace(s, fetch=True)  # never the base of vllm/: this is another version
    built = worktree.fresh_base(fresh, target, scratch, accept=True)
    try:
        reports = walk(built.repo, files, target, three_way=True, keep_going=keep_going)
        for r in reports:
            say(r.line())
        ok = all(r.result in ("applies", "applies with 3-way") for r in reports)
        written = None
        if ok:
            written = _export(built, files, sr, target, out)
    finally:
        worktree.drop_scratch(built)
        shutil.rmtree(scratch.parent, ignore_errors=True)
    report = (written or s.state_dir) / (f"REBASE-{sr.tag}-to-v{ver}.md")
    atomic.write_text(report, _markdown(reports, sr.tag, f"v{ver}", written))
    say(f"report: {report}")
    if not ok:
        bad = next(r for r in reports if r.result == "conflict")
        raise WorkFailed(problem(f"patch {bad.name}", f"an apply on v{ver} (a three-way merge at most)",
                                 f"it conflicts on v{ver}: {'; '.join(bad.problems)}; files {', '.join(bad.files)}",
                                 f"rebase it by hand in a clone of v{ver}, or --keep-going to see the rest"))
    say(f"the rebased series for v{ver} is in {written} (patches/ untouched); build it with PATCHES_DIR={written}")
    return 0


def _export(built: worktree.Built, files: list[Path], sr: series.Series, target: series.Series, out: Path) -> Path:
    """The rebased commits as patch files with their old names, and a series.toml for the new base."""
    tmp = Path(tempfile.mkdtemp(prefix=".rebased-", dir=out.parent))
    built.repo.run("format-patch", "--quiet", "--zero-commit", "-o", str(tmp), f"{built.base}..HEAD")
    made = sorted(tmp.glob("*.patch"))
    assert len(made) == len(files), (made, files)
    for new, old in zip(made, files, strict=True):
        new.rename(tmp / old.name)
    sdist = built.origin.rsplit("sha256:", 1)[-1] if built.source == "sdist" else None
    atomic.write_text(tmp / "series.toml", sr.rebased(target.version, target.tag, built.source,
                                                      built.repo.rev("HEAD^{tree}"), sdist))
    if out.exists():
        out.rmdir()  # empty: checked before
    tmp.rename(out)
    return out


def _next_number(files: list[Path]) -> int:
    return max((int(p.name[:4]) for p in files), default=0) + 1


def _commits_as_patches(repo: Git, since: str, folder: Path, n: int, name: str) -> list[str]:
    """The commits after ``since`` as patches ``NNNN-name[-i].patch`` in ``folder``, numbered from ``n``, each
    written atomically; refused before any is written when a name is taken."""
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=folder))
    try:
        repo.run("format-patch", "--quiet", "--zero-commit", "-o", str(tmp), f"{since}..HEAD")
        made = sorted(tmp.glob("*.patch"))
        names = [f"{n + i:04d}-{name}.patch" if len(made) == 1 else f"{n + i:04d}-{name}-{i + 1}.patch"
                 for i in range(len(made))]
        for nm in names:
            if (folder / nm).exists():
                raise BadInput(problem(f"{folder / nm}", "a new file", "it exists", "choose another NAME"))
        for p, nm in zip(made, names, strict=True):
            atomic.write_bytes(folder / nm, p.read_bytes())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def new(ctx: Context, name: str) -> int:
    """``nox -s patches -- new NAME``: the commits on top of the series in vllm/, as the next patches."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$", name):
        raise BadInput(problem("new NAME", "a short name of letters, digits, '.', '_', '+', '-'", repr(name),
                               "nox -s patches -- new log-model-names"))
    s = ctx.settings
    with BuildLock(s, "patches new"):
        sr, files = ctx.series, ctx.patches
        rec = worktree.read_record(s.vllm_dir) if s.vllm_dir.exists() else None
        if rec is None:
            raise BadInput(problem(f"{s.vllm_dir}", "a tree the rig built (with its record)", "none",
                                   "./build.sh --only tree first, then commit your change in vllm/"))
        repo = Git(s.vllm_dir)
        if dirty := repo.tracked_changes():
            raise BadInput(problem(f"{s.vllm_dir}", "your change committed (git -C vllm commit -a)",
                                   f"uncommitted: {', '.join(dirty[:5])}", "commit it, then run new again"))
        commits = repo.out("rev-list", "--reverse", f"{rec.head}..HEAD").split()
        if not commits:
            raise BadInput(problem(f"{s.vllm_dir}", "commits on top of the series", "none",
                                   "commit your change in vllm/ with git, then run new again"))
        wanted = repo.rev("HEAD^{tree}")
        names = _commits_as_patches(repo, rec.head, s.patches_dir, _next_number(files), name)
        say(f"exported {len(names)} commit(s): {', '.join(names)}")
        try:
            built = worktree.build(s, sr, series.patch_files(s.patches_dir), repo, rec, accept=True)
        except BaseException:
            for nm in names:
                (s.patches_dir / nm).unlink(missing_ok=True)
            warn("the series with the new patches did not apply; they were removed again, vllm/ is untouched")
            raise
        try:
            if built.tree != wanted:
                for nm in names:
                    (s.patches_dir / nm).unlink(missing_ok=True)
                raise WorkFailed(problem("the tree the series rebuilds with the new patches", f"the tree of vllm/ "
                                         f"HEAD {wanted}", f"{built.tree}; the new patches were removed again and "
                                         "vllm/ is untouched", "look for a commit git format-patch cannot carry "
                                         "(a binary or mode-only change) and make it a text change"))
            old = sr.expected.get(built.source)
            sr.accept(built.source, built.tree)
            new_rec = worktree.TreeRecord(built.source, built.origin, sr.tag, built.base, built.head, built.tree,
                                      series.digest(series.patch_files(s.patches_dir)))
            worktree.land(s.vllm_dir, built, sr.tag)
        finally:
            worktree.drop_scratch(built)
        worktree.write_record(s.vllm_dir, new_rec)
        say(f"series.toml: [expected.{built.source}] tree = {built.tree} (was {old.tree if old else 'none'}), "
            f"verified {dt.date.today().isoformat()}")
    return 0
