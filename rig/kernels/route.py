"""Which route makes the kernels: the official wheel's (precompiled) or a compile, decided by content.

The precompiled route is right only when the series changes no compiled input
(OPS_OBJ equals the base's) and patches none of the files vLLM's setup.py copies
out of the wheel on that route (a patch there would be silently overwritten).
"""

from __future__ import annotations

import re
from pathlib import Path

from rig import upstream, venvs
from rig.config import Settings
from rig.errors import BadInput, problem
from rig.gitutil import Git
from rig.record import BuildRecord, Tree
from rig.series import Series

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


def overwritten(paths: list[str]) -> list[str]:
    """Those of ``paths`` that the precompiled copy would overwrite."""
    return [p for p in paths if p not in PRECOMPILED_KEEP
            and (p in PRECOMPILED_EXACT or any(rx.match(p) for rx in PRECOMPILED_PATTERNS))]


def changed_ops_paths(repo: Git, base: str, head: str, paths: tuple[str, ...]) -> list[str]:
    """The compiled-input paths whose git object differs between ``base`` and ``head``."""
    out = repo.run("diff", "--name-only", "-z", base, head, "--", *paths)[1]
    return sorted(f for f in out.split("\0") if f)


def choose(s: Settings, tree: Tree, repo: Git, ops_paths: tuple[str, ...]) -> tuple[str, str]:
    """The route and why, from what the series touches."""
    compiled = changed_ops_paths(repo, tree.base, tree.head, ops_paths)
    touched = repo.run("diff", "--name-only", "-z", tree.base, tree.head)[1].split("\0")
    over = overwritten([t for t in touched if t])
    if compiled or tree.ops_obj != tree.base_ops_obj:
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




def facts(s: Settings, rec: BuildRecord, sr: Series) -> tuple[dict, str, str]:
    """What the kernels are made for (the products record compares these), the route, and why.

    The ops step decides with it whether its kernels are current, and the container adopts
    verified kernels under the same facts, so the ops step then finds them current.
    """
    assert rec.tree is not None and rec.toolchain is not None, "the tree and toolchain steps come first"
    route, why = choose(s, rec.tree, Git(s.vllm_dir), sr.ops_paths)
    minor = venvs.minor(s.venv_dir)
    out = {"tree": rec.tree.head, "ops_obj": rec.tree.ops_obj, "route": route, "version": sr.version,
           "torch_cuda": rec.toolchain.torch_cuda, "python": f"{minor[0]}.{minor[1]}" if minor else ""}
    if route == "compile":
        out.update({"arch": s.arch, "nvcc_version": rec.toolchain.nvcc_version})
    return out, route, why


def official_wheel(s: Settings, sr: Series, sha256: str | None = None) -> tuple[Path, str]:
    """The official wheel of the series' version (downloaded once, hash-checked, cached) and its sha256.

    ``sha256``: the one a build record names, else series.toml's ``[upstream].wheel_sha256``.
    """
    pinned, name = (sha256, "the build record's wheel_sha256") if sha256 else (
        sr.data["upstream"].get("wheel_sha256"), "[upstream].wheel_sha256")
    return upstream.fetch_file(s.cache, s.index_url, upstream.wheel_name(sr.version), pinned, name)
