"""The rig's own metrics (rig/running/metrics.py): the node exporter's textfile format, checked by the real
``promtool``, counted across processes, and what a supervised engine's start and end add to them."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
from pathlib import Path

import pytest

from rig.running import metrics

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool (Debian's prometheus) is not installed: "
                                    "nox -s tests installs it as root")


def prom(state: Path) -> str:
    return (metrics.folder(state) / metrics.FILE).read_text()


@needs_promtool
def test_the_file_is_what_promtool_accepts_and_holds_each_value(tmp_path):
    metrics.put(tmp_path, "rig_build_info", 1, only=True, version="0.30.0", tree="17cd7572b314", kernels="3081646c",
                device="cpu", torch='host "2.11"\n')
    metrics.add(tmp_path, "rig_engine_starts_total")
    metrics.put(tmp_path, "rig_engine_start_seconds", 61.25)
    metrics.add(tmp_path, "rig_engine_ends_total", cause="killed")
    metrics.add(tmp_path, "rig_engine_ends_total", cause="killed")
    metrics.add(tmp_path, "rig_engine_ends_total", cause="hung")
    metrics.add(tmp_path, "rig_gpu_gate_wait_seconds_total", 2.5)
    text = prom(tmp_path)
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout, r.stderr, text)
    assert 'rig_engine_ends_total{cause="killed"} 2' in text and 'rig_engine_ends_total{cause="hung"} 1' in text
    assert "rig_engine_start_seconds 61.25" in text and "rig_gpu_gate_wait_seconds_total 2.5" in text
    assert 'torch="host \\"2.11\\"\\n"' in text  # a label's quote and newline escaped, as the format asks
    assert "# TYPE rig_engine_starts_total counter" in text and "# HELP rig_engine_starts_total " in text


def test_an_info_metric_keeps_one_label_set_and_a_gauge_its_last_value(tmp_path):
    for tree in ("aaa", "bbb"):
        metrics.put(tmp_path, "rig_build_info", 1, only=True, tree=tree, device="cpu")
    metrics.put(tmp_path, "rig_engine_start_seconds", 90)
    metrics.put(tmp_path, "rig_engine_start_seconds", 60)
    text = prom(tmp_path)
    assert 'tree="bbb"' in text and 'tree="aaa"' not in text
    assert "rig_engine_start_seconds 60\n" in text and " 90" not in text


def _adds(state: str, n: int) -> None:
    for _ in range(n):
        metrics.add(Path(state), "rig_engine_starts_total")


def test_counters_add_up_across_processes_at_once(tmp_path):
    """Two supervisors (or a supervisor and a start) counting at the same moment lose no count: the store is
    read and written under a lock."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_adds, args=(str(tmp_path), 40)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert "rig_engine_starts_total 120\n" in prom(tmp_path)


def test_a_damaged_store_is_said_and_counting_starts_again(tmp_path, capsys):
    d = metrics.folder(tmp_path)
    d.mkdir()
    (d / metrics.COUNTS).write_text("{not json")
    metrics.add(tmp_path, "rig_engine_starts_total")
    assert "counting again from 0" in capsys.readouterr().err
    assert "rig_engine_starts_total 1\n" in prom(tmp_path)
    assert json.loads((d / metrics.COUNTS).read_text())  # written whole again


def test_a_metric_not_in_the_table_is_a_programming_error(tmp_path):
    with pytest.raises(KeyError):
        metrics.add(tmp_path, "rig_unknown_total")


def test_a_folder_that_cannot_be_written_is_said_and_serving_goes_on(tmp_path, capsys):
    (tmp_path / metrics.FOLDER).write_text("a file where the folder belongs")
    metrics.add(tmp_path, "rig_engine_starts_total")  # no exception
    assert "not written" in capsys.readouterr().err
