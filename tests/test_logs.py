"""The log reader on vLLM-format lines the tests make from the documented formats."""

from __future__ import annotations

import math
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

from rig.control import logview
from rig.running import logs

STATS = ("Engine 000: Avg prompt throughput: 2254.6 tokens/s, Avg generation throughput: 131.8 tokens/s, "
         "Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.2%, Prefix cache hit rate: 38.5%")
FULL = ("Engine 001: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.5 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, Deferred: 1 reqs, Preemptions: 5, GPU KV cache usage: 91.0%, "
        "Prefix cache hit rate: 0.0%, Corrupted: 0 reqs, External prefix cache hit rate: 12.5%, "
        "MM cache hit rate: 50.0%, Brand new field: 7 things")
SPEC = ("SpecDecoding metrics: Mean acceptance length: 2.71, Accepted throughput: 81.40 tokens/s, Drafted "
        "throughput: 142.80 tokens/s, Accepted: 814 tokens, Drafted: 1428 tokens, Per-position acceptance rate: "
        "0.871, 0.552, 0.287, Avg Draft acceptance rate: 57.0%")
SPEC_NAN = ("SpecDecoding metrics: Mean acceptance length: nan, Accepted throughput: 0.00 tokens/s, Drafted "
            "throughput: 0.00 tokens/s, Accepted: 0 tokens, Drafted: 0 tokens, Per-position acceptance rate: nan, "
            "nan, nan, Avg Draft acceptance rate: nan%")
CAP = "GPU KV cache size: 924,993 tokens, Maximum concurrency for 262,144 tokens per request: 3.53x"


def line(msg: str, level: str = "INFO", tag: str = "(APIServer pid=4242) ", t: str = "12-02 18:00:01") -> str:
    return f"{tag}{level} {t} [loggers.py:260] {msg}"


def test_stats_fields_all_parsed():
    ev = logs.parse(line(STATS))
    assert ev.kind == "stats" and ev.time == "12-02 18:00:01"
    assert ev.data == {"prompt": 2254.6, "gen": 131.8, "running": 4, "waiting": 0, "kv": 3.2, "device": "GPU",
                       "prefix_hit": 38.5, "engine": "000"}
    full = logs.parse(line(FULL, tag="(EngineCore pid=7) ")).data
    assert full["deferred"] == 1 and full["preempted"] == 5 and full["kv"] == 91.0 and full["corrupted"] == 0
    assert full["ext_prefix_hit"] == 12.5 and full["mm_hit"] == 50.0 and full["engine"] == "001"


def test_the_series_counters_are_read_field_by_field_and_shown():
    """COUNTERS=1 (patches 0003 and 0005) appends its fields; one vLLM adds later, before or after, breaks none."""
    msg = (STATS + ", Some later field: 3 things, Guard token_ids: 2, Guard positions: 0, Guard sampling: 1, "
           "Abliteration: my-set.v2, Another: x")
    ev = logs.parse(line(msg))
    assert ev.data["guard_token_ids"] == 2 and ev.data["guard_positions"] == 0 and ev.data["guard_sampling"] == 1
    assert ev.data["abliteration"] == "my-set.v2"
    shown = logview.render(ev, None, logview.Palette(False))
    assert shown.endswith("prefix hit 38.5%  guard 2/0/1  abl my-set.v2"), shown
    off = logview.render(logs.parse(line(STATS + ", Guard token_ids: 0, Abliteration: off")), None,
                         logview.Palette(False))
    assert off.endswith("guard 0/0/0  abl off"), off
    assert "guard" not in logview.render(logs.parse(line(STATS)), None, logview.Palette(False))


def test_spec_and_capacity_lines():
    sp = logs.parse(line(SPEC))
    assert sp.kind == "spec" and sp.data == {"accept_len": 2.71, "accept_rate": 57.0}
    nan = logs.parse(line(SPEC_NAN)).data
    assert math.isnan(nan["accept_len"]) and math.isnan(nan["accept_rate"])
    cap = logs.parse(line(CAP, tag="(EngineCore pid=9) "))
    assert cap.kind == "capacity" and cap.data == {"device": "GPU", "tokens": 924993, "context": 262144,
                                                    "concurrency": 3.53}


def test_prefixes_colours_crlf_and_other_devices():
    coloured = "\x1b[32m" + line(STATS).replace("INFO", "INFO\x1b[0m") + "\r\n"
    assert logs.parse(coloured).data["gen"] == 131.8
    assert logs.parse("myhost: " + line(STATS, tag="(Worker_TP1 pid=3) ")).data["running"] == 4
    xpu = logs.parse(line(STATS.replace("GPU KV", "XPU KV"))).data
    assert xpu["device"] == "XPU" and xpu["kv"] == 3.2


def test_garbage_and_half_lines_do_not_crash():
    for junk in ("", "\x00\x01", "garbage", "INFO 99-99 [", line(STATS)[:60], "INFO 12-02 18:00:01 [x.py:1]",
                 line("Avg prompt throughput: lots"), "\ufffd" * 10):
        ev = logs.parse(junk)
        assert ev is None or ev.kind in ("bad", "stats", "warning", "error")


def render_all(raw: list[str]) -> tuple[list[str], dict]:
    counts = {"stats": 0, "unparsed": 0}
    out = list(logview.lines_of((logs.parse(x) for x in raw), logview.Palette(False), counts))
    return out, counts


