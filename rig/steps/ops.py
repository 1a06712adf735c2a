"""Step 6, ops: the compiled kernels, reused from the official wheel or compiled.

**Precompiled route** (no compiler at all): when the series changes no compiled
input (OPS_OBJ equals the base's) and touches none of the files the official
wheel's kernels overwrite, vLLM's own ``VLLM_USE_PRECOMPILED=1`` with
``VLLM_PRECOMPILED_WHEEL_LOCATION`` copies the kernels of ``vllm==<version>``
(downloaded once, hash-checked, cached) into the tree.

**Compile route**: otherwise, ``pip install -v`` of the tree with ``MAX_JOBS``,
``TORCH_CUDA_ARCH_LIST=ARCH``, ``NVCC_THREADS`` and ccache as the compiler
launcher. Every compiler line is shown, the whole output goes to
``build-<timestamp>.log``, and a status line appears every ``STATUS_INTERVAL``.

Both install vllm editable into the venv from the patched tree, so a later
Python-only patch needs neither a compile nor a reinstall: the kernels depend
on OPS_OBJ alone.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
from pathlib import Path

from rig import proc, products, series, upstream
from rig.config import Settings
from rig.console import say
from rig.errors import BadInput, WorkFailed, problem
from rig.gitutil import Git
from rig.steps.pipeline import Context, Status, Step
from rig.steps.venv import venv_python

# The files vLLM 0.30.0's setup.py copies out of the official wheel on the
# precompiled route (setup.py, extract_precompiled_and_patch_package). A patch
# to any of them would be silently overwritten, so it forces the compile route.
PRECOMPILED_EXACT = frozenset({
    "vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_qutlass_C.abi3.so", "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_flashkda_C.abi3.so", "vllm/_sparse_flashmla_C.abi3.so", "vllm/_deepselect_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/cumem_allocator.abi3.so", "vllm/spinloop.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/_rocm_C.abi3.so",
    "vllm/vllm-rs",
})
PRECOMPILED_PATTERNS = tuple(re.compile(p) for p in (
    r"vllm/_rust_[^/]*\.so$",
    r"vllm/vllm_flash_attn/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py$",
    r"vllm/third_party/triton_kernels/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py$",
    r"vllm/third_party/flashmla/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py$",
    r"vllm/third_party/deep_gemm/.*",
    r"vllm/third_party/fmha_sm100/.*",
    r"vllm/third_party/tml_fa4/.*",
))
PRECOMPILED_KEEP = frozenset({"vllm/vllm_flash_attn/__init__.py", "vllm/vllm_flash_attn/flash_attn_interface.py"})
# Lines of a compile that name the source file being compiled.
COMPILING = re.compile(r"(?:Building (?:CXX|C|CUDA) object \S+?|\s-c\s+)(\S+\.(?:cu|cpp|cc|c|cxx))(?:\.o)?\b")
ERROR_LINE = re.compile(r"(?:\berror\b[:\s]|: fatal error|CMake Error)", re.I)


def overwritten(paths: list[str]) -> list[str]:
    """Those of ``paths`` that the precompiled copy would overwrite."""
    return [p for p in paths if p not in PRECOMPILED_KEEP
            and (p in PRECOMPILED_EXACT or any(rx.match(p) for rx in PRECOMPILED_PATTERNS))]


def changed_ops_paths(repo: Git, base: str, head: str, paths: tuple[str, ...]) -> list[str]:
    """The compiled-input paths whose git object differs between ``base`` and ``head``."""
    out = repo.run("diff", "--name-only", "-z", base, head, "--", *paths)[1]
    return sorted(f for f in out.split("\0") if f)


def choose_route(s: Settings, tree: dict, repo: Git, ops_paths: tuple[str, ...]) -> tuple[str, str]:
    """The route and why, from what the series touches."""
    compiled = changed_ops_paths(repo, tree["base"], tree["head"], ops_paths)
    touched = repo.run("diff", "--name-only", "-z", tree["base"], tree["head"])[1].split("\0")
    over = overwritten([t for t in touched if t])
    if compiled or tree["ops_obj"] != tree["base_ops_obj"]:
        why = f"the series changes compiled inputs ({', '.join(compiled[:5]) or 'OPS_OBJ differs'})"
        if s.ops_route == "precompiled":
            raise BadInput(problem("OPS_ROUTE=precompiled", "a series that changes no compiled input", why,
                                   "unset OPS_ROUTE (the compile route is taken), or drop the patch"))
        return "compile", why
    if over:
        why = f"the series patches files the precompiled kernels overwrite ({', '.join(over[:5])})"
        if s.ops_route == "precompiled":
            raise BadInput(problem("OPS_ROUTE=precompiled", "a series that patches no precompiled file", why,
                                   "unset OPS_ROUTE (the compile route is taken), or drop the patch"))
        return "compile", why
    if s.ops_route == "compile":
        return "compile", "OPS_ROUTE=compile"
    return "precompiled", "the series changes no compiled input: the official wheel's kernels fit"


def build_env(s: Settings, ctx: Context, route: str, version: str, wheel: Path | None) -> dict[str, str]:
    """The environment of the pip run: version pinned, route switches, compile controls."""
    tools = ctx.outputs_of("tools")
    tc = ctx.outputs_of("toolchain")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_USE_PRECOMPILED", "VLLM_PRECOMPILED_", "PIP_CONSTRAINT"))}
    path = [str(s.venv_dir / "bin")]
    for key in ("cmake", "ninja", "ccache"):
        if tools.get(key):
            path.append(str(Path(tools[key]).parent))
    env.update({
        "PATH": os.pathsep.join(dict.fromkeys(path + env.get("PATH", "").split(os.pathsep))),
        "VIRTUAL_ENV": str(s.venv_dir),
        # setuptools-scm would invent 0.1.devN for a tree whose git tag it cannot use.
        "VLLM_VERSION_OVERRIDE": version, "SETUPTOOLS_SCM_PRETEND_VERSION": version,
        "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    if route == "precompiled":
        env.update({"VLLM_USE_PRECOMPILED": "1", "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel)})
        return env
    env.update({
        "MAX_JOBS": str(s.max_jobs), "NVCC_THREADS": str(s.nvcc_threads), "TORCH_CUDA_ARCH_LIST": s.arch,
        "VLLM_DISABLE_SCCACHE": "1",  # setup.py prefers sccache; the rig's launcher is ccache
    })
    if tc.get("cuda_home"):
        env["CUDA_HOME"] = tc["cuda_home"]
    if tc.get("cuda_stub"):
        stub = Path(tc["cuda_stub"]).with_name("libcuda.so")
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} -DCUDA_cuda_driver_LIBRARY={stub}".strip()
    if s.ccache_dir:
        env["CCACHE_DIR"] = s.ccache_dir
    return env


def ccache_counts(ccache: str | None) -> tuple[int, int] | None:
    """(hits, misses) from ccache's statistics, or None without ccache."""
    if not ccache:
        return None
    r = subprocess.run([ccache, "--print-stats"], capture_output=True, text=True)
    stats = dict(line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line)
    num = lambda k: int(stats.get(k, "0") or 0)  # noqa: E731
    return num("direct_cache_hit") + num("preprocessed_cache_hit"), num("cache_miss")


