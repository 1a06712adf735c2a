"""Step 2, tree: ``vllm/`` = the upstream tag plus ``patches/``, checked.

The tree is built in scratch (rig/build/worktree.py) and only a finished tree whose id
matches series.toml is moved into ``vllm/``. A correct tree is left alone, so a
re-run needs no network and no upstream at all: with the tree record it is a
few git plumbing calls.
"""

from __future__ import annotations

import hashlib
import shutil

from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.base.gitutil import Git
from rig.build import worktree
from rig.build.steps.base import Context, Status, Step
from rig.facts import record, series


def ops_obj(repo: Git, rev: str, paths: tuple[str, ...]) -> str:
    """OPS_OBJ: a hash of the git object ids of the compiled inputs at ``rev``.

    Only ``paths`` count, so a patch that touches nothing compiled leaves it
    unchanged. An absent path counts as absent.
    """
    out = repo.run("ls-tree", "-z", "--full-tree", rev, "--", *paths)[1] if paths else ""
    found = {}
    for entry in out.split("\0"):
        if entry:
            meta, name = entry.split("\t", 1)
            found[name] = meta
    h = hashlib.sha256()
    for p in paths:
        h.update(f"{p}\0{found.get(p.rstrip('/'), 'absent')}\n".encode())
    return h.hexdigest()


def _listed(items: list[str]) -> str:
    return "; ".join(items[:20]) + (f"; and {len(items) - 20} more" if len(items) > 20 else "")


class TreeStep(Step):
    name = "tree"
    summary = "vllm/ = upstream tag + patches/, checked against series.toml"
    facts = ("tree", "ops_obj", "base_ops_obj", "source", "head")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        if ctx.options.accept:
            return Status(False, "--accept records the tree the series builds")
        if s.fetch:
            return Status(False, "FETCH=1 fetches the base again")
        rec = worktree.read_record(s.vllm_dir) if s.vllm_dir.exists() else None
        if rec is None:
            return Status(False, f"{s.vllm_dir} does not exist yet" if not s.vllm_dir.exists()
                          else f"{s.vllm_dir} has no tree record")
        if s.source not in ("auto", rec.source):
            return Status(False, f"VLLM_SOURCE={s.source}, the tree was made from the {rec.source}")
        if rec.series != series.digest(ctx.patches):
            return Status(False, "the series in patches/ changed")
        repo = Git(s.vllm_dir)
        if repo.rev("HEAD") != rec.head or repo.tracked_changes():
            return Status(False, "vllm/ differs from the commit the rig made")
        exp = ctx.series.expected.get(rec.source)
        if exp is None:
            return Status(False, f"series.toml records no expected tree for the {rec.source} vllm/ was made from")
        if exp.tree != rec.tree:
            return Status(False, f"series.toml expects tree {exp.tree}, vllm/ has {rec.tree}")
        return Status(True, f"tree {rec.tree} matches series.toml (verified {exp.verified})",
                      _outputs(ctx, repo, rec))

    def run(self, ctx: Context) -> record.Tree:
        s, sr, files = ctx.settings, ctx.series, ctx.patches
        if not shutil.which("git"):
            raise BadInput(problem("git", "on PATH", "not found", "apt-get install -y git"))
        repo = Git(s.vllm_dir)
        rec = None
        if s.vllm_dir.is_dir() and not any(s.vllm_dir.iterdir()):
            s.vllm_dir.rmdir()  # an empty folder holds nothing to lose
        if s.vllm_dir.exists():
            if not repo.is_repo():
                raise BadInput(problem(f"{s.vllm_dir}", "a git repository made by the rig (or no folder)",
                                       "a folder that is not its own git repository",
                                       f"move it away (mv {s.vllm_dir} {s.vllm_dir}.old) and run again"))
            rec = worktree.read_record(s.vllm_dir)
            edits = worktree.local_edits(repo, rec)
            if edits:
                raise BadInput(problem(
                    f"{s.vllm_dir}", "no local edits, since the series would change the tree",
                    f"{len(edits)} change(s): {_listed(edits)}",
                    "keep them as patches (commit them in vllm/, then scripts/nox.sh -s patches -- new "
                    "SHORT-NAME exports the commits and records the tree), or discard them "
                    + (f"(git -C vllm reset --hard {rec.head})" if rec else "(move vllm/ away)")
                    + "; nothing was touched"))
        built = worktree.build(s, sr, files, repo, rec, ctx.options.accept)
        try:
            if rec is not None and (lost := worktree.in_the_way(repo, built, s.vllm_dir)):
                raise BadInput(problem(
                    f"{s.vllm_dir}", "no untracked file where the series puts a file",
                    f"{len(lost)} untracked file(s) the new tree would overwrite: {_listed(lost)}",
                    f"move them out of {s.vllm_dir} (or commit and export them as a patch); nothing was touched"))
            self._compare(ctx, built)
            new = worktree.TreeRecord(built.source, built.origin, sr.tag, built.base, built.head, built.tree,
                                      series.digest(files))
            final = worktree.land(s.vllm_dir, built, sr.tag)
        finally:
            worktree.drop_scratch(built)
        worktree.write_record(s.vllm_dir, new)
        say(f"{s.vllm_dir} = {sr.tag} ({built.source}) + {len(files)} patch(es): tree {built.tree}")
        return _outputs(ctx, final, new)

    def _compare(self, ctx: Context, built: worktree.Built) -> None:
        """The built tree against series.toml's, or recorded there with ``--accept``."""
        sr = ctx.series
        exp = sr.expected.get(built.source)
        if ctx.options.accept:
            sr.accept(built.source, built.tree)
            say(f"accepted: [expected.{built.source}] tree = {built.tree} (was {exp.tree if exp else 'none'}), "
                "verified today")
        elif exp is None:
            raise BadInput(problem(
                f"{sr.path}", f"an [expected.{built.source}] table", f"none; the series built tree {built.tree}",
                "if that tree is right, record it: ./build.sh --only tree --accept (or nox -s tree -- --accept)"))
        elif exp.tree != built.tree:
            raise BadInput(problem(
                f"the tree of the {built.source} base + the series", f"{exp.tree} (series.toml "
                f"[expected.{built.source}], verified {exp.verified})", f"{built.tree} (base {built.base[:12]} + "
                f"{len(ctx.patches)} patch(es)); {ctx.settings.vllm_dir} was left as it was",
                "if the new series is what you want (you added or changed a patch), accept the built tree: "
                "./build.sh --only tree --accept (or nox -s tree -- --accept)"))


def _outputs(ctx: Context, repo: Git, rec: worktree.TreeRecord) -> record.Tree:
    paths = ctx.series.ops_paths
    return record.Tree(tree=rec.tree, head=rec.head, base=rec.base, source=rec.source,
                       ops_obj=ops_obj(repo, rec.head, paths), base_ops_obj=ops_obj(repo, rec.base, paths))
