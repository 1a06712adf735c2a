"""benchmarks/bench.sh and benchmarks/power-sweep.sh, end to end on real llama-benchy.

The server is the engine test double (tests/engine_double.py): an OpenAI-compatible server on
loopback that streams one token per ``1 / DOUBLE_PACE`` s per request, so the generation
throughput llama-benchy measures must land near that pace. The tokenizer is built here with the
``tokenizers`` package (one token per whitespace-separated word, as the double counts prompt
tokens), and the book is a local text file. ``nvidia-smi`` is a fake on PATH that keeps the
power limits in a file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port

from rig import cli
from rig.base.errors import BadInput
from rig.control import bench
from rig.control.bench import Cell, Request, history

DOUBLE = ROOT / "tests" / "engine_double.py"
BENCH = ROOT / "benchmarks" / "bench.sh"
SWEEP = ROOT / "benchmarks" / "power-sweep.sh"
PACE = 100.0  # tokens/s per request of the double
PREFILL = 5000.0  # prompt tokens/s per request of the double
SPEC = ["256", "16", "1 2", "0", "--skip-coherence", "--runs", "1"]
OURS = ("BASE_URL", "MODEL", "TOKENIZER", "VLLM_API_KEY", "MODEL_NAME", "PORT", "HOST", "CKPT", "RIG_CACHE")


class Double:
    """The engine double on a free loopback port."""

    def __init__(self, tmp: Path, pace: float = PACE, **env: str) -> None:
        self.port, self.name = free_port(), "bench-double"
        self.log = tmp / f"double-{self.port}.log"
        full = {**{k: v for k, v in os.environ.items() if not k.startswith(("DOUBLE_", "VLLM_"))},
                "DOUBLE_DELAY": "0", "DOUBLE_PACE": str(pace), **env}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(DOUBLE), "serve", "/ckpt", "--served-model-name",
                                          self.name, "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env=full)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"the double did not listen: {self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A book text and, in a checkpoint-like folder, a word-level tokenizer.json made from it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("bench-assets")
    rng = random.Random(1661)
    words = [f"word{i}" for i in range(400)]
    (d / "book.txt").write_text(" ".join(rng.choice(words) for _ in range(6000)) + "\n")
    vocab = {"[UNK]": 0, **{w: i for i, w in enumerate([*words, "Warmup", "."], 1)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (d / "ckpt").mkdir()
    tok.save(str(d / "ckpt" / "tokenizer.json"))
    return {"book": d / "book.txt", "ckpt": d / "ckpt"}


def base_env(assets: dict[str, Path], double: Double | None, **extra: str) -> dict[str, str]:
    """The defaults path: PORT and MODEL_NAME name the double, CKPT holds the tokenizer."""
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(CKPT=str(assets["ckpt"]), PORT=str(double.port if double else free_port()),
               MODEL_NAME=double.name if double else "bench-double", RIG_STATE=str(assets["book"].parent / "state"),
               **extra)
    return env


def run_bench(env: dict[str, str], *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BENCH), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def results_line(out: str) -> Path:
    lines = [ln for ln in out.splitlines() if ln.startswith("results: ")]
    assert len(lines) == 1, out
    return Path(lines[0].removeprefix("results: "))


def png_text(path: Path) -> dict[str, str]:
    """The tEXt / iTXt chunks of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = {}, 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        if kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"iTXt":
            k, _, rest = body.partition(b"\0")
            out[k.decode()] = rest[2:].split(b"\0", 2)[2].decode()
        i += 12 + n
    return out


def table_rows(md: str) -> dict[tuple[int, int, str], list[str]]:
    rows = {}
    for ln in md.splitlines():
        cols = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cols) == 9 and cols[0].isdigit():
            rows[(int(cols[0]), int(cols[1]), cols[2])] = cols[3:]
    return rows


# --- the wrapper and the arguments ---------------------------------------------------------------

def test_wrappers_are_thin_and_executable():
    for script in (BENCH, SWEEP):
        assert len(script.read_text().splitlines()) <= 20, script
        assert os.access(script, os.X_OK), script
    assert "nox.sh\" -s bench -- \"$@\"" in BENCH.read_text()


