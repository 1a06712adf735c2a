"""Step 7, install: vllm in the venv from the patched tree, and the import check.

The ops step installs vllm editable, so the venv runs the tree's Python files
and its kernels. This step checks that install (version, editable, pointing
at this tree) and reinstalls when it is gone or replaced, then checks imports:
with a driver, ``import vllm`` and every compiled extension; without one, the
link layer: each extension's NEEDED libraries resolve in the venv or the
system, except ``libcuda.so.1`` (the driver), and the step names the
extensions that need it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from rig.base import venvs
from rig.base.console import say, warn
from rig.base.errors import BadInput, RigError, WorkFailed, problem
from rig.build.cudastub import driver_loadable
from rig.build.kernels import abi, pip, route
from rig.build.steps.base import Context, Status, Step
from rig.facts import products, record
from rig.facts.config import Settings
from rig.facts.series import Series

DRIVER = "libcuda.so.1"


#: Libraries the kernels load from the system rather than the venv, and the Debian/Ubuntu package of each (vLLM's
#: CPU kernels need libnuma: a minimal system lacks it, and the import then fails with no word of why).
SYSTEM_LIBS = {"libnuma.so.1": "libnuma1", "libgomp.so.1": "libgomp1", "libstdc++.so.6": "libstdc++6"}


def unresolved(s: Settings, rec: products.Record) -> tuple[list[tuple[str, str]], list[str], int]:
    """Each product ELF's NEEDED list against the venv and the system (no driver needed): the (file, library) pairs
    nothing resolves, the files that need the driver, and how many ELF files were read."""
    venv_libs = {p.name for d in (venvs.site_packages(s.venv_dir), *venvs.host_dirs(s.venv_dir))
                 for p in d.rglob("*.so*")}
    system = set(abi.loader_cache())
    missing: list[tuple[str, str]] = []
    drivers = []
    checked = 0
    for rel in sorted(rec.files):
        path = s.vllm_dir / rel
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        checked += 1
        needed, runpaths = abi.dynamic(path)
        for lib in needed:
            if lib == DRIVER:  # the driver: present on the GPU host, a link stub on a build box
                drivers.append(rel)
            elif not (lib in venv_libs or lib in system or any((d / lib).exists() for d in runpaths)):
                missing.append((rel, lib))
    return missing, drivers, checked


def link_problem(missing: list[tuple[str, str]], venv: Path) -> RigError:
    """The error for libraries nothing resolves, each with the files that need it. A library of ``SYSTEM_LIBS`` is
    the box's to provide, as a missing tool is (exit 2, with the package); any other means a broken build (exit 1)."""
    needers: dict[str, list[str]] = {}
    for rel, lib in missing:
        needers.setdefault(lib, []).append(rel)
    found = "; ".join(f"{lib} (needed by {', '.join(rels)}) in neither {venv} nor the system's library path"
                      for lib, rels in needers.items())
    pkgs = sorted({SYSTEM_LIBS[lib] for lib in needers if lib in SYSTEM_LIBS})
    if len(pkgs) == len(needers):
        return BadInput(problem("the link check", "every library the kernels need", found,
                                f"apt-get install -y {' '.join(pkgs)} (the kernels load it from the system), then "
                                "./build.sh"))
    return WorkFailed(problem("the link check", f"every NEEDED library resolves ({DRIVER} aside)", found,
                              "./build.sh --force, or check the toolchain step's toolkit"))


#: The modules each of the engine's processes imports first (the API server, EngineCore, the device's worker).
#: The import check imports them too: a build whose engine cannot import them fails here, not at the first start.
ENGINE_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.v1.engine.core")
WORKER_MODULE = {"cpu": "vllm.v1.worker.cpu_worker", "cuda": "vllm.v1.worker.gpu_worker"}


def engine_modules(device: str) -> list[str]:
    return [*ENGINE_MODULES, WORKER_MODULE[device]]