def test_one_line_per_update_with_the_spec_line_merged():
    raw = [line(CAP), line(STATS), line(SPEC), line("Some info"), line(STATS, t="12-02 18:00:02"),
           line(CAP), line("disk is slow", "WARNING"), line("boom", "ERROR", t="12-02 18:00:03"),
           line(FULL, t="12-02 18:00:04"), line(SPEC_NAN)]
    out, counts = render_all(raw)
    assert counts == {"stats": 3, "unparsed": 0}
    assert out[0].startswith("12-02 18:00:01  GPU KV cache: 924,993 tokens, 3.53x concurrency at 262,144")
    assert sum("KV cache: 924,993" in o for o in out) == 1  # the capacity line once
    assert "MTP len 2.71 accept 57.0%" in out[1] and "prompt   2254.6 tok/s" in out[1] and "KV 3.2%" in out[1]
    assert "MTP" not in out[2] and "18:00:02" in out[2]
    assert out[3].endswith("WARNING disk is slow") and out[4].endswith("ERROR boom")
    assert "deferred 1" in out[5] and "preempted 5" in out[5] and "MTP len nan accept nan" in out[5]
    assert len(out) == 6


def test_unparseable_stats_lines_are_counted_and_reported(tmp_path):
    f = tmp_path / "vllm.log"
    f.write_text("\n".join([line(STATS), line("Engine 000: Avg prompt throughput: ???"), "junk", ""]))
    r = run_reader(["--file", str(f)], {})
    assert r.returncode == 0
    assert len(r.stdout.strip().splitlines()) == 1
    assert "1 stats line(s) could not be parsed" in r.stderr


def run_reader(args: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rig.cli", "logs", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, **kw)


def test_missing_file_and_missing_container_are_one_clear_line(tmp_path):
    r = run_reader(["-f"], {"LOG": str(tmp_path / "none.log")})
    assert r.returncode == 2 and "none.log" in r.stderr and "Fix:" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_reader([], {"VLLM_CONTAINER": "no-such-container", "DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert r.returncode == 2 and "no-such-container" in r.stderr and "Fix:" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_plain_text_without_a_terminal_colour_with_one(tmp_path):
    f = tmp_path / "vllm.log"
    f.write_text(line(STATS) + "\n")
    plain = run_reader(["--file", str(f)], {})
    assert "\x1b[" not in plain.stdout and "gen" in plain.stdout
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "rig.cli", "logs", "--file", str(f)], cwd=ROOT, stdout=slave,
                         stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "NO_COLOR"})
    p.wait()
    os.close(slave)
    assert b"\x1b[" in os.read(master, 65536)
    os.close(master)
    p = subprocess.Popen([sys.executable, "-m", "rig.cli", "logs", "--file", str(f)], cwd=ROOT,
                         stdout=(s := pty.openpty())[1], stderr=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
    p.wait()
    os.close(s[1])
    assert b"\x1b[" not in os.read(s[0], 65536)


def writer(path: Path, n: int, rotate_at: int, how: str) -> None:
    """Append n stats lines (each followed by its spec line), rotating the file once on the way."""
    for i in range(n):
        if i == rotate_at:
            if how == "rename":
                os.rename(path, path.with_suffix(".log.1"))
            else:  # copytruncate
                path.with_suffix(".log.1").write_bytes(path.read_bytes())
                os.truncate(path, 0)
        with open(path, "a") as fh:
            stats = line(STATS.replace("Running: 4", f"Running: {i}"), t=f"12-02 18:{i // 60:02d}:{i % 60:02d}")
            half = len(stats) // 2
            fh.write(stats[:half])
            fh.flush()
            time.sleep(0.01)  # a line cut in half by a write in progress
            fh.write(stats[half:] + "\n" + line(SPEC) + "\n")
        time.sleep(0.03)


def test_follow_reads_what_a_copytruncate_cut_off_from_the_copy(tmp_path):
    # the line written after the reader's last read and before the truncation is only in <log>.1
    f = tmp_path / "vllm.log"
    f.write_text("first\n")
    lines = logview.follow(f, 0, poll=0.01, stop=5)
    assert next(lines) is None  # at the end, nothing new
    with open(f, "a") as fh:
        fh.write("second\n")
    (tmp_path / "vllm.log.1").write_bytes(f.read_bytes())
    os.truncate(f, 0)
    with open(f, "a") as fh:
        fh.write("3\n")
    got = []
    for ln in lines:
        if ln is not None:
            got.append(ln)
        elif got:
            break
    assert got == ["second", "3"]


def test_follow_copytruncate_without_a_matching_copy_replays_nothing(tmp_path):
    f = tmp_path / "vllm.log"
    f.write_text("first line of the day\n")
    (tmp_path / "vllm.log.1").write_text("yesterday, line one\nyesterday, line two\n")
    lines = logview.follow(f, 0, poll=0.01, stop=5)
    assert next(lines) is None
    os.truncate(f, 0)
    with open(f, "a") as fh:
        fh.write("new\n")
    got = []
    for ln in lines:
        if ln is not None:
            got.append(ln)
        elif got:
            break
    assert got == ["new"]


def test_follow_across_rotation_loses_nothing_and_repeats_nothing(tmp_path):
    for how in ("rename", "copytruncate"):
        f = tmp_path / f"{how}.log"
        f.write_text(line("old line") + "\n")
        p = subprocess.Popen([sys.executable, "-m", "rig.cli", "logs", "-f", "-n", "0"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "LOG": str(f)})
        time.sleep(1.0)
        writer(f, 40, 20, how)
        time.sleep(1.0)
        p.terminate()
        out = p.communicate(timeout=10)[0].splitlines()
        runs = [int(o.split("run ")[1].split()[0]) for o in out if "run " in o]
        assert runs == list(range(40)), (how, runs)
        assert all("MTP len 2.71" in o for o in out)
