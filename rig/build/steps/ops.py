"""Step 6, ops: the compiled kernels, reused from the official wheel or compiled.

**Precompiled route** (no compiler at all): when the series changes no compiled
input and touches none of the files the official wheel's kernels overwrite
(rig/build/kernels/route.py), vLLM's own ``VLLM_USE_PRECOMPILED=1`` with
``VLLM_PRECOMPILED_WHEEL_LOCATION`` copies the kernels of ``vllm==<version>``
(downloaded once, hash-checked, cached) into the tree.

**Compile route**: otherwise, ``pip install -v`` of the tree (rig/build/kernels/pip.py).

Both install vllm editable into the venv from the patched tree, so a later
Python-only patch needs neither a compile nor a reinstall: the kernels depend
on OPS_OBJ alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rig.base import atomic
from rig.base.console import say
from rig.base.errors import WorkFailed, problem
from rig.base.gitutil import Git
from rig.build import bundle, container, verify
from rig.build.artifacts import Refused
from rig.build.kernels import pip, route, target
from rig.build.kernels.expected import list_path, read_expected, write_list
from rig.build.steps.base import Context, Status, Step
from rig.facts import products, record


class OpsStep(Step):
    name = "ops"
    summary = "the kernels: the official wheel's (precompiled route) or compiled with pip -v"
    needs = ("tree", "toolchain")
    facts = ("route", "ops_obj", "products")

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        facts, way, why = route.facts(s, ctx.record, ctx.series)
        rec = products.read(s.vllm_dir)
        if rec is None:
            return Status(False, f"no build record {s.vllm_dir / products.RECORD} ({why})")
        keys = [k for k in facts if k != "tree"]  # a Python-only patch moves the tree, not the kernels
        diff = [f"{k} {rec.facts.get(k)!r} -> {facts[k]!r}" for k in keys if rec.facts.get(k) != facts[k]]
        if diff:
            return Status(False, "the kernels were built for another input: " + "; ".join(diff))
        bad = products.mismatches(s.vllm_dir, rec, rehash=ctx.options.verify)
        if bad:
            return Status(False, f"{len(bad)} product(s) differ from the record, e.g. {bad[0]}")
        how = "re-hashed" if ctx.options.verify else "size and mtime checked"
        return Status(True, f"{len(rec.files)} products for OPS_OBJ {facts['ops_obj'][:12]} ({way}; {how})",
                      outputs(s.vllm_dir, rec))

    def run(self, ctx: Context) -> record.Ops:
        s = ctx.settings
        facts, way, why = route.facts(s, ctx.record, ctx.series)
        say(f"route: {way} ({why})")
        products.forget(s.vllm_dir)
        if bundle.opened(s):
            return self._from_bundle(ctx)
        if way == "compile":
            if not (ctx.record.tools and ctx.record.tools.cargo):
                say("no cargo 1.95: the Rust frontend is not built; vLLM uses its Python tool parsers")
            _clear_precompiled(s.vllm_dir)
            if ctx.options.force:
                _clear_build_dir(s.vllm_dir)
        how, wheel = route.prepare(s, ctx.series, way, facts)
        log = pip.install(s, ctx.record, how, facts["version"], wheel,
                          "compile" if way == "compile" else "precompiled copy" if wheel else "install")
        facts["log"] = log.name
        rec = products.collect(s.vllm_dir, facts)
        if not rec.files:
            raise WorkFailed(problem(f"the {way} route's products in {s.vllm_dir / 'vllm'}", "the kernels",
                                     "none", f"read the full log {log}, fix what it names, and run ./build.sh "
                                     "again"))
        products.write(s.vllm_dir, rec)
        size = sum(v["size"] for v in rec.files.values()) / 1e6
        say(f"{len(rec.files)} products, {size:.1f} MB, recorded in {s.vllm_dir / products.RECORD}")
        if way == "precompiled" and facts.get("wheel_sha256"):
            _list_precompiled(s.patches_dir, s.device, facts["wheel_sha256"], rec)
        return outputs(s.vllm_dir, rec)

    def _from_bundle(self, ctx: Context) -> record.Ops:
        """OFFLINE: the bundle's kernels, verified against this tree's target and installed, vllm installed
        editable without building anything; the tarball is kept in ARTIFACTS_DIR, so the pack step finds it."""
        s = ctx.settings
        kernels = bundle.opened(s) / bundle.KERNELS
        kt = target.of_build(s, ctx.record)
        n, against = verify.verify(kernels, kt.vllm_dir, kt.checks(), kt.expected, say=say)
        say(f"the offline bundle's kernels: {n} files verified and installed (the file set checked against "
            f"{against})")
        container.adopt(s, kernels)
        for f in sorted(kernels.iterdir()):
            with open(f, "rb") as src, atomic.atomic_open(s.artifacts_dir / f.name, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        rec = products.read(s.vllm_dir)
        assert rec is not None, "adopt wrote the record"
        return outputs(s.vllm_dir, rec)


def outputs(vllm_dir: Path, rec: products.Record) -> record.Ops:
    """The ops step's outputs, from the kernels' own record."""
    f = rec.facts
    return record.Ops(route=f["route"], ops_obj=f["ops_obj"], products=len(rec.files),
                      record=str(vllm_dir / products.RECORD), version=f["version"], arch=f.get("arch", ""),
                      python=f.get("python", ""))


def _list_precompiled(patches_dir: Path, device: str, wheel_sha256: str, rec: products.Record) -> None:
    """Keep the precompiled route's kernels beside the series, so that verify (and the container, which has no
    build of its own) can check a tarball's files against them. Written only when they differ."""
    path = list_path(patches_dir, device)
    files = {n: (f["sha256"], f["size"]) for n, f in rec.files.items()}
    try:
        listed = read_expected(path)
        same = listed.files == files and listed.wheel_sha256 == wheel_sha256
    except Refused:
        same = False
    if not same:
        write_list(path, device, wheel_sha256, files)
        say(f"the precompiled kernels' list: {path} ({len(files)} files; commit it with the series)")


def _clear_precompiled(vllm_dir: Path) -> None:
    """Before a compile, drop binaries a precompiled copy left, so none survives unbuilt under its name."""
    for rel in products.product_paths(vllm_dir):
        if rel in route.PRECOMPILED_EXACT or route.PRECOMPILED_PATTERNS[0].match(rel):
            os.unlink(vllm_dir / rel)


def _clear_build_dir(vllm_dir: Path) -> None:
    """``--force`` compiles every file again (through ccache): drop setup.py's CMake build folder."""
    build = vllm_dir / "build"
    if build.is_dir() and not Git(vllm_dir).out("ls-files", "--", "build"):
        say(f"--force: removing the CMake build folder {build}")
        shutil.rmtree(build)
