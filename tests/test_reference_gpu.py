"""The reference model's shape on a real card: ``PROFILE=reference-tiny ./start.sh`` (models/reference-tiny.toml).

A tiny Qwen3-Next made on the box (rig/build/refshape.py): Gated DeltaNet and full attention, a W4A16 MoE in the
reference's compressed-tensors format, an MTP head; served with the reference's own settings: FP8 KV with its
scales sidecar, MTP K=3, CUDA graphs up to MAX_SEQS x (1 + K). Runs on a GPU box with the build current (the
offline bundle of docs/gpu.md: ``tests/gpu_box.sh BUNDLE reference``) and skips elsewhere: CI has no GPU.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import time
from pathlib import Path

import pytest
from test_gpu_serve import KEY, engine_state, free_port, log_of, nox, request, server_argv, wait_card_free

from rig.build.cudastub import driver_loadable
from rig.facts import slots
from rig.plan import serve
from rig.running import enginerec
from rig.running.health import health

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not driver_loadable(), reason="no NVIDIA driver here")]

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen38-flash-next"  # the reference's served name: the tiny profile inherits it
PROMPT = {"model": MODEL, "prompt": "the river runs to the sea and the", "max_tokens": 24, "temperature": 0,
          "logprobs": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": 64,
        "temperature": 0}
OUT_OF_VOCAB = {"model": MODEL, "prompt": [1, 2, 999999], "max_tokens": 4}
#: The greedy answer through the rig, kept for the tests that start other engines (also in a later pytest run).
def start(env: dict, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "start.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def greedy(env: dict) -> list[tuple[str, float]]:
    """The greedy completion: each token with its logprob."""
    code, text = request(env, "completions", PROMPT)
    assert code == 200, text
    lp = json.loads(text)["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], strict=True))


def safetensors_f32(path: Path, name: str, values: list[float]) -> None:
    """A one-tensor safetensors file, written by hand (the format: a little-endian header length, its JSON, data)."""
    header = json.dumps({name: {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, 4 * len(values)]}})
    header += " " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + struct.pack(f"<{len(values)}f", *values))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("reference")
    return {**os.environ, "PROFILE": "reference-tiny", "VLLM_API_KEY": KEY, "START_TIMEOUT": "1200",
            "CACHE_ROOT": os.environ.get("CACHE_ROOT") or str(d / "cache"), "LOG": str(d / "first.log"),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"), "PORT": str(free_port()),
            "GPU_WAIT": "120"}


@pytest.fixture(scope="module")
def served(base):
    env = {**base, "GUARD": "raise", "COUNTERS": "1"}
    t0 = time.monotonic()
    r = start(env)
    print(f"\nPROFILE=reference-tiny ./start.sh, cold: {time.monotonic() - t0:.1f} s")
    if r.returncode != 0:
        print((r.stdout + r.stderr)[-6000:])
        print(log_of(env)[-12000:])
    yield env, r
    nox(env, "-s", "stop")


def test_it_serves_with_the_wna16_moe_the_mtp_drafter_fp8_kv_and_cuda_graphs(served):
    env, r = served
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    out, log = r.stdout, log_of(env)
    assert "profile: reference-tiny" in out and "a one-token generation answered" in out, out[-3000:]
    argv = server_argv(engine_state())
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8", argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"max_cudagraph_capture_size": 16}, argv
    backend = re.search(r"Using '(\w+)' WNA16 MoE backend", log)
    assert backend, log[-4000:]
    assert "Resolved architecture: Qwen3NextMTP" in log, log[-4000:]  # the drafter vLLM loads for method mtp
    assert re.search(r"Capturing CUDA graphs \((?:[^)]*, )?PIECEWISE\)", log), log[-4000:]
    assert re.search(r"Capturing CUDA graphs \((?:[^)]*, )?FULL\)", log), log[-4000:]
    # patch 0004: the sidecar's 8 entries, two full-attention layers in the model (and the drafter's one layer)
    assert re.search(r"SCALES: k/v scales of 8 layers loaded from \S+qsa_kv_scales\.json \(2 attention layers here\)",
                     log), log[-4000:]
    print(f"\nWNA16 MoE backend: {backend[1]}; "
          + next(ln for ln in out.splitlines() if "KV cache size:" in ln).strip())
    for line in log.splitlines():
        if "Graph capturing finished" in line or "Available KV cache memory" in line or "drafter" in line.lower():
            print(line.strip()[-200:])


def test_mtp_acceptance_shows_in_vllm_logs(served):
    env, r = served
    assert r.returncode == 0
    for _ in range(4):
        assert request(env, "chat/completions", CHAT)[0] == 200
    time.sleep(2.5)  # the next stats line (VLLM_LOG_STATS_INTERVAL=1) and its SpecDecoding line
    shown = subprocess.run([str(ROOT / "vllm-logs.sh"), "--file", env["LOG"], "-n", "100000"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    mtp = re.findall(r"MTP len ([\d.]+|nan) accept ([\d.]+%|nan)", shown.stdout)
    assert mtp, shown.stdout[-3000:]
    print(f"\nvllm-logs.sh: MTP len {mtp[-1][0]} accept {mtp[-1][1]} (random weights: few drafts accepted)")


def test_guard_raise_answers_400_and_the_counters_show_it(served):
    env, r = served
    assert r.returncode == 0
    code, text = request(env, "completions", OUT_OF_VOCAB)
    assert code == 400 and "guard token_ids" in text, text
    assert request(env, "completions", {**PROMPT, "max_tokens": 4})[0] == 200  # it keeps serving
    time.sleep(2.5)
    shown = subprocess.run([str(ROOT / "vllm-logs.sh"), "--file", env["LOG"], "-n", "100000"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert re.search(r"guard [1-9]\d*/\d+/\d+", shown.stdout), shown.stdout[-2000:]


@pytest.fixture(scope="module")
def plain(served) -> list[tuple[str, float]]:
    """The greedy answer of the plain profile through the rig; its engine is stopped after it, so a test that
    starts its own (alone with -k, or after the tests of the served engine) finds the card free and no engine of
    this state running."""
    env, r = served
    assert r.returncode == 0
    got = greedy(env)
    assert nox(env, "-s", "stop").returncode == 0
    assert not wait_card_free()
    return got


def test_the_greedy_answer_through_the_rig(plain):
    assert plain and all(x == x for _, x in plain)  # finite logprobs
    print(f"\ngreedy through the rig: {[t for t, _ in plain]}")


def test_a_bare_vllm_serve_of_the_same_plan_gives_the_same_tokens_and_logprobs(base, plain, tmp_path):
    rig = plain
    env = {**base, "RIG_STATE": str(tmp_path / "state"), "PORT": str(free_port()), "GUARD": "raise", "COUNTERS": "1"}
    s = slots.settings(env)
    v, p = serve.inputs(s, env)
    plan = serve.plan(s, v, p, serve.check_box(s, v, p, check=False))
    enginerec.fresh_runtime(s)
    with open(tmp_path / "bare.log", "w") as fh:
        proc = subprocess.Popen(plan.engine.argv, env=plan.engine.full_env(env), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while not health(s.host, s.port, v.names[0], v.api_key, timeout=10, extra=p.health)[0]:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "bare.log").read_text()[-4000:]
            time.sleep(0.5)
        bare = greedy(env)
    finally:
        enginerec.terminate(proc.pid, 30)
        enginerec.clear_runtime(s)
    assert [t for t, _ in bare] == [t for t, _ in rig]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(bare, rig, strict=True))
    print(f"\nbare against the rig: tokens identical, largest logprob difference {worst:.2e}")
    assert worst <= 1e-4  # the same graphs compiled from the same cache: the numbers agree
    assert not wait_card_free()


def test_scales_that_saturate_change_the_greedy_tokens(base, plain, tmp_path):
    sidecar = tmp_path / "saturating.json"
    sidecar.write_text(json.dumps({"layers": [{"k_scale": 0.0005, "v_scale": 0.0005}] * 8}))
    env = {**base, "SCALES": str(sidecar), "LOG": str(tmp_path / "scales.log"), "PORT": str(free_port())}
    r = start(env)
    try:
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert f"SCALES: k/v scales of 8 layers loaded from {sidecar}" in log_of(env)
        got = greedy(env)
    finally:
        nox(env, "-s", "stop")
    print(f"\ngreedy with saturating scales: {[t for t, _ in got]}")
    assert [t for t, _ in got] != [t for t, _ in plain]
    assert not wait_card_free()


def test_an_abliteration_direction_changes_the_greedy_tokens(base, plain, tmp_path):
    """A direction set of this model's hidden size (128), for every layer: patch 0005 orthogonalises it out."""
    import random

    rnd = random.Random(5)
    safetensors_f32(tmp_path / "tiny-direction.safetensors", "direction", [rnd.gauss(0, 1) for _ in range(128)])
    env = {**base, "QWEN38_ABLITERATION": "tiny-direction", "ABLITERATION_DIR": str(tmp_path),
           "LOG": str(tmp_path / "abl.log"), "PORT": str(free_port())}
    r = start(env)
    try:
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        log = log_of(env)
        assert "QWEN38_ABLITERATION: direction set tiny-direction" in log, log[-4000:]
        got = greedy(env)
    finally:
        nox(env, "-s", "stop")
    print(f"\ngreedy with the direction abliterated: {[t for t, _ in got]}")
    assert [t for t, _ in got] != [t for t, _ in plain]