def test_defaults_and_extra_arguments_pass_unchanged():
    r = bench.parse([])
    assert (r.pp, r.tg, r.concurrency, r.depth, r.extra) == (32768, 2048, (1,), (0,), ())
    r = bench.parse(["128", "256", "1 2 4", "0 8192 65536", "--runs", "2", "--enable-prefix-caching", "--no-cache",
                     "--results-dir", "out", "--book-file=/b.txt", "--latency-mode", "none"])
    assert (r.pp, r.tg, r.concurrency, r.depth) == (128, 256, (1, 2, 4), (0, 8192, 65536))
    assert r.extra == ("--runs", "2", "--enable-prefix-caching", "--no-cache", "--latency-mode", "none")
    assert r.results == ROOT / "out" and r.book == Path("/b.txt")
    assert bench.parse(["1", "4096"]).concurrency == (1,)  # PP=1: decode only
    assert bench.parse(["512", "--runs", "1"]).extra == ("--runs", "1")  # a value after an option is not TG
    assert bench.parse(["1", "2", "--", "--runs", "1"]).extra == ("--runs", "1")  # a "--" separator is dropped
    assert bench.parse(["x", "--help"]) is None


@pytest.mark.parametrize("argv,item", [
    (["abc"], "PP"), (["1.5"], "PP"), (["-3"], "PP"), (["8 16"], "PP"), (["1", "many"], "TG"), (["1", "0"], "TG"),
    (["1", "1", "1 two"], "CONCURRENCY"), (["1", "1", "0"], "CONCURRENCY"), (["1", "1", ""], "CONCURRENCY"),
    (["1", "1", "1", "0 -5"], "DEPTH"), (["1", "1", "1", "0", "--pp", "3"], "--pp"),
    (["1", "1", "1", "0", "--conc", "3"], "--conc"), (["1", "1", "1", "0", "--save-result=x"], "--save-result"),
    (["1", "1", "1", "0", "--results-dir"], "--results-dir"),
])
def test_bad_arguments_say_what_and_exit_2(argv, item, capsys):
    assert cli.run("bench", argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and item in err[0] and "Fix: " in err[0], err


@pytest.mark.parametrize("var,value,item", [
    ("TOKENIZER", "/nonexistent/tokenizer", "TOKENIZER"), ("BASE_URL", "http://127.0.0.1:8000", "BASE_URL"),
    ("BASE_URL", "https://example.invalid/v1", "BASE_URL"), ("BASE_URL", "http://127.0.0.1:99999/v1", "BASE_URL"),
])
def test_bad_settings_exit_2(var, value, item, monkeypatch, capsys, assets):
    monkeypatch.setenv("TOKENIZER", str(assets["ckpt"]))
    monkeypatch.setenv(var, value)
    assert cli.run("bench", ["1", "2", "1", "0", "--book-file", str(assets["book"])]) == 2
    err = capsys.readouterr().err
    assert item in err and value in err and "Fix: " in err


def test_a_broken_tokenizer_is_named(tmp_path, monkeypatch, capsys, assets):
    (tmp_path / "tokenizer.json").write_text("{not json")
    monkeypatch.setenv("TOKENIZER", str(tmp_path))
    assert cli.run("bench", ["1", "2", "--book-file", str(assets["book"])]) == 2
    assert "tokenizers package reads" in capsys.readouterr().err


def test_default_book_is_generated_without_network_and_the_same_every_time(tmp_path, monkeypatch):
    """A bench run needs nothing but the server: the default book is made on the box, byte for byte the same."""
    import socket

    def no_network(*a, **k):
        raise AssertionError("the default book must not touch the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    path = bench.book_file(Request(1, 1, (1,), (0,)), tmp_path / "a")
    again = bench.book_file(Request(1, 1, (1,), (0,)), tmp_path / "b")
    text = path.read_text(encoding="utf-8")
    assert path.name == bench.BOOK_NAME and path.read_bytes() == again.read_bytes()
    assert len(text.split()) >= 200_000 and "\n\n" in text and len(set(text.split())) > 200
    path.write_text("cut short")  # a copy that is not the generated text is made again
    assert bench.book_file(Request(1, 1, (1,), (0,)), tmp_path / "a").read_bytes() == again.read_bytes()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(BadInput, match="empty file"):
        bench.book_file(Request(1, 1, (1,), (0,), book=empty), tmp_path)


# --- comparison with the previous run ------------------------------------------------------------

def cell(c: int, prompt: float | None, gen: float | None, depth: int = 0) -> Cell:
    return Cell(c, depth, "turn", prompt=None if prompt is None else (prompt, 0.0), gen=None if gen is None else
                (gen, 0.0))


def test_a_drop_of_more_than_5_percent_is_flagged():
    before = [cell(1, 1000.0, 100.0), cell(2, 2000.0, 200.0), cell(4, 4000.0, None)]
    now = [cell(1, 960.0, 94.0), cell(2, 2100.0, 190.4), cell(4, 3000.0, 50.0), cell(8, 1.0, 1.0)]
    got = {(ch.where[0], ch.what): (round(ch.percent, 1), ch.drop) for ch in bench.compare(before, now)}
    assert got == {(1, "prompt"): (-4.0, False), (1, "generation"): (-6.0, True), (2, "prompt"): (5.0, False),
                   (2, "generation"): (-4.8, False), (4, "prompt"): (-25.0, True)}


def test_previous_is_the_latest_complete_run_of_the_same_parameters(tmp_path):
    key = Request(256, 16, (1, 2), (0,), ("--runs", "1")).key

    def put(name: str, created: str, k: dict, gen: float) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"created": created, "key": k,
                                                              "cells": [vars(cell(1, 1.0, gen))]}))

    put("20260101-000000", "2026-01-01T00:00:00", key, 1.0)
    put("20260102-000000", "2026-01-02T00:00:00", key, 2.0)
    put("20260103-000000", "2026-01-03T00:00:00", {**key, "tg": 32}, 3.0)  # other parameters
    put(".run-abc", "2026-01-04T00:00:00", key, 4.0)  # an unfinished run
    (tmp_path / "20260105-000000").mkdir()  # a folder without run.json
    (tmp_path / "power-limit-sweep-1.md").write_text("| table |")
    name, rows = bench.previous(tmp_path, key)
    assert name == "20260102-000000" and rows[0].gen == (2.0, 0.0)
    assert bench.previous(tmp_path, {**key, "pp": 1}) is None


