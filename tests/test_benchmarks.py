"""Every benchmark in benchmarks/ runs in CI, in its quick mode, so none can rot unseen.

Each one runs as a user runs it, ``uv run --script benchmarks/NAME.py --quick`` (its own PEP 723 dependencies,
the uv scripts/nox.sh would use), and must exit 0 and print its figures: each a ratio against a baseline
measured in the same run. The ones that need the real build take the fresh copy the real-build tests build
(``--rig``), and the real venv of the steps' tests: CI builds nothing twice. Those runs are marked slow (and
engine where they start the demo engine) and run last (tests/conftest.py), after every test that asserts on
those copies' first builds.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, engine_like

from rig.build.cudastub import driver_loadable
from rig.facts import uv

BENCH = ROOT / "benchmarks"
#: Modules the benchmarks import; not benchmarks themselves.
HELPERS = {"timing.py"}


@dataclass(frozen=True)
class Bench:
    lines: tuple[str, ...]  # a regex per figure line the quick run must print
    needs: str = ""  # "": nothing built; "sdist", "venv": the real sdist, venv; the built fresh copy: "rig" its
    # CUDA build, "cpu" its CPU build, "both" the two
    args: tuple[str, ...] = ()
    timeout: float = 600
    marks: tuple = ()  # beyond slow, which every run that needs something built has


X = r"[\d.]+x"  # a ratio as the benchmarks print it
BENCHMARKS = {
    "logs_reader.py": Bench((rf"^parse \+ render of [\d,]+ lines .*\| ratio {X} wc's time",
                             r"^follow latency, write to printed line, \d+ updates: median \d+ ms"), timeout=180),
    "tree_step.py": Bench((rf"^\(a\) re-run on a correct tree.*\| ratio {X}",
                           rf"^\(b\) apply a series of 3 patches.*\| ratio {X}"), "sdist"),
    "steps_3_5.py": Bench((rf"^steps 3-5 re-run on a current venv.*\| ratio {X}",
                           rf"^driver stub from .*\| ratio {X}"), "venv"),
    "build_rerun.py": Bench((rf"^\(a\) no-op ./build.sh, median of 1: .*\| ratio {X}",
                             rf"^\(b\) Python-only patch: rebuild .*compiler invocations: 0 .*\| ratio {X} the no-op",
                             r"the patch taken out, rebuilt as it was"), "rig", timeout=1200),
    "pack_verify.py": Bench((rf"^pack with zstd: .*\| {X} faster than tar czf, size {X}",
                             rf"^pack with gzip: .*\| {X} faster than tar czf, size {X}",
                             rf"^verify \(inspect.*\| {X} sha256sum's throughput"), "rig"),
    "start_time.py": Bench((rf"^\(a\) ./start.sh to the engine process started.*: {X}; target",
                            rf"^\(b\) one health check against a server .*: {X} \(the engine's own"), "rig"),
    "device_switch.py": Bench((rf"^\(a\) .*./build.sh \(CUDA\) of .*\| ratio {X} the CUDA build",
                               rf"^\(b\) no-op DEVICE=cpu ./build.sh, median of 1: .* \({X}\)  \| no-op ./build.sh "
                               rf"\(CUDA\): .* \({X}\)",
                               r"^\(c\) DEVICE switched back and forth: .*\| steps run: 0 .*: 0 of \d+"), "both",
                              timeout=1200),
    "demo_start.py": Bench((rf"^\(a\) making the demo model: .*\| ratio {X}",
                            rf"^\(b\) no-op ./start.sh --demo --dry-run, median of 1: .*\| ratio {X}",
                            rf"^\(c\) ./start.sh --demo to healthy .*\| ratio {X}",
                            rf"^\(d\) the health check .*median of 3: .*\| ratio {X}",
                            rf"^\(e\) the demo model, bench.sh 32 8 '1 4' .*decode c=4 / c=1: {X}"), "cpu",
                           ("--serve",), 1200, (pytest.mark.engine,)),
    "gpu_figures.py": Bench((rf"^\(a\) start to healthy, warm cache, \d+ pairs: .*: median {X}, pairs .*"
                             r"\(target <= 1.05x\)",
                             rf"^\(b\) ./start.sh warm .*: {X} \(target <= 0.6x\)",
                             rf"^\(c\) decode at concurrency 1: .*: {X}, 95% interval of the median "
                             r"\+/-[\d.]+% over \d+ pairs",
                             rf"^\(e\) the engine \(.*\) holds [\d.]+ MiB of the card \(NVML\); its KV cache "
                             rf".*\({X} of it\)"),
                            "gpu", timeout=1800,
                            marks=(pytest.mark.gpu, pytest.mark.skipif(not driver_loadable(),
                                                                       reason="no NVIDIA driver here"))),
    "ple_offload.py": Bench((rf"^\(a\) card memory of the engine \(NVML\): .*: {X} \(target 1.00x\)",
                             rf"^\(b\) host memory of the engine's processes \(PSS\): .*: {X}",
                             rf"^\(c\) decode at concurrency 4: .*: {X}",
                             rf"^\(d\) greedy completions, tokens identical on and off: 4 of 4 \({X}\)"), "gpu",
                            timeout=2400, marks=(pytest.mark.gpu, pytest.mark.skipif(not driver_loadable(),
                                                                                  reason="no NVIDIA driver here"))),
    "soak.py": Bench((rf"^\| api \| 1 \| 1 \| [\d.]+ s / [\d.]+ s \| {X} \| \d+ \|$",
                      rf"^\| diskfull \| 1 \| 1 \| [\d.]+ s / [\d.]+ s \| {X} \| 0 \|$",
                      r"^soak: 2 fault\(s\), 2 recovered, \d+ requests, 0 problem\(s\)$"), "cpu", timeout=900,
                     marks=(pytest.mark.engine,)),
    "fit.py": Bench((r"^demo: fits \([\d.]+ requests\), vLLM sized  \| tokens [\d,]+ / [\d,]+ [\d.]+x$",
                     r"^fit: 1 case\(s\), 0 missed"), "cpu", timeout=900, marks=(pytest.mark.engine,)),
    "nodes_start.py": Bench((rf"^\(a\) two-node demo to healthy: .* ratio {X}",
                             rf"^\(b\) worker killed -> the head reports it: .* ratio {X}"), "cpu", timeout=1200,
                            marks=(pytest.mark.engine,)),
}


def scripts() -> set[str]:
    return {p.name for p in BENCH.glob("*.py")} - HELPERS


def test_every_benchmark_script_is_run_here():
    """A new benchmark must be added to BENCHMARKS (or, if it is a module the others import, to HELPERS)."""
    assert scripts() == set(BENCHMARKS), ("benchmarks/*.py and the list CI runs differ: "
                                          f"{sorted(scripts() ^ set(BENCHMARKS))}")


def script_block(path: Path) -> dict:
    """The PEP 723 ``# /// script`` block of a benchmark."""
    m = re.search(r"^# /// script\n((?:#.*\n)+?)# ///$", path.read_text(), re.M)
    assert m, f"{path.name}: no '# /// script' block: `uv run` would not know its dependencies"
    return tomllib.loads("".join(line[2:] + "\n" for line in m[1].splitlines()))


def dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def imports_rig(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "rig"
               or isinstance(n, ast.Import) and any(a.name.split(".")[0] == "rig" for a in n.names)
               for n in ast.walk(tree))


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_a_benchmark_that_imports_the_rig_runs_with_the_rigs_dependencies(name):
    """What a rig module needs (tomli_w, psutil, pynvml) is pyproject.toml's list: a script block without one of
    them breaks the first time its import path reaches that module."""
    path = BENCH / name
    if not imports_rig(path) and not any(imports_rig(BENCH / f"{m}.py") for m in local_imports(path)):
        pytest.skip("imports nothing of the rig")
    need = {dist_name(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    have = {dist_name(d) for d in script_block(path).get("dependencies", [])}
    assert need <= have, f"{name}: its script block lacks {sorted(need - have)} (pyproject.toml's dependencies)"


def local_imports(path: Path) -> set[str]:
    """The other benchmark modules ``path`` imports (build_rerun, timing)."""
    here = {p.stem for p in BENCH.glob("*.py")}
    return {n.module for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom) and n.module in here}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_imports_and_has_a_quick_mode(name):
    """--help imports every name the script takes from the rig (a moved one fails here, in seconds)."""
    r = subprocess.run([sys.executable, str(BENCH / name), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--quick" in r.stdout
    if BENCHMARKS[name].needs in ("rig", "cpu", "both"):
        assert "--rig" in r.stdout  # CI hands it the copy it built


def leftover_engines(rig: Path) -> list[str]:
    """Processes of an engine served from ``rig``'s venvs (or named like vLLM's engine core and working in ``rig``
    or this checkout, where the scripts start their bare engines), zombies aside."""
    return [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}"
            for p in engine_like(lambda p, cmd: str(rig / ".venv") in cmd, rig, ROOT)]


@pytest.fixture(scope="session")
def cpu_built(cpu_build) -> tuple[Path, dict[str, str]]:
    """The fresh copy with its CPU build too (conftest's cpu_build: made once, by whichever test needs it first),
    and the environment without DEVICE, as a user's."""
    dest, c, env = cpu_build
    assert c.returncode == 0, (c.stdout + c.stderr)[-3000:]
    return dest, {k: v for k, v in env.items() if k != "DEVICE"}


def run_alone(cmd: list[str], env: dict[str, str] | None, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in its own session; past ``timeout`` the whole session is killed (uv's child, the script, and what
    the script started), and the test fails with what it printed."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)}: still running after {timeout:.0f} s (killed):\n{out[-4000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def quick_params():
    for name, b in sorted(BENCHMARKS.items()):
        marks = [pytest.mark.slow, *b.marks] if b.needs and b.needs != "gpu" else list(b.marks)
        yield pytest.param(name, marks=marks, id=name.removesuffix(".py"))


@pytest.mark.parametrize("name", list(quick_params()))
def test_the_benchmark_runs_in_quick_mode_and_prints_its_ratios(name, request):
    b = BENCHMARKS[name]
    args, env, rig = ["--quick", *b.args], None, None
    if b.needs == "venv":
        r, env, _ = request.getfixturevalue("real_venv")
        assert r.code == 0, r.text[-3000:]
        args += ["--venv-dir", env["VENV_DIR"], "--state", env["RIG_STATE"]]
    elif b.needs in ("rig", "cpu", "both"):
        if b.needs == "both":
            request.getfixturevalue("fresh")
        if b.needs in ("cpu", "both"):
            rig, env = request.getfixturevalue("cpu_built")
        else:
            rig, r, env = request.getfixturevalue("fresh")
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        args += ["--rig", str(rig)]
    cmd = [uv.find(ROOT), "run", "--script", str(BENCH / name), *args]
    t0 = time.monotonic()
    try:
        p = run_alone(cmd, env, b.timeout)
    finally:
        left = leftover_engines(rig) if rig is not None else []
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = leftover_engines(rig)
    took = time.monotonic() - t0
    # an engine it started (start_time, demo_start, nodes_start) is stopped, by the script, before it exits
    assert not left, f"{name} left engine processes behind: {left}"
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    for pattern in b.lines:
        assert re.search(pattern, p.stdout, re.M), f"{name}: no line matching {pattern!r} in:\n{p.stdout}"
    print(f"\n{name} --quick ({took:.0f} s):\n{p.stdout}")


def test_the_gpu_decode_figure_reads_its_precision_from_the_order_statistics():
    """gpu_figures adds pairs of rounds until the median's 95% interval is within 2%: the interval is the one a
    binomial count gives (n = 20: the 6th and 15th values), the whole range below six values, and a run of tight
    ratios resolves 2% where a scattered one does not."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_figures as g
    finally:
        sys.path.remove(str(BENCH))
    twenty = [1 + i / 100 for i in range(20)]
    assert g.median_interval(list(reversed(twenty))) == (twenty[5], twenty[14])
    assert g.median_interval([1.0, 1.3, 0.9, 1.1, 1.2]) == (0.9, 1.3)
    assert g.median_interval([1.0] * 7 + [2.0]) == (1.0, 2.0)  # n = 8: only the extremes make 95%
    tight = [1.0 + (i % 5 - 2) / 1000 for i in range(12)]
    assert g.resolved(tight) <= 0.02 < g.resolved([0.9, 1.1] * 6)