def bytecode_env(**extra: str) -> dict[str, str]:
    """The import check's environment: Python writes the bytecode of what it imports into the venv and the tree,
    whatever the caller's ``PYTHONDONTWRITEBYTECODE`` or ``PYTHONPYCACHEPREFIX`` says, as pip's install compiles
    it. The engine's three processes then read it: without it each compiles the same modules on every start where
    writing is off or the venv is read-only (an image's, a service's), and on the first start after each build or
    update (the demo on the 2-core box: 44 s to healthy with it, 83 s without)."""
    drop = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


#: The CPU build's import check, one process: vLLM picks its CPU platform and loads the kernels it picks for this
#: CPU (``_C`` with AVX-512 BF16, ``_C_AVX512`` or ``_C_AVX2`` otherwise: each registers the ``_C`` namespace, so
#: loading a second one aborts the process), then the engine's modules (the arguments) import, then the ``vllm``
#: command's own entry point runs ``vllm serve --help=ModelConfig`` (its argument parser, device detection
#: included). It prints the platform, the module's file, the ``_C`` ops it registered and the help's exit status;
#: the help itself goes to stderr.
CPU_CHECK = (
    "import contextlib, importlib, re, sys, torch\n"
    "from vllm.platforms import current_platform as p\n"
    "assert p.is_cpu(), f'vLLM chose the {type(p).__name__} platform, not the CPU'\n"
    "p.import_kernels()\n"
    "ops = sum(n.startswith('_C::') for n in torch._C._dispatch_get_all_op_names())\n"
    "assert ops, 'no _C op is registered after import_kernels()'\n"
    "so = sorted(set(re.findall(r'/vllm/(_C[A-Z0-9_]*\\.\\S+\\.so)', open('/proc/self/maps').read())))\n"
    "for m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', 'serve', '--help=ModelConfig']\n"
    "try:\n    with contextlib.redirect_stdout(sys.stderr):\n        main()\n    code = 0\n"
    "except SystemExit as e:\n    code = e.code if isinstance(e.code, int) else 1\n"
    "print(p.device_type, ','.join(so) or 'none', ops, code)\n"
)


def cpu_import_check(s: Settings, rec: products.Record) -> str:
    """The full import on the CPU: ``vllm._C`` loads its ops, the platform is the CPU, the engine's modules import,
    ``vllm serve --help`` runs (all in one process: torch and vLLM are imported once). The link layer first: a
    system library the kernels need and the box lacks is named, with its package."""
    missing, _, _ = unresolved(s, rec)
    if missing:
        raise link_problem(missing, s.venv_dir)
    py, env = str(venvs.python(s.venv_dir)), bytecode_env(VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", CPU_CHECK, *engine_modules("cpu")], capture_output=True, text=True, env=env,
                       cwd="/")
    if r.returncode != 0:
        raise WorkFailed(problem("the import check on the CPU", "vLLM's CPU platform loads the kernels for this CPU "
                                 "and the engine's modules import",
                                 (r.stderr.strip().splitlines() or ["no output"])[-1],
                                 "./build.sh --force (the CPU kernels may be for another torch)"))
    device, module, ops, code = r.stdout.split()[-4:]
    if code != "0" or "--max-model-len" not in r.stderr:
        raise WorkFailed(problem("`vllm serve --help=ModelConfig`", "exit 0 and a --max-model-len flag",
                                 f"exit {code}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}",
                                 "./build.sh --force"))
    if not _runs_with(s.venv_dir / "bin" / "vllm", venvs.python(s.venv_dir)):
        raise WorkFailed(problem(f"{s.venv_dir / 'bin' / 'vllm'}", f"a script run by {venvs.python(s.venv_dir)} "
                                 "(the engine's command)", "another or none", "./build.sh --force"))
    return (f"import check: the CPU kernels ({module}, picked for this CPU) register {ops} ops, the platform is "
            f"{device}, the engine's modules import, `vllm serve --help=ModelConfig` runs")


#: With a driver: import torch and vllm, then each kernel module and each of the engine's modules on its own, one
#: line for each that fails.
DRIVER_CHECK = (
    "import importlib, sys, torch, vllm\n"
    "for m in sys.argv[1:]:\n"
    "    try:\n        importlib.import_module(m)\n"
    "    except Exception as e:\n        print('FAILED', m, str(e).replace(chr(10), ' '))\n"
    "print('torch', torch.__version__)\n"
)