def test_the_history_flags_a_change_beyond_the_spread_and_compares_only_the_same_identity_but_tree(tmp_path):
    ident = {"series": "s1", "tree": "t1", "kernels": "k", "torch": "2.11", "profile": "demo", "device": "cpu",
             "card": "x86_64", "driver": "", "bench": {"pp": 1}}
    history.save(tmp_path, ident, [bench.Cell(1, 0, "turn", gen=(100.0, 2.0), prompt=(500.0, 0.0))], "20260101-1")
    history.save(tmp_path, {**ident, "profile": "other"}, [bench.Cell(1, 0, "turn", gen=(1.0, 0.0))], "20260101-2")
    moved = {**ident, "series": "s2", "tree": "t2"}
    lines = history.compared(tmp_path, moved, [bench.Cell(1, 0, "turn", gen=(90.0, 2.0), prompt=(505.0, 0.0))],
                             "20260101-3")
    assert lines[0] == "history: against 20260101-1 (tree t1 -> t2):"  # not the other profile's newer run
    assert "generation: 100.0 -> 90.0 t/s (-10.0%), CHANGED: beyond 2 x the spread 2.8 t/s" in lines[1]
    assert "prompt: 500.0 -> 505.0 t/s (+1.0%), measured once" in lines[2]
    near = history.compared(tmp_path, moved, [bench.Cell(1, 0, "turn", gen=(97.0, 2.0))], "20260101-3")
    assert "within the spread (2 x 2.8 t/s)" in near[1]
    assert history.compared(tmp_path, {**ident, "card": "H100"}, [], "x")[0].startswith("history: no earlier run")
    (history.folder(tmp_path) / "junk.json").write_text("{not json")  # passed over
    assert [r["run"] for r in history.records(tmp_path)] == ["20260101-1", "20260101-2"]


# --- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def first(assets, tmp_path_factory):
    """The issue's run: bench.sh 256 16 "1 2" 0 --skip-coherence --runs 1, against the double at PACE."""
    tmp = tmp_path_factory.mktemp("bench-first")
    double = Double(tmp, DOUBLE_PREFILL_PACE=str(PREFILL))
    try:
        t0 = time.monotonic()
        r = run_bench(base_env(assets, double), *SPEC, "--results-dir", str(tmp / "results"), "--book-file",
                      str(assets["book"]), cwd=tmp)
        took = time.monotonic() - t0
    finally:
        double.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    return {"r": r, "dir": results_line(r.stdout), "root": tmp / "results", "took": took}


