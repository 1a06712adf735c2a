"""Step 8, pack: the kernels of the build as a checked tarball in ``artifacts/`` (rig/build/artifacts.py).

Skipped with ``--no-pack`` / ``PACK=0``. A second run of the same build does
not pack again; a missing or incomplete ``artifacts/`` is written again from
the compiled kernels, without compiling.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.build import artifacts, leftovers, verify
from rig.build.buildlock import BuildLock
from rig.build.kernels import target
from rig.build.steps.base import Context, Status, Step
from rig.facts import products, record
from rig.facts.config import Settings

#: The GPU architectures of the official v0.30.0 wheel's kernels (read with cuobjdump --list-elf).
OFFICIAL_ARCHS = "7.5 8.0 8.6 8.9 9.0 10.0 12.0"


def manifest_facts(s: Settings, rec: record.BuildRecord) -> dict:
    """The manifest's fields: the kernel target, with the architectures the kernels hold, the tree and route."""
    ops = rec.ops
    if ops is None or not (s.vllm_dir / products.RECORD).exists():
        raise BadInput(problem(f"the build record {s.vllm_dir / products.RECORD}", "present (the ops step ran)",
                               "none", "run ./build.sh first"))
    facts = target.of_build(s, rec).facts()
    if s.device == "cpu":  # the machine the CPU kernels are for, as the target names it; no GPU architectures
        built = facts["arch"]
    elif ops.route == "precompiled":
        built = OFFICIAL_ARCHS
    else:
        built = " ".join((ops.arch or s.arch).replace(";", " ").split())
    kernels = products.read(s.vllm_dir)
    return {**facts, "arch": built, "tree": rec.tree.head if rec.tree else "", "route": ops.route,
            "python": products.pythons(kernels.files if kernels else {})}


class PackStep(Step):
    name = "pack"
    summary = "artifacts/: the kernels as a tarball, a per-file sha256 list, a manifest"
    needs = ("ops",)
    facts = ("tarball", "files")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        if not ctx.options.pack:
            return Status(True, "skipped (--no-pack or PACK=0)")
        facts = manifest_facts(s, ctx.record)
        sums = (s.vllm_dir / products.SUMS).read_text()
        done = ctx.record.pack
        # every fact the manifest records, not the kernels' key alone: a build again with another torch (TORCH=host
        # after the lock's) keeps its kernels' files, and a pack naming the old torch would refuse an offline bundle
        why = artifacts.current(s.artifacts_dir, facts, sums,
                                rehash=ctx.options.verify,
                                packed=(done.sha256, done.size, done.mtime_ns) if done and done.sha256 else None)
        if why:
            return Status(False, f"{s.artifacts_dir}: {why}")
        m = artifacts.read_manifest(s.artifacts_dir / artifacts.MANIFEST)
        return Status(True, f"{s.artifacts_dir} holds these kernels ({m['files']} files)", _outputs(s, m))

    def run(self, ctx: Context) -> record.Pack:
        s = ctx.settings
        facts = manifest_facts(s, ctx.record)
        say(f"packing the kernels for OPS_OBJ {facts['ops_obj'][:12]} into {s.artifacts_dir} (no compile)")
        return _outputs(s, artifacts.pack(s.vllm_dir, s.artifacts_dir, facts))


def _outputs(s: Settings, m: dict) -> record.Pack:
    tar = s.artifacts_dir / m["tarball"]
    st = tar.stat()
    return record.Pack(tarball=str(tar), files=m["files"], bytes=m["bytes"], ops_obj=m["ops_obj"],
                       sha256=m["tarball_sha256"], size=st.st_size, mtime_ns=st.st_mtime_ns)


def check_artifacts(s: Settings, src: Path | None, dest: Path | None) -> int:
    """``nox -s verify``: a kernels folder (default ``ARTIFACTS_DIR``) against this build's target, item by item,
    installed into ``dest`` (default: a scratch folder, removed after).

    Under the build lock, since a build may be rewriting artifacts/ or the tree's kernels; the scratch destination
    is the rig's own, so a verify that is killed leaves nothing the next one does not remove."""
    kt = target.of_build(s, record.load(s.record_dir, s.device))
    src = src or s.artifacts_dir
    with BuildLock(s, "verify"):
        leftovers.clean(s, say)
        scratch = s.state_dir / leftovers.VERIFY_DEST
        try:
            n, against = verify.verify(src, dest or scratch, kt.checks(), kt.expected, say=say)
        finally:
            if not dest:
                shutil.rmtree(scratch, ignore_errors=True)
    shown = ", ".join(f"{k} {v}" for k, v in kt.checks().items() if v)
    say(f"verify: {src} fits this target ({shown}); {n} files, the set checked against {against}")
    return 0
