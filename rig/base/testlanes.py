"""Run as a script on purpose (``python -m rig.base.testlanes``, by ``nox -s tests``): the suite in two lanes at once.

Nearly all of the suite's time is engine starts and builds, and each is mostly one core of Python at a time; the
boxes it runs on have two. So with no arguments the suite runs as two pytest processes side by side: the lane
``serve`` (the test files of :data:`SERVE`) and the lane ``main`` (every other file, so a new one lands there).
Each lane has its own temporary folder, so its own fresh copy of the rig and its own engines; tests that look for
an engine's processes look in their own copy (tests/conftest.py ``engine_like``). Their output is kept apart and
shown lane by lane at the end, with a line of progress every minute meanwhile.

Both lanes' CPU engines float over the cores (:data:`LANE_ENV`): vLLM's default binds each engine's worker to
core 0 (it keeps the last core for the rest) from the moment torch loads, so two lanes' engines starting together
took turns on one core while the other idled (two demo starts at once: 97 to 135 s bound, 77 to 86 s floating).
A test that binds its own (the two-node tests: one core a node) keeps its value.

With arguments (``nox -s tests -- tests/test_x.py -k y``) it is one plain pytest with them. The exit status is
pytest's, the worst lane's; a lane that collected no test (pytest's 5) fails the run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rig.base.console import echo, error, guard, note, plain
from rig.base.errors import BadInput, problem

#: The lane ``serve``'s files, or single tests by pytest's node id: the engine tests that start most engines, and
#: one engine benchmark's quick run (two-node starts), which evens the lanes' times (docs/testing.md). The lane
#: ``main`` runs the rest.
SERVE = ("tests/test_serve_real.py", "tests/test_ple_real.py", "tests/test_update_real.py",
         "tests/test_benchmarks.py::test_the_benchmark_runs_in_quick_mode_and_prints_its_ratios[nodes_start]")
DURATIONS = "--durations=25"
PROGRESS_EVERY = 60.0
NO_TESTS = 5  # pytest's exit status when it collected nothing
#: What each lane's environment has unless the caller's sets it.
LANE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def lanes(root: Path) -> dict[str, list[str]]:
    """Each lane's pytest arguments; ``root`` is the repository (the files of SERVE must be there)."""
    missing = [f for f in SERVE if not (root / f.split("::")[0]).is_file()]
    if missing:
        raise BadInput(problem("the lane serve's test files", "in tests/", f"none at {', '.join(missing)}",
                               "fix SERVE in rig/base/testlanes.py"))
    return {"serve": list(SERVE), "main": [f"--{'deselect' if '::' in f else 'ignore'}={f}" for f in SERVE]}


def progress(log: Path) -> str:
    """The lane's last pytest progress mark (``[ 42%]``), or what it is doing before the first."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return "starting"
    marks = re.findall(r"\[ *(\d+)%\]", text)
    at = re.findall(r"^(tests/\S+\.py) ([.sFEx]*)", text, re.M)  # the file it is in, the results so far
    now = f"in {at[-1][0]}, {len(at[-1][1])} done there" if at else ""
    if marks:
        return f"{marks[-1]}%" + (f" ({now})" if now else "")
    return now or "building"


def run_lanes(root: Path, args: dict[str, list[str]]) -> int:
    """The lanes (name -> pytest arguments) at once; their logs shown in turn; the worst exit status."""
    work = Path(tempfile.mkdtemp(prefix="rig-test-lanes-"))
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    t0 = time.monotonic()
    env = {**LANE_ENV, **os.environ}
    try:
        for name, lane in args.items():
            log = work / f"{name}.log"
            with open(log, "wb") as fh:
                procs[name] = (subprocess.Popen(
                    [sys.executable, "-m", "pytest", DURATIONS, "-p", "no:cacheprovider",
                     f"--basetemp={work / name}", *lane], cwd=root, env=env, stdout=fh,
                    stderr=subprocess.STDOUT, start_new_session=True), log)
        note(f"tests: lanes {' and '.join(procs)} started, their output in {work}")
        last = time.monotonic()
        while any(p.poll() is None for p, _ in procs.values()):
            time.sleep(1)
            if time.monotonic() - last >= PROGRESS_EVERY:
                last = time.monotonic()
                note(f"tests: {(last - t0) / 60:.0f} min: " + "; ".join(
                    f"{name} {'done' if p.poll() is not None else progress(log)}" for name, (p, log) in procs.items()))
    except BaseException:
        for p, _ in procs.values():
            _end(p)
        raise
    codes = {}
    for name, (p, log) in procs.items():
        codes[name] = p.returncode
        plain(f"\n======== lane {name}: exit {p.returncode} ========")
        echo(log.read_bytes())
    took = (time.monotonic() - t0) / 60
    note(f"\ntests: {took:.1f} min; " + ", ".join(f"lane {n} exit {c}" for n, c in codes.items()))
    bad = [c for c in codes.values() if c]
    if not bad:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    note(f"tests: the lanes' folders are kept in {work}")
    if NO_TESTS in bad:
        error(problem("each lane of the suite", "tests collected", "a lane with none (pytest's exit 5)",
                      "see its output above"))
        return 1
    return bad[0] if bad[0] > 0 else 1


def _end(p: subprocess.Popen) -> None:
    """A lane and what it started (its own session): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
            p.wait(10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def main(argv: list[str]) -> int:
    root = Path.cwd()
    if argv:
        return subprocess.run([sys.executable, "-m", "pytest", DURATIONS, *argv], cwd=root).returncode
    return run_lanes(root, lanes(root))


if __name__ == "__main__":
    raise SystemExit(guard(lambda: main(sys.argv[1:])))