def log_path(s: Settings) -> Path:
    s.build_log_dir.mkdir(parents=True, exist_ok=True)
    return s.build_log_dir / f"build-{dt.datetime.now():%Y%m%d-%H%M%S}.log"


def pip_install(s: Settings, ctx: Context, route: str, version: str, wheel: Path | None, what: str) -> Path:
    """``pip install -v -e`` of the tree for ``route``; the log path. Exit 1 with the first error on failure."""
    env = build_env(s, ctx, route, version, wheel)
    cmd = [str(venv_python(s)), "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
           "--no-cache-dir", "-e", str(s.vllm_dir)]
    ccache = ctx.outputs_of("tools").get("ccache") or None
    before = ccache_counts(ccache)
    log = log_path(s)
    say(f"{what}: {' '.join(cmd[2:])}")
    say(f"full output: {log}")
    if route == "compile":
        say(f"MAX_JOBS={env['MAX_JOBS']} NVCC_THREADS={env['NVCC_THREADS']} TORCH_CUDA_ARCH_LIST={s.arch} "
            f"ccache={'on' if ccache else 'off'}")

    def status(elapsed: float, tail: list[str]) -> str:
        last = next((m[1] for line in reversed(tail) if (m := COMPILING.search(line))), "none yet")
        last = last.removeprefix(f"{s.vllm_dir}/")
        counts = ccache_counts(ccache)
        cc = (f", ccache {counts[0] - before[0]} hit(s) / {counts[1] - before[1]} miss(es) so far"
              if counts and before else "")
        return f"[{what}] {int(elapsed) // 60}m{int(elapsed) % 60:02d}s, last compiled: {last}{cc}"

    with open(log, "w") as fh:
        fh.write(f"# {' '.join(cmd)}\n# route: {route}\n")
        code, tail = proc.watch(cmd, status=status, interval=s.status_interval, env=env, log=fh, cwd=s.vllm_dir)
    if code != 0:
        text = log.read_text(errors="replace").splitlines()
        first = next((ln.strip() for ln in text if ERROR_LINE.search(ln) and not ln.startswith("#")), tail[-1:])
        raise WorkFailed(f"{what} failed (exit {code}). First error: {first}. Full log: {log}. "
                         "Fix the error (a patch under csrc/ breaks the compile?) and run ./build.sh again")
    # setup.py rewrites the tracked vllm/_version.py (commit id); keep the tree as the series made it.
    repo = Git(s.vllm_dir)
    if "vllm/_version.py" in repo.tracked_changes():
        repo.run("checkout", "--", "vllm/_version.py")
    after = ccache_counts(ccache)
    if after and before:
        say(f"ccache: {after[0] - before[0]} hit(s), {after[1] - before[1]} miss(es) in this run")
    return log


