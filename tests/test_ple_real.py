"""The PLE offload (patch 0007) on the real engine, CPU build: the demo-ple profile's tiny Gemma 3n, whose
per-layer-embedding table the engine's ``VLLM::PLEServer`` child holds in host RAM.

One engine served by the rig (its own state folder beside the demo's engine) for the child, its log line and
its death; in-process engines (tests/greedy_probe.py) on the rig's own command for the outputs with the offload
on and off.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import engine_like
from test_serve_real import (
    KEY,
    bare_env,
    completion,
    demo_command,
    free_port,
    in_group,
    nox,
    os_pgid,
    tomllib_load,
)

from rig.plan.engine import SERIES_VARS

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.ple]

CHILD = "VLLM::PLEServer"
TABLE_LINE = "PLE offload: table model.embed_tokens_per_layer.weight: 2048 x 4096 BF16, 0.016 GiB in host RAM"


def ple_env(dest: Path, d: Path, **extra: str) -> dict[str, str]:
    """The demo-ple profile on the CPU build, as a bare user, with its own state folder and port."""
    (d / "home").mkdir(exist_ok=True)
    return bare_env(d / "home", PROFILE="demo-ple", DEVICE="cpu", RIG_STATE=str(d / "state"),
                    LOG=str(d / "vllm.log"), PORT=str(free_port()), VLLM_API_KEY=KEY, START_TIMEOUT="900", **extra)


@pytest.fixture(scope="module")
def ple_served(cpu_build, tmp_path_factory):
    """``PROFILE=demo-ple ./start.sh``: the fresh copy's CPU build (conftest's cpu_build), the Gemma 3n made on
    the box, the offload on (the profile's default)."""
    dest, cpu, _ = cpu_build
    assert cpu.returncode == 0, (cpu.stdout + cpu.stderr)[-3000:]
    d = tmp_path_factory.mktemp("ple")
    env = ple_env(dest, d)
    t0 = time.monotonic()
    # --no-build: the build is cpu_build's, recorded in the copy's own state; this engine's state is its own
    r = subprocess.run([str(dest / "start.sh"), "--no-build"], cwd=dest, env=env, capture_output=True, text=True,
                       timeout=1800)
    took = time.monotonic() - t0
    yield dest, d, env, r, took
    nox(dest, env, "-s", "stop")


def embedding_row_is_zero(ckpt: Path, token: int) -> bool:
    """Whether ``token``'s row of the checkpoint's embedding table is all zeros (read with the standard library)."""
    with open(ckpt / "model.safetensors", "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
        entry = header["model.embed_tokens.weight"]
        width = entry["shape"][1] * {"BF16": 2, "F16": 2, "F32": 4}[entry["dtype"]]
        fh.seek(8 + size + entry["data_offsets"][0] + token * width)
        return not any(fh.read(width))


def test_a_prompt_holding_the_pad_token_has_finite_logits(ple_served):
    """Patch 0009: transformers zeroes the pad_token_id row of the embedding when it makes a model (the demo's is
    0); upstream's AltUp divided 0 by 0 for that token, so every prompt holding it got NaN logits (a logprobs
    request refused as out-of-range JSON, greedy text empty)."""
    dest, d, env, r, _ = ple_served
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ckpt = Path(env["RIG_CACHE"]) / "models" / "demo-ple"
    config = json.loads((ckpt / "config.json").read_text())
    pad = config.get("text_config", config)["pad_token_id"]
    assert embedding_row_is_zero(ckpt, pad) and not embedding_row_is_zero(ckpt, pad + 1)  # the case is here
    code, text = completion(env, {"model": "demo-ple", "prompt": [pad, 5, 6, 7], "max_tokens": 4, "logprobs": 1})
    assert code == 200, text
    logprobs = json.loads(text)["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == 4 and all(math.isfinite(x) for x in logprobs), logprobs


def test_the_fit_said_before_the_start_is_the_pool_vllm_then_made(ple_served):
    """rig/plan/fit.py's verdict for the PLE demo (sliding and full attention layers, two of them sharing a cache),
    printed before its engine started, against vLLM's own capacity line: benchmarks/fit.py's PLE case, on the
    engine this module serves anyway."""
    r = ple_served[3]
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    said = re.search(r"fit: fits: ([\d.]+) requests of [\d,]+ tokens, KV cache size ([\d,]+) tokens", r.stdout)
    made = re.search(r"CPU KV cache size: ([\d,]+) tokens", r.stdout)
    assert said and made, r.stdout[-4000:]
    assert r.stdout.index(said[0]) < r.stdout.index("engine started")
    predicted, printed = int(said[2].replace(",", "")), int(made[1].replace(",", ""))
    assert abs(predicted / printed - 1) <= 0.05, (predicted, printed)
    print(f"\nfit, PLE demo: {predicted:,} tokens predicted, vLLM {printed:,} ({predicted / printed:.4f}x)")


def engine_group(env: dict) -> int:
    return tomllib_load(Path(env["RIG_STATE"]) / "engine.toml")["pgid"]


def the_child(pgid: int) -> list[psutil.Process]:
    return [p for p in in_group(pgid) if CHILD in " ".join(p.info["cmdline"] or [])]


def test_the_engine_serves_with_the_table_held_by_its_child(ple_served):
    dest, d, env, r, took = ple_served
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "profile: demo-ple" in r.stdout and "demo model: " in r.stdout, r.stdout[-3000:]
    code, text = completion(env, {"model": "demo-ple", "prompt": "hello there", "max_tokens": 8})
    assert code == 200, text
    child = the_child(engine_group(env))
    assert len(child) == 1, [p.info["cmdline"] for p in in_group(engine_group(env))]
    log = Path(env["LOG"]).read_text(errors="replace")
    assert f"(PLEServer pid={child[0].pid}) INFO {TABLE_LINE}" in log, log[-3000:]
    assert f"PLE offload: child {CHILD} is pid {child[0].pid}" in log, log[-3000:]
    # The worker reads the rows from the child's memory: a process of the engine (the engine core, or its
    # worker where the executor has one) maps the child's memfd, and holds no copy of its own
    def maps_table(p: psutil.Process) -> bool:
        try:
            return "/memfd:vllm-ple-table" in Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            return False

    readers = [p for p in in_group(engine_group(env)) if p.pid != child[0].pid and maps_table(p)]
    assert readers, "no process of the engine maps the child's table"
    print(f"\ndemo-ple with the offload: {took:.0f} s to healthy (the Gemma 3n made on the box included)")


def test_a_ple_home_the_engine_does_not_have_exits_2_before_anything_starts(ple_served, tmp_path):
    dest, _, _, _, _ = ple_served
    env = ple_env(dest, tmp_path, PLE_HOME="3")
    r = subprocess.run([str(dest / "start.sh"), "--no-build"], cwd=dest, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: PLE_HOME: expected 0 on the CPU build" in r.stderr and "found 3" in r.stderr, r.stderr
    assert not (tmp_path / "state" / "engine.toml").exists()


def test_the_outputs_are_the_same_with_the_offload_on_and_off_and_the_rows_are_the_tables(ple_served, tmp_path):
    """Greedy tokens and top-5 logprobs of in-process engines on the rig's own command: the table offloaded
    equals the table on the engine's own device, number for number; the rows the model looks up are the
    checkpoint's; and a checkpoint whose table differs gives other outputs (the table is read at all)."""
    dest, d, env, _, _ = ple_served
    args, engine_env = demo_command(dest, {**env, "RIG_STATE": str(tmp_path / "state")}, "--no-build")
    base = {**{k: v for k, v in env.items() if k not in SERIES_VARS},
            **{k: v for k, v in engine_env.items() if k not in SERIES_VARS}}
    ckpt = Path(env["RIG_CACHE"]) / "models" / "demo-ple"
    probe = str(Path(__file__).with_name("greedy_probe.py"))
    ids = "0,7,2047"
    python = str(dest / ".venv-cpu" / "bin" / "python")

    def run(name: str, model: Path, **extra: str) -> dict:
        out = tmp_path / f"{name}.json"
        p = subprocess.run([python, probe, str(out), str(model), *args], cwd=tmp_path,
                           env={**base, "PROBE_PLE_ROWS": ids, **extra}, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return {**json.loads(out.read_text()), "log": p.stdout + p.stderr}

    on, off = run("on", ckpt, PLE_OFFLOAD="1"), run("off", ckpt, PLE_OFFLOAD="0")
    assert TABLE_LINE in on["log"] and CHILD not in off["log"]
    assert on["tokens"] == off["tokens"] and on["logprobs"] == off["logprobs"]
    table = subprocess.run([python, "-c", "import sys, json; from safetensors import safe_open; "
                            "t = safe_open(sys.argv[1], 'pt').get_tensor('model.embed_tokens_per_layer.weight'); "
                            "print(json.dumps(t[[int(i) for i in sys.argv[2].split(',')]].float().tolist()))",
                            str(ckpt / "model.safetensors"), ids], capture_output=True, text=True, check=True)
    want = json.loads(table.stdout)
    for got in (on["ple_rows"], off["ple_rows"]):
        worst = max(abs(a - b) / max(abs(b), 1e-3) for ga, wa in zip(got, want, strict=True)
                    for a, b in zip(ga, wa, strict=True))
        assert worst < 1e-2, worst  # the checkpoint's rows (bf16, scaled and unscaled again)
    other = tmp_path / "other-table"
    subprocess.run([python, "-c", "import sys, shutil; from safetensors.torch import load_file, save_file; "
                    "shutil.copytree(sys.argv[1], sys.argv[2]); w = load_file(sys.argv[1] + '/model.safetensors'); "
                    "w['model.embed_tokens_per_layer.weight'] = w['model.embed_tokens_per_layer.weight'].flip(0); "
                    "save_file(w, sys.argv[2] + '/model.safetensors', metadata={'format': 'pt'})",
                    str(ckpt), str(other)], check=True)
    flipped = run("other", other, PLE_OFFLOAD="1")
    assert flipped["tokens"] != on["tokens"], "a different table gave the same outputs: the table is not read"


def test_kill_9_of_the_child_stops_the_engine_with_its_line_and_stop_leaves_nothing(ple_served):
    dest, d, env, r, _ = ple_served
    assert r.returncode == 0
    pgid = engine_group(env)
    (child,) = the_child(pgid)
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while [p for p in in_group(pgid) if "serve" in " ".join(p.info["cmdline"] or [])] \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    log = Path(env["LOG"]).read_text(errors="replace")
    assert f"PLE offload: the child {CHILD} (pid {child.pid}) ended with exit -9 while serving; the engine stops" \
        in log, log[-4000:]
    assert not [p for p in in_group(pgid) if "serve" in " ".join(p.info["cmdline"] or [])], "the engine did not stop"
    s = nox(dest, env, "-s", "stop")
    assert s.returncode == 0, s.stdout + s.stderr
    assert not in_group(pgid) and not engine_like(lambda p, cmd: os_pgid(p.pid) == pgid, dest)
    assert not [p for p in engine_like(lambda p, cmd: False, dest) if CHILD in (p.info["name"] or "")]
    assert not (Path(env["RIG_STATE"]) / "run").exists()