def host_torch_check(s: Settings, rec: products.Record, sr: Series, stub: str) -> tuple[str, set[str]]:
    """``TORCH=host``: the host's torch is no older than the kernels' oldest tested one and defines every symbol
    each kernel module needs (read from the symbol tables: no driver needed); the line that says so, and the
    modules left out (built on torch's full C++ ABI, which this torch does not carry)."""
    torch = venvs.torch_version(s.venv_dir) or "none"
    abi.check_version(torch, sr.oldest_torch, s.python or "")
    spec = subprocess.run([str(venvs.python(s.venv_dir)), "-c", "import importlib.util as u; "
                           "print(u.find_spec('torch').submodule_search_locations[0])"],
                          capture_output=True, text=True, cwd="/")
    torch_dir = Path(spec.stdout.strip() or "/nonexistent")
    minor = venvs.minor(s.venv_dir) or (0, 0)
    tag = f".cpython-{minor[0]}{minor[1]}-"
    mods = [s.vllm_dir / rel for rel in sorted(rec.files)
            if rel.endswith(".so") and (".cpython-" not in rel or tag in rel)]  # other minors' builds never load
    n, full = abi.check_symbols(mods, [venvs.site_packages(s.venv_dir), *venvs.host_dirs(s.venv_dir)],
                                torch_dir / "lib", torch, Path(stub) if stub else None)
    for module, sym in full.items():
        rel = str(module.relative_to(s.vllm_dir))
        what = "DeepGEMM's FP8 GEMM kernels are" if "deep_gemm" in rel else "its kernels are"
        warn(f"{rel} is built on torch's full C++ ABI (for the lock's torch), and torch {torch} lacks {sym}: it "
             f"cannot load here, so {what} unavailable; the stable-ABI kernels are unaffected")
    line = (f"torch {torch} (TORCH=host, {torch_dir}): no older than {sr.oldest_torch or 'any tested'}; "
            f"{n - len(full)} of {n} kernel modules find every symbol they need in it"
            + (f" ({len(full)} built on the full C++ ABI left out)" if full else ""))
    return line, {str(m.relative_to(s.vllm_dir)) for m in full}


def _runs_with(script: Path, python: Path) -> bool:
    """``script`` exists and runs ``python``: its ``#!`` line names it, or, where the path is too long for one,
    the ``/bin/sh`` lines pip writes instead do. What the engine's command runs."""
    try:
        with open(script, "rb") as fh:
            head = fh.read(1024).decode(errors="replace")
    except OSError:
        return False
    return head.startswith("#!") and str(python) in head


def kernel_modules(files: Iterable[str], leave_out: Iterable[str] = ()) -> list[str]:
    """The importable names of the kernel files, less those of ``leave_out``: a module left out is left out under
    every file that names it (``_C.cpython-312-...so`` and ``_C.cpython-313-...so`` are one ``_C``)."""
    def name(rel: str) -> str:
        return rel[:-3].split(".")[0].replace("/", ".")

    return sorted({name(r) for r in files if r.endswith(".so") and "/" in r} - {name(r) for r in leave_out})


def import_check(s: Settings, rec: products.Record, leave_out: frozenset[str] = frozenset()) -> str:
    """Full imports with a driver (or for the CPU build), else the link layer; the line that says which.
    ``leave_out``: kernel files the host-torch check found unloadable under this torch (and said so)."""
    if s.device == "cpu":
        return cpu_import_check(s, rec)
    if driver_loadable():
        mods = kernel_modules(rec.files, leave_out)
        r = subprocess.run([str(venvs.python(s.venv_dir)), "-c", DRIVER_CHECK, *mods, *engine_modules("cuda")],
                           capture_output=True, text=True, env=bytecode_env(), cwd="/")
        failed = [ln.split(" ", 2) for ln in r.stdout.splitlines() if ln.startswith("FAILED ")]
        if r.returncode != 0 or failed:
            what, why = (failed[0][1], failed[0][2]) if failed else ("import torch, vllm", (
                r.stderr.strip().splitlines() or ["no output"])[-1])
            sym = re.search(r"undefined symbol: (\S+)", why)
            raise WorkFailed(problem(f"the import check: {what}", "it imports with the driver",
                                     f"undefined symbol {sym[1]}" if sym else why,
                                     "./build.sh --force (the kernels may be for another torch or driver)"))
        torch = r.stdout.split("torch ", 1)[-1].strip()
        return (f"import check: vllm, {len(mods)} compiled extension(s) and the engine's modules import with the "
                f"driver under torch {torch}")
    missing, drivers, checked = unresolved(s, rec)
    say(f"link layer: {checked} ELF file(s) checked; {DRIVER} (the driver, not in the venv) is needed by "
        f"{len(drivers)}: {', '.join(Path(d).name for d in drivers) or 'none'}")
    if missing:
        raise link_problem(missing, s.venv_dir)
    return ("import check: no NVIDIA driver here, so only the link layer was checked (every NEEDED library "
            f"resolves, {DRIVER} aside); the full import runs at serve time on the GPU host")