class OpsStep(Step):
    name = "ops"
    summary = "the kernels: the official wheel's (precompiled route) or compiled with pip -v"
    needs = ("tree", "toolchain")
    facts = ("route", "ops_obj", "products")

    def _facts(self, ctx: Context) -> tuple[dict, str, str]:
        s = ctx.settings
        tree = ctx.outputs_of("tree")
        sr = series.load(s.patches_dir)
        route, why = choose_route(s, tree, Git(s.vllm_dir), sr.ops_paths)
        tc = ctx.outputs_of("toolchain")
        facts = {"tree": tree["head"], "ops_obj": tree["ops_obj"], "route": route, "version": sr.version,
                 "torch_cuda": tc.get("torch_cuda", ""), "python": "3.13"}
        if route == "compile":
            facts.update({"arch": s.arch, "nvcc_version": tc.get("nvcc_version", "")})
        return facts, route, why

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        facts, route, why = self._facts(ctx)
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
        return Status(True, f"{len(rec.files)} products for OPS_OBJ {facts['ops_obj'][:12]} ({route}; {how})",
                      self._outputs(s, rec))

    def run(self, ctx: Context) -> dict:
        s = ctx.settings
        facts, route, why = self._facts(ctx)
        say(f"route: {route} ({why})")
        products.forget(s.vllm_dir)
        wheel = None
        if route == "precompiled":
            sr = series.load(s.patches_dir)
            wheel, sha = upstream.fetch_file(s.cache, s.index_url, upstream.wheel_name(sr.version),
                                             sr.data["upstream"].get("wheel_sha256"), "[upstream].wheel_sha256")
            facts["wheel_sha256"] = sha
        else:
            if not ctx.outputs_of("tools").get("cargo"):
                say("no cargo 1.95: the Rust frontend is not built; vLLM uses its Python tool parsers")
            _clear_precompiled(s.vllm_dir)
            if ctx.options.force:
                _clear_build_dir(s.vllm_dir)
        log = pip_install(s, ctx, route, facts["version"], wheel, "precompiled copy" if route == "precompiled"
                          else "compile")
        facts["log"] = log.name
        rec = products.collect(s.vllm_dir, facts)
        if not rec.files:
            raise WorkFailed(f"the {route} route left no products in {s.vllm_dir / 'vllm'}. Full log: {log}")
        products.write(s.vllm_dir, rec)
        size = sum(v["size"] for v in rec.files.values()) / 1e6
        say(f"{len(rec.files)} products, {size:.1f} MB, recorded in {s.vllm_dir / products.RECORD}")
        return self._outputs(s, rec)

    def _outputs(self, s: Settings, rec: products.Record) -> dict:
        return {"route": rec.facts["route"], "ops_obj": rec.facts["ops_obj"], "products": len(rec.files),
                "record": str(s.vllm_dir / products.RECORD), "version": rec.facts["version"],
                "arch": rec.facts.get("arch", ""), "python": rec.facts.get("python", "3.13")}


def _clear_precompiled(vllm_dir: Path) -> None:
    """Before a compile, drop binaries a precompiled copy left, so none survives unbuilt under its name."""
    for rel in products.product_paths(vllm_dir):
        if rel in PRECOMPILED_EXACT or PRECOMPILED_PATTERNS[0].match(rel):
            os.unlink(vllm_dir / rel)


def _clear_build_dir(vllm_dir: Path) -> None:
    """``--force`` compiles every file again (through ccache): drop setup.py's CMake build folder."""
    build = vllm_dir / "build"
    if build.is_dir() and not Git(vllm_dir).out("ls-files", "--", "build"):
        say(f"--force: removing the CMake build folder {build}")
        shutil.rmtree(build)
