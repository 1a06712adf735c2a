"""The suite's two lanes (rig/base/testlanes.py): every test file runs in exactly one, and a lane's failure, or a
lane that collected nothing, fails the run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from rig.base import testlanes


def test_every_test_file_runs_in_exactly_one_lane() -> None:
    args = testlanes.lanes(ROOT)
    left_out = {a.split("=", 1)[1] for a in args["main"]}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    assert {f.split("::")[0] for f in args["serve"]} <= files and left_out == set(args["serve"])
    # main: everything else, new files too; a file whole, a single test by its node id
    assert all(a.startswith("--deselect=" if "::" in a else "--ignore=") for a in args["main"])


def test_a_test_the_serve_lane_takes_by_node_id_is_one_test_there_and_none_in_main() -> None:
    ids = [f for f in testlanes.SERVE if "::" in f]
    assert ids, "the lane serve takes no single test: this test has nothing to check"
    main = testlanes.lanes(ROOT)["main"]
    for lane, argv, want in (("serve", [ids[0]], 1), ("main", [*main, ids[0].split("::")[0]], 0)):
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *argv],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.stdout.splitlines().count(ids[0]) == want, (lane, r.stdout[-2000:])


def lane_files(tmp_path: Path, **tests: str) -> dict[str, list[str]]:
    for name, body in tests.items():
        (tmp_path / f"test_{name}.py").write_text(body)
    return {name: [f"test_{name}.py"] for name in tests}


def test_both_lanes_passing_is_exit_0_and_each_lanes_output_is_shown(tmp_path: Path, capsys) -> None:
    lanes = lane_files(tmp_path, one="def test_a():\n    assert True\n", two="def test_b():\n    assert True\n")
    assert testlanes.run_lanes(tmp_path, lanes) == 0
    out = capsys.readouterr().out
    assert "======== lane one: exit 0" in out and "======== lane two: exit 0" in out and out.count("1 passed") == 2


def test_the_lanes_engines_float_over_the_cores_unless_the_caller_binds_them(tmp_path: Path, monkeypatch) -> None:
    """Each lane's environment has VLLM_CPU_OMP_THREADS_BIND=nobind (vLLM's default pins every CPU engine's
    worker to core 0, so two lanes' engines took turns on it); a value the caller set is kept."""
    check = "import os\ndef test_a():\n    assert os.environ['VLLM_CPU_OMP_THREADS_BIND'] == {!r}\n"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert testlanes.run_lanes(tmp_path, lane_files(tmp_path, one=check.format("nobind"))) == 0
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert testlanes.run_lanes(tmp_path, lane_files(tmp_path, two=check.format("1"))) == 0


def test_a_failing_lane_fails_the_run_and_keeps_its_folder(tmp_path: Path, capsys) -> None:
    lanes = lane_files(tmp_path, one="def test_a():\n    assert True\n", two="def test_b():\n    assert 1 == 2\n")
    assert testlanes.run_lanes(tmp_path, lanes) == 1
    out, err = capsys.readouterr()
    assert "lane two exit 1" in err and "assert 1 == 2" in out
    kept = Path(err.split("the lanes' folders are kept in ")[1].split()[0])
    assert (kept / "two.log").is_file()
    shutil.rmtree(kept)


def test_a_lane_that_collected_no_tests_fails_the_run(tmp_path: Path, capsys) -> None:
    lanes = lane_files(tmp_path, one="def test_a():\n    assert True\n", two="x = 1\n")
    assert testlanes.run_lanes(tmp_path, lanes) == 1
    err = capsys.readouterr().err
    assert "a lane with none (pytest's exit 5)" in err
    shutil.rmtree(err.split("the lanes' folders are kept in ")[1].split()[0])


def test_with_arguments_it_is_one_plain_pytest(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    assert True\n")
    r = subprocess.run([sys.executable, "-m", "rig.base.testlanes", "test_x.py", "-p", "no:cacheprovider"],
                       cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "1 passed" in r.stdout and "======== lane" not in r.stdout


def test_progress_says_the_percentage_and_the_file_a_lane_is_in(tmp_path: Path) -> None:
    log = tmp_path / "lane.log"
    assert testlanes.progress(log) == "starting"
    log.write_text("collected 39 items\n\n")
    assert testlanes.progress(log) == "building"  # the session fixtures' builds come before the first result
    log.write_text("collected 39 items\n\ntests/test_a.py ..s.F")
    assert testlanes.progress(log) == "in tests/test_a.py, 5 done there"
    log.write_text("tests/test_a.py .....          [ 40%]\ntests/test_b.py ..")
    assert testlanes.progress(log) == "40% (in tests/test_b.py, 2 done there)"


def test_a_lane_file_that_is_not_there_is_exit_2_naming_it_and_the_fix(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "rig.base.testlanes"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "tests/test_serve_real.py" in r.stderr, r.stderr
    assert "fix SERVE in rig/base/testlanes.py" in r.stderr and "lanes serve and main started" not in r.stderr