def test_run_saves_json_table_and_plot_with_the_doubles_numbers(first):
    out, d = first["r"].stdout, first["dir"]
    assert d.parent == first["root"] and d.name[:8].isdigit()
    assert sorted(p.name for p in first["root"].iterdir()) == [d.name]  # nothing half-written left beside it
    assert {"llama-benchy.json", "results.md", "run.json", "throughput.png", "llama-benchy.log"} <= \
        {p.name for p in d.iterdir()}
    assert "healthy" in out and "Downloading book from http://127.0.0.1:" in out  # the book came from loopback

    report = json.loads((d / "llama-benchy.json").read_text())
    assert report["version"] == "0.4.0" and report["model"] == "bench-double"
    by_c = {b["concurrency"]: b for b in report["benchmarks"]}
    assert sorted(by_c) == [1, 2]
    for c, b in by_c.items():
        assert (b["prompt_size"], b["response_size"], b["context_size"]) == (256, 16, 0)
        total, per_req = b["tg_throughput"]["mean"], b["tg_req_throughput"]["mean"]
        assert 0.75 * PACE * c < total < 1.1 * PACE * c, (c, total)
        assert 0.75 * PACE < per_req < 1.1 * PACE, (c, per_req)
        pp = b["pp_req_throughput"]["mean"]
        assert 0.7 * PREFILL < pp < 1.1 * PREFILL, (c, pp)  # the double's prefill pace, seen per request
    assert by_c[2]["pp_throughput"]["mean"] > 0

    rows = table_rows((d / "results.md").read_text())
    assert set(rows) == {(1, 0, "turn"), (2, 0, "turn")}
    for c, b in by_c.items():
        assert rows[(c, 0, "turn")][2] == f"{b['tg_throughput']['mean']:.1f} ± {b['tg_throughput']['std']:.1f}"
        assert rows[(c, 0, "turn")][3] == f"{b['tg_req_throughput']['mean']:.1f} ± {b['tg_req_throughput']['std']:.1f}"
    assert rows[(2, 0, "turn")][0] == f"{by_c[2]['pp_throughput']['mean']:.1f} ± 0.0"
    assert "No earlier run with these parameters" in (d / "results.md").read_text()
    assert table_rows(out) == rows  # the summary printed is the saved table

    plotted = json.loads(png_text(d / "throughput.png")["Description"])
    assert plotted["x"] == "concurrency" and len(plotted["series"]) == 1
    s = plotted["series"][0]
    assert s["label"] == "depth 0" and s["x"] == [1, 2]
    assert s["generation"] == [by_c[1]["tg_throughput"]["mean"], by_c[2]["tg_throughput"]["mean"]]


def test_run_leaves_no_cached_book_behind(first):
    import hashlib

    url = next(ln.split("from ", 1)[1].rstrip(".") for ln in first["r"].stdout.splitlines()
               if ln.startswith("Downloading book from "))
    cached = Path.home() / ".cache" / "llama-benchy" / f"{hashlib.md5(url.encode()).hexdigest()}.txt"
    assert not cached.exists()


def test_warm_run_is_quick(first):
    assert first["took"] < 120, first["took"]


