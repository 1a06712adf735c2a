"""Step 8, pack: the kernels of the build as a checked tarball in ``artifacts/`` (rig/artifacts.py).

Skipped with ``--no-pack`` / ``PACK=0``. A second run of the same build does
not pack again; a missing or incomplete ``artifacts/`` is written again from
the compiled kernels, without compiling.
"""

from __future__ import annotations

from rig import artifacts, products, record
from rig.config import Settings
from rig.console import say
from rig.errors import BadInput, problem
from rig.kernels import target
from rig.steps.pipeline import Context, Status, Step

#: The GPU architectures of the official v0.30.0 wheel's kernels (read with cuobjdump --list-elf).
OFFICIAL_ARCHS = "7.5 8.0 8.6 8.9 9.0 10.0 12.0"


def manifest_facts(s: Settings, rec: record.BuildRecord) -> dict:
    """The manifest's fields: the kernel target, with the architectures the kernels hold, the tree and route."""
    ops = rec.ops
    if ops is None or not (s.vllm_dir / products.RECORD).exists():
        raise BadInput(problem(f"the build record {s.vllm_dir / products.RECORD}", "present (the ops step ran)",
                               "none", "run ./build.sh first"))
    built = OFFICIAL_ARCHS if ops.route == "precompiled" else " ".join((ops.arch or s.arch).replace(";", " ").split())
    return {**target.of_build(s, rec).as_dict(), "arch": built, "tree": rec.tree.head if rec.tree else "",
            "route": ops.route}


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
        why = artifacts.current(s.artifacts_dir, {k: facts[k] for k in ("ops_obj", "route", "arch")}, sums,
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
