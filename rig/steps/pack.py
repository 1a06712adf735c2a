"""Step 8, pack: the kernels of the build as a checked tarball in ``artifacts/`` (rig/artifacts.py).

Skipped with ``--no-pack`` / ``PACK=0``. A second run of the same build does
not pack again; a missing or incomplete ``artifacts/`` is written again from
the compiled kernels, without compiling.
"""

from __future__ import annotations

from rig import artifacts, products
from rig.config import Settings
from rig.console import say
from rig.errors import BadInput, problem
from rig.steps.pipeline import Context, Status, Step
from rig.steps.runtime import installed

#: The GPU architectures of the official v0.30.0 wheel's kernels (read with cuobjdump --list-elf).
OFFICIAL_ARCHS = "7.5 8.0 8.6 8.9 9.0 10.0 12.0"


def target_facts(s: Settings, ctx: Context) -> dict:
    """What this build's kernels are for: the manifest's fields, and what verify checks."""
    # The ops step's outputs carry the build record's facts: no second parse of the record here.
    tree, ops, tc = ctx.outputs_of("tree"), ctx.outputs_of("ops"), ctx.outputs_of("toolchain")
    if not ops or not (s.vllm_dir / products.RECORD).exists():
        raise BadInput(problem(f"the build record {s.vllm_dir / products.RECORD}", "present (the ops step ran)",
                               "none", "run ./build.sh first"))
    route = ops["route"]
    return {
        "ops_obj": ops["ops_obj"], "tree": tree.get("head", ""), "route": route,
        "arch": OFFICIAL_ARCHS if route == "precompiled" else " ".join((ops.get("arch") or s.arch).split(";")),
        "python": ops.get("python", "3.13"), "cuda": str(tc.get("torch_cuda", "")).split(".")[0],
        "torch": installed(s).get("torch", ""),
    }


class PackStep(Step):
    name = "pack"
    summary = "artifacts/: the kernels as a tarball, a per-file sha256 list, a manifest"
    needs = ("ops",)
    facts = ("tarball", "files")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        if not ctx.options.pack:
            return Status(True, "skipped (--no-pack or PACK=0)", {})
        facts = target_facts(s, ctx)
        sums = (s.vllm_dir / products.SUMS).read_text()
        why = artifacts.current(s.artifacts_dir, {k: facts[k] for k in ("ops_obj", "route", "arch")}, sums,
                                rehash=ctx.options.verify)
        if why:
            return Status(False, f"{s.artifacts_dir}: {why}")
        m = artifacts.read_manifest(s.artifacts_dir / artifacts.MANIFEST)
        return Status(True, f"{s.artifacts_dir} holds these kernels ({m['files']} files)", self._outputs(s, m))

    def run(self, ctx: Context) -> dict:
        s = ctx.settings
        facts = target_facts(s, ctx)
        say(f"packing the kernels for OPS_OBJ {facts['ops_obj'][:12]} into {s.artifacts_dir} (no compile)")
        m = artifacts.pack(s.vllm_dir, s.artifacts_dir, facts)
        return self._outputs(s, m)

    def _outputs(self, s: Settings, m: dict) -> dict:
        return {"tarball": str(s.artifacts_dir / m["tarball"]), "files": m["files"], "bytes": m["bytes"],
                "ops_obj": m["ops_obj"]}
