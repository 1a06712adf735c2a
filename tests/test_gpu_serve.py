"""The rig's own serve path on a real GPU: ``./start.sh --demo`` on the CUDA build, on the card, through NVML.

Runs on a GPU box with the build current (``./build.sh`` first; on the H200 of docs/gpu.md with ``TORCH=host``
from an offline bundle) and skips elsewhere: CI has no GPU. Every engine here is the real patched v0.30.0 on the
card: the demo model (models/demo-gpu.toml), FP8 KV with its scales sidecar, CUDA graphs up to MAX_SEQS x 4.

  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu tests/test_gpu_serve.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.build.cudastub import driver_loadable  # noqa: E402 - standard library only
from rig.plan import box  # noqa: E402 - NVML is imported when read_nvml runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not driver_loadable(), reason="no NVIDIA driver here")]

KEY = "gpu-test-key"
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": 48,
        "temperature": 0}
PROMPT = {"model": "demo", "prompt": "the river runs to the sea and the", "max_tokens": 24, "temperature": 0}
OUT_OF_VOCAB = {"model": "demo", "prompt": [1, 2, 999999], "max_tokens": 4}


def request(env: dict, route: str, body: dict, timeout: float = 120) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{env['PORT']}/v1/{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def greedy(env: dict) -> list[tuple[str, float]]:
    """The greedy completion: each token with its logprob (rounded: a change beyond noise is a real change)."""
    code, text = request(env, "completions", {**PROMPT, "logprobs": 1})
    assert code == 200, text
    lp = json.loads(text)["choices"][0]["logprobs"]
    return [(tok, round(x, 2)) for tok, x in zip(lp["tokens"], lp["token_logprobs"], strict=True)]


def nox(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "nox.sh"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def start(env: dict, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "start.sh"), "--demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def used_mib() -> dict[int, int]:
    """pid -> MiB of the card each compute process holds, from NVML."""
    return box.read_nvml().gpus[0].mib_by_process()


def engine_pids(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def engine_state() -> dict:
    import tomllib

    return tomllib.loads((ROOT / ".rig" / "engine.toml").read_text())


def api_server(rec: dict) -> psutil.Process:
    """The engine group's ``vllm serve`` process."""
    return next(p for p in psutil.process_iter(["pid", "cmdline"])
                if p.pid in engine_pids(rec["pgid"]) and "serve" in (p.info["cmdline"] or [])[:3])


def server_argv(rec: dict) -> list[str]:
    return api_server(rec).info["cmdline"]


def wait_card_free(limit: float = 60) -> dict[int, int]:
    deadline = time.monotonic() + limit
    while (held := used_mib()) and time.monotonic() < deadline:
        time.sleep(1)
    return held


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """The environment every start here shares: the caller's (TORCH, PYTHON, OFFLINE, CUDA_VISIBLE_DEVICES), a
    key, one compile cache (so only the first start compiles), a log of its own per start."""
    d = tmp_path_factory.mktemp("gpu")
    cache = os.environ.get("CACHE_ROOT") or str(d / "cache")
    return {**os.environ, "VLLM_API_KEY": KEY, "START_TIMEOUT": "900", "CACHE_ROOT": cache,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"), "LOG": str(d / "first.log"),
            "PORT": str(free_port()), "GPU_WAIT": "120"}


@pytest.fixture(scope="module")
def served(base):
    env = {**base, "GUARD": "raise", "COUNTERS": "1"}
    t0 = time.monotonic()
    r = start(env)
    took = time.monotonic() - t0
    print(f"\n./start.sh --demo on the GPU, cold compile cache: {took:.1f} s")
    yield env, r
    nox(env, "-s", "stop")


def log_of(env: dict) -> str:
    return Path(env["LOG"]).read_text(errors="replace")


def test_start_serves_the_demo_on_the_gpu_with_fp8_kv_and_cuda_graphs(served):
    env, r = served
    out = r.stdout
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert "profile: demo-gpu" in out and "the cuda build" in out
    assert re.search(r"box: \d+ checks passed", out), out[-3000:]
    assert "topology: TP1 x PP1 on cards 0" in out
    argv = server_argv(engine_state())  # what the engine runs with, not what the rig says it asked for
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8", argv
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"max_cudagraph_capture_size": 16}, argv
    assert "GPU KV cache size:" in out and "a one-token generation answered" in out
    log = log_of(env)
    assert re.search(r"SCALES: k/v scales of 2 layers loaded from \S+qsa_kv_scales\.json", log), log[-3000:]
    assert "Capturing CUDA graphs" in log or "cudagraph" in log.lower()
    print(next(ln for ln in out.splitlines() if "GPU KV cache size:" in ln))