class InstallStep(Step):
    name = "install"
    summary = "vllm installed in the venv from the patched tree, import check, ccache counts"
    needs = ("ops",)
    facts = ("vllm_version",)

    def check(self, ctx: Context) -> Status:
        s = ctx.settings
        version, wrong = venvs.installed_vllm(s.venv_dir, s.vllm_dir)
        rec, ops = ctx.record.install, ctx.record.ops or record.Ops()
        if wrong:
            return Status(False, wrong)
        if version != ops.version:
            return Status(False, f"vllm {version} installed, the tree is {ops.version}")
        if rec is None or rec.ops_obj != ops.ops_obj or rec.route != ops.route:
            return Status(False, "the kernels changed since the last import check")
        if rec.torch != (venvs.torch_version(s.venv_dir) or ""):
            return Status(False, f"torch changed since the last import check ({rec.torch or 'none'} -> "
                                 f"{venvs.torch_version(s.venv_dir)})")
        return Status(True, f"vllm {version} (editable, this tree) in {s.venv_dir}", rec)

    def run(self, ctx: Context) -> record.Install:
        s = ctx.settings
        ops = ctx.record.ops
        rec = products.read(s.vllm_dir)
        if rec is None or ops is None:
            raise WorkFailed(problem(f"the kernels' build record in {s.vllm_dir}", "present (the ops step ran)",
                                     "none", "./build.sh --only ops first"))
        version, wrong = venvs.installed_vllm(s.venv_dir, s.vllm_dir)
        if wrong or version != ops.version:
            say(f"reinstalling: {wrong or f'vllm {version} installed, the tree is {ops.version}'}")
            how, wheel = route.prepare(s, ctx.series, rec.facts["route"], dict(rec.facts))
            pip.install(s, ctx.record, how, ops.version, wheel, "reinstall")
            # the reinstall wrote the kernels again for the same inputs: record them, or ops would redo its work
            rec = products.collect(s.vllm_dir, rec.facts)
            products.write(s.vllm_dir, rec)
            version, wrong = venvs.installed_vllm(s.venv_dir, s.vllm_dir)
            if wrong:
                raise WorkFailed(problem(f"vllm in {s.venv_dir} after the reinstall", f"vllm {ops.version} from "
                                         f"{s.vllm_dir}", wrong, f"remove {s.venv_dir} and run ./build.sh"))
        if (src := ctx.options.bytecode_from) is not None and src != s.venv_dir:
            say(f"bytecode: {venvs.borrow_bytecode(src, s.venv_dir)} module(s) the serving build ({src}) compiled, "
                "linked for the import check to read")
        leave_out: set[str] = set()
        if s.torch == "host" and s.device == "cuda":
            line, leave_out = host_torch_check(s, rec, ctx.series,
                                               ctx.record.toolchain.cuda_stub if ctx.record.toolchain else "")
            say(line)
        say(import_check(s, rec, frozenset(leave_out)))
        counts = pip.ccache_counts((ctx.record.tools.ccache if ctx.record.tools else "") or None)
        if counts:
            say(f"ccache totals: {counts[0]} hit(s), {counts[1]} miss(es)")
        return record.Install(vllm_version=version or "", ops_obj=ops.ops_obj, route=ops.route,
                              torch=venvs.torch_version(s.venv_dir) or "")