def test_a_slower_server_is_flagged_against_the_previous_run(first, assets, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(first["dir"], root / first["dir"].name)
    double = Double(tmp_path, pace=PACE * 0.6)
    try:
        r = run_bench(base_env(assets, double), *SPEC, "--results-dir", str(root), "--book-file",
                      str(assets["book"]), cwd=tmp_path)
    finally:
        double.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    md = (results_line(r.stdout) / "results.md").read_text()
    assert f"`{first['dir'].name}`" in md
    drops = [ln for ln in md.splitlines() if ln.endswith("DROP |")]
    assert any("| 1 | 0 | turn | generation |" in ln for ln in drops), md
    assert any("| 2 | 0 | turn | generation |" in ln for ln in drops), md
    assert "generation throughput at concurrency 1, depth 0 (turn) fell" in r.stderr
    # the history under RIG_STATE: both runs, the same identity (the tree too), set side by side
    hist = Path(base_env(assets, None)["RIG_STATE"]) / "bench-history"
    recs = sorted(hist.glob("*.json"))
    assert len(recs) >= 2 and (hist / "history.png").is_file()
    ident = json.loads(recs[-1].read_text())["identity"]
    assert {"series", "tree", "kernels", "torch", "profile", "device", "card", "driver", "bench"} <= set(ident)
    assert ident["bench"]["pp"] == 256 and ident["bench"]["concurrency"] == [1, 2]
    assert "history: against " in r.stdout and "(the same tree)" in r.stdout
    assert re.search(r"c=1 depth 0 turn, generation: [\d.]+ -> [\d.]+ t/s \(-\d+\.\d%\), measured once", r.stdout)
    again = run_bench(base_env(assets, None), "--compare", cwd=tmp_path)
    assert again.returncode == 0 and "history: against " in again.stdout, again.stdout + again.stderr
    plotted = json.loads(png_text(hist / "history.png")["Description"])
    assert any(len(points) >= 2 for points in plotted.values())  # a cell over two runs at least


def test_depth_sweep_with_prefix_caching_overrides_and_an_api_key(assets, tmp_path):
    cache = tmp_path / "rig-cache"  # the default book: generated into RIG_CACHE
    double = Double(tmp_path, VLLM_API_KEY="s3cret")
    try:
        env = base_env(assets, None, BASE_URL=f"http://127.0.0.1:{double.port}/v1", MODEL=double.name,
                       TOKENIZER=str(assets["ckpt"] / "tokenizer.json"), VLLM_API_KEY="s3cret", RIG_CACHE=str(cache))
        r = run_bench(env, "64", "8", "1", "0 128", "--enable-prefix-caching", "--skip-coherence", "--runs", "1",
                      "--results-dir", str(tmp_path / "results"), cwd=tmp_path)
        wrong = run_bench({**env, "VLLM_API_KEY": "other"}, "64", "8", cwd=tmp_path)
    finally:
        double.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    d = results_line(r.stdout)
    report = json.loads((d / "llama-benchy.json").read_text())
    assert report["prefix_caching_enabled"] is True
    phases = {(b["context_size"], b["is_context_prefill_phase"]) for b in report["benchmarks"]}
    assert phases == {(0, False), (128, True), (128, False)}
    assert set(table_rows((d / "results.md").read_text())) == {(1, 0, "turn"), (1, 128, "context load"),
                                                               (1, 128, "turn")}
    plotted = json.loads(png_text(d / "throughput.png")["Description"])
    assert plotted["x"] == "depth" and plotted["series"][0]["x"] == [0, 128]
    assert plotted["series"][0]["label"] == "concurrency 1"
    assert f"book `{cache / bench.BOOK_NAME}`" in (d / "results.md").read_text()
    assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr


@pytest.mark.parametrize("mode", ["no-generate", "nothing listening"])
def test_an_unhealthy_server_is_one_line_and_exit_2(mode, assets, tmp_path):
    double = Double(tmp_path, DOUBLE_MODE="no-generate") if mode == "no-generate" else None
    try:
        r = run_bench(base_env(assets, double), *SPEC, "--results-dir", str(tmp_path / "results"), "--book-file",
                      str(assets["book"]), cwd=tmp_path)
    finally:
        if double:
            double.stop()
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "one-token generation" in errors[0] and "./start.sh" in errors[0]
    assert ("HTTP 500" if double else "Connection refused") in errors[0]
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_bad_input_keeps_exit_2_through_nox(tmp_path):
    r = run_bench(dict(os.environ), "32k", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: PP: expected a whole number >= 1" in r.stderr
    h = run_bench(dict(os.environ), "--help", cwd=tmp_path)
    assert h.returncode == 0 and all(w in h.stdout for w in ("PP", "TG", "CONCURRENCY", "DEPTH", "TOKENIZER"))


# --- the power sweep, with a fake nvidia-smi -----------------------------------------------------

FAKE_SMI = r'''#!/usr/bin/env python3
import json, os, sys
state, log = os.environ["FAKE_SMI_STATE"], os.environ["FAKE_SMI_LOG"]
args = sys.argv[1:]
with open(log, "a") as fh:
    fh.write(json.dumps(args) + "\n")
limits = json.load(open(state))
if args[:1] == ["--query-gpu=index,power.limit"]:
    for i, w in enumerate(limits):
        print(f"{i}, {w:.2f}")
    sys.exit(0)
gpu = int(args[args.index("-i") + 1]) if "-i" in args else None
w = float(args[args.index("-pl") + 1])
for i, old in enumerate(limits):
    if gpu in (None, i):
        limits[i] = w
        print(f"Power limit for GPU 00000000:0{i}:00.0 was set to {w:.2f} W from {old:.2f} W.")
with open(state + ".tmp", "w") as fh:
    json.dump(limits, fh)
os.replace(state + ".tmp", state)
'''


@pytest.fixture
def fake_smi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    state, log = tmp_path / "limits.json", tmp_path / "calls.log"
    state.write_text(json.dumps([350.0, 300.0]))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SMI_STATE": str(state),
           "FAKE_SMI_LOG": str(log)}

    def calls() -> list[list[str]]:
        return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []

    return env, lambda: json.loads(state.read_text()), calls


RESTORE = [["-i", "0", "-pl", "350.00"], ["-i", "1", "-pl", "300.00"]]


def test_power_sweep_writes_one_table_and_restores(fake_smi, assets, tmp_path):
    smi_env, limits, calls = fake_smi
    double = Double(tmp_path)
    try:
        env = {**base_env(assets, double), **smi_env}
        r = subprocess.run([str(SWEEP), "220 250", *SPEC, "--results-dir", str(tmp_path / "results"),
                            "--book-file", str(assets["book"])], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
    finally:
        double.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert limits() == [350.0, 300.0]
    sets = [c for c in calls() if "-pl" in c]
    assert sets == [["-pl", "220"], ["-pl", "250"], *RESTORE]
    table = Path(next(ln for ln in r.stdout.splitlines() if ln.startswith("table: ")).removeprefix("table: "))
    assert table.parent == tmp_path / "results" and table.name.startswith("power-limit-sweep-")
    text = table.read_text()
    assert text in r.stdout
    labels = [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| 2")]
    assert labels == ["220 W", "220 W", "250 W", "250 W"]
    for ln in (ln for ln in text.splitlines() if ln.startswith("| 2")):
        conc, gen = int(ln.split("|")[2]), float(ln.split("|")[6].split("±")[0])
        assert 0.75 * PACE * conc < gen < 1.1 * PACE * conc, ln


def test_power_sweep_restores_after_a_failed_bench(fake_smi, assets, tmp_path):
    smi_env, limits, calls = fake_smi
    env = {**base_env(assets, None), **smi_env}  # nothing listens: bench.sh stops with exit 2
    r = subprocess.run([str(SWEEP), "220 250", *SPEC, "--book-file", str(assets["book"])], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert limits() == [350.0, 300.0]
    assert [c for c in calls() if "-pl" in c] == [["-pl", "220"], *RESTORE]


def test_power_sweep_restores_after_ctrl_c(fake_smi, assets, tmp_path):
    smi_env, limits, calls = fake_smi
    cache = Path.home() / ".cache" / "llama-benchy"
    cached_before = set(cache.iterdir()) if cache.is_dir() else set()
    double = Double(tmp_path, pace=2)  # one request of 500 tokens takes minutes
    try:
        env = {**base_env(assets, double), **smi_env}
        # SIGINT as a terminal's user has it: a suite started in the background (`.ci/run &` from a script)
        # inherits it ignored, and then neither the sweep's trap nor Python's KeyboardInterrupt can see Ctrl-C
        p = subprocess.Popen([str(SWEEP), "220 250", "64", "500", "--skip-coherence", "--runs", "1",
                              "--results-dir", str(tmp_path / "results"), "--book-file", str(assets["book"])],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        seen = []
        for line in p.stdout:  # up to the measured requests (or the end, if the run stopped early)
            seen.append(line)
            if line.startswith("Running test: pp=64, tg=500"):
                break
        assert limits() == [220.0, 220.0]
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        out = "".join(seen) + p.communicate(timeout=60)[0]
    finally:
        double.stop()
    assert p.returncode == 130, out
    assert "Running test: pp=64, tg=500" in out, out  # the interrupt came during the measured requests
    assert "error: interrupted" in out
    assert limits() == [350.0, 300.0]
    assert [c for c in calls() if "-pl" in c] == [["-pl", "220"], *RESTORE]
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").iterdir())
    assert (set(cache.iterdir()) if cache.is_dir() else set()) <= cached_before  # no cached book left


def test_power_sweep_refuses_bad_limits_before_touching_a_card(fake_smi, tmp_path):
    smi_env, limits, calls = fake_smi
    r = subprocess.run([str(SWEEP), "220 lots"], cwd=tmp_path, env={**os.environ, **smi_env}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "LIMITS" in r.stderr and "Fix:" in r.stderr
    assert calls() == [] and limits() == [350.0, 300.0]
