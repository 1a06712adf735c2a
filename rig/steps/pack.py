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
from rig.hashing import sha256_file
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
        why = artifacts.current(s.artifacts_dir, {k: facts[k] for k in ("ops_obj", "route", "arch")}, sums,
                                rehash=ctx.options.verify)
        if why:
            return Status(False, f"{s.artifacts_dir}: {why}")
        m = artifacts.read_manifest(s.artifacts_dir / artifacts.MANIFEST)
        if why := _swapped(s, m, ctx.record.pack):
            return Status(False, why)
        return Status(True, f"{s.artifacts_dir} holds these kernels ({m['files']} files)", _outputs(s, m))

    def run(self, ctx: Context) -> record.Pack:
        s = ctx.settings
        facts = manifest_facts(s, ctx.record)
        say(f"packing the kernels for OPS_OBJ {facts['ops_obj'][:12]} into {s.artifacts_dir} (no compile)")
        return _outputs(s, artifacts.pack(s.vllm_dir, s.artifacts_dir, facts))


def _swapped(s: Settings, m: dict, packed: record.Pack | None) -> str:
    """Why the tarball is not the one this build packed ('' when it is). Its size and mtime are compared with
    the record, and its sha256 whenever they differ (or no pack of this build is recorded): a tarball swapped
    for another valid one is packed again, not trusted."""
    tar = s.artifacts_dir / m["tarball"]
    st = tar.stat()
    if packed and packed.sha256 and m["tarball_sha256"] != packed.sha256:
        return f"{artifacts.MANIFEST} names tarball sha256 {m['tarball_sha256'][:12]}, this build packed " \
               f"{packed.sha256[:12]}"
    if packed and packed.sha256 and (st.st_size, st.st_mtime_ns) == (packed.size, packed.mtime_ns):
        return ""
    found = sha256_file(tar)
    if found != m["tarball_sha256"]:
        return f"{tar.name} does not match the manifest's sha256 (found {found[:12]}, expected " \
               f"{m['tarball_sha256'][:12]})"
    return ""


def _outputs(s: Settings, m: dict) -> record.Pack:
    tar = s.artifacts_dir / m["tarball"]
    st = tar.stat()
    return record.Pack(tarball=str(tar), files=m["files"], bytes=m["bytes"], ops_obj=m["ops_obj"],
                       sha256=m["tarball_sha256"], size=st.st_size, mtime_ns=st.st_mtime_ns)