def test_guard_raise_answers_400_and_the_counters_reach_the_stats_line(served):
    env, r = served
    assert r.returncode == 0
    code, text = request(env, "completions", OUT_OF_VOCAB)
    assert code == 400 and "guard" in text.lower(), text
    for _ in range(3):
        assert request(env, "chat/completions", CHAT)[0] == 200
    time.sleep(2.5)
    out = subprocess.run([str(ROOT / "vllm-logs.sh"), "--file", env["LOG"], "-n", "100000"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    gen = [float(x) for x in re.findall(r"gen\s+([\d.]+) tok/s", out.stdout)]
    assert gen and max(gen) > 0, out.stdout[-2000:]
    assert re.search(r"guard [1-9]\d*/\d+/\d+", out.stdout), out.stdout[-2000:]


def test_status_and_doctor_on_the_gpu(served):
    env, r = served
    assert r.returncode == 0
    s = nox(env, "-s", "status")
    assert s.returncode == 0, s.stdout + s.stderr
    assert "health: ok (one token generated)" in s.stdout and "GPU KV cache size:" in s.stdout
    d = nox(env, "-s", "doctor")
    assert "H200" in d.stdout or "NVIDIA" in d.stdout, d.stdout + d.stderr
    print(d.stdout[-1500:])


def test_bench_sh_measures_the_engine_on_the_gpu(served, tmp_path):
    env, r = served
    assert r.returncode == 0
    results = tmp_path / "results"
    b = subprocess.run([str(ROOT / "benchmarks" / "bench.sh"), "256", "64", "1 4", "0", "--runs", "1",
                        "--skip-coherence", "--results-dir", str(results)], cwd=ROOT,
                       env={**env, "PROFILE": "demo-gpu"}, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, (b.stdout + b.stderr)[-4000:]
    folder = Path(next(ln for ln in b.stdout.splitlines() if ln.startswith("results: ")).removeprefix("results: "))
    report = json.loads((folder / "llama-benchy.json").read_text())
    assert sorted(x["concurrency"] for x in report["benchmarks"]) == [1, 4]
    print("\n" + (folder / "results.md").read_text()[-2500:])


def test_a_killed_api_server_keeps_the_card_until_stop(served, base):
    """kill -9 of the API server leaves the EngineCore holding the card; status names it, stop frees it. This
    engine serves with GUARD=warn and a sidecar whose scales saturate the FP8 cache, which changes the output."""
    env0, r = served
    assert r.returncode == 0
    before = greedy(env0)
    assert nox(env0, "-s", "stop").returncode == 0
    sidecar = Path(base["CACHE_ROOT"]).parent / "saturating.json"
    sidecar.write_text(json.dumps({"layers": [{"k_scale": 0.0005, "v_scale": 0.0005}] * 2}))
    env = {**base, "GUARD": "warn", "SCALES": str(sidecar), "LOG": str(sidecar.with_suffix(".log"))}
    r2 = start(env)
    assert r2.returncode == 0, (r2.stdout + r2.stderr)[-4000:]
    assert f"SCALES: k/v scales of 2 layers loaded from {sidecar}" in log_of(env)
    code, text = request(env, "completions", OUT_OF_VOCAB)
    assert code != 200 and "guard token_ids" in log_of(env), (code, text)  # warn: counted and logged, upstream answers
    after = greedy(env)
    print(f"\ngreedy tokens, scales 1.0: {before}\ngreedy tokens, scales 0.0005 (saturating): {after}")
    assert after != before
    rec = engine_state()
    server = api_server(rec)
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    time.sleep(3)
    left = engine_pids(rec["pgid"])
    held = used_mib()
    assert left and held, (left, held)  # EngineCore is left, and the card's memory is still held (NVML)
    print(f"after kill -9 of the API server: {held} MiB held by {left}")
    st = nox(env, "-s", "status")
    assert st.returncode == 1 and "is gone, but processes of its group are left" in st.stdout, st.stdout + st.stderr
    sp = nox(env, "-s", "stop")
    assert sp.returncode == 0 and "no process of it is left" in sp.stdout, sp.stdout + sp.stderr
    assert not wait_card_free(), used_mib()


def test_the_gate_waits_for_a_process_holding_the_card_then_starts(base):
    """A second CUDA process holds 20 GiB: start waits, names it, and starts once it lets go."""
    holder = subprocess.Popen([os.environ.get("PYTHON", sys.executable), "-c",
                               "import torch, time; x = torch.empty(20 << 30, dtype=torch.uint8, device='cuda'); "
                               "print('holding', flush=True); time.sleep(25)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    env = {**base, "LOG": str(Path(base["CACHE_ROOT"]).parent / "gate.log"), "QWEN38_ABLITERATION": ""}
    t0 = time.monotonic()
    r = start(env)
    waited = time.monotonic() - t0
    holder.wait(60)
    try:
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        text = r.stdout + r.stderr
        assert f"pid {holder.pid}" in text and "GiB" in text, text[-3000:]
        print(f"\nthe gate waited for pid {holder.pid}; start took {waited:.0f} s")
    finally:
        nox(env, "-s", "stop")
    assert not wait_card_free()


def test_abliteration_on_changes_the_output_and_foreground_sigterm_frees_the_card(base, tmp_path):
    """--foreground with the demo's direction set abliterated (GUARD=off): the output differs from the plain
    engine's; SIGTERM to the supervisor leaves no process and the card free."""
    env = {**base, "LOG": str(tmp_path / "plain.log"), "GUARD": "off"}
    r = start(env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    plain = greedy(env)
    code, _ = request(env, "completions", OUT_OF_VOCAB)
    assert code != 200 and "guard token_ids" not in log_of(env)  # off: nothing checked, nothing counted
    nox(env, "-s", "stop")
    wait_card_free()
    sets = tmp_path / "sets"
    sets.mkdir()
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                    "import sys, torch; from safetensors.torch import save_file; torch.manual_seed(7); "
                    "v = torch.randn(256); save_file({'direction': v / v.norm()}, sys.argv[1])",
                    str(sets / "demo-direction.safetensors")], check=True)
    fg = {**env, "LOG": str(tmp_path / "abl.log"), "QWEN38_ABLITERATION": "demo-direction",
          "ABLITERATION_DIR": str(sets)}
    p = subprocess.Popen([str(ROOT / "start.sh"), "--demo", "--foreground"], cwd=ROOT, env=fg,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout or []), daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not any("ready in" in ln for ln in lines) and p.poll() is None:
        time.sleep(1)
    assert any("ready in" in ln for ln in lines), "".join(lines)[-3000:]
    abl = greedy(fg)
    print(f"\ngreedy tokens, plain: {plain}\ngreedy tokens, abliterated: {abl}")
    assert abl != plain
    assert "abliteration" in log_of(fg).lower()
    p.send_signal(signal.SIGTERM)
    assert p.wait(120) == 0, "".join(lines)[-3000:]
    assert not wait_card_free(30), used_mib()
    assert not [q for q in psutil.process_iter(["name"]) if "VLLM::" in (q.info["name"] or "")]


def test_a_real_hang_is_caught_by_the_watchdog_and_the_foreground_supervisor_exits_1(base, tmp_path):
    """SIGSTOP of the EngineCore with a request pending: no token for HANG_WINDOW, so the supervisor ends the
    engine and exits 1 (systemd would restart it)."""
    env = {**base, "LOG": str(tmp_path / "hang.log"), "HANG_WINDOW": "20", "STOP_TIMEOUT": "5"}
    p = subprocess.Popen([str(ROOT / "start.sh"), "--demo", "--foreground"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout or []), daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not any("ready in" in ln for ln in lines) and p.poll() is None:
        time.sleep(1)
    assert any("ready in" in ln for ln in lines), "".join(lines)[-3000:]
    core = [q for q in psutil.process_iter(["name"]) if "EngineCore" in (q.info["name"] or "")]
    assert core, "no VLLM::EngineCore process"
    long = {**CHAT, "max_tokens": 30000, "ignore_eos": True}  # running in a step when the core stops
    threading.Thread(target=lambda: request(env, "chat/completions", long, timeout=400), daemon=True).start()
    time.sleep(3)
    for q in core:
        q.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    code = p.wait(300)
    took = time.monotonic() - t0
    text = "".join(lines)
    print(f"\nhang caught and the engine ended {took:.0f} s after SIGSTOP (HANG_WINDOW=20)")
    assert code == 1, text[-3000:]
    assert "hung" in text.lower(), text[-3000:]
    assert took < 20 + 90
    assert not wait_card_free(60), used_mib()
