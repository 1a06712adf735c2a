# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""The rig on a GPU against the bare engine, in one run on the card (docs/gpu.md quotes it).

  python3 benchmarks/gpu_figures.py [--profile P] [--build] [--pairs N] [--tokens N] [--out FILE]
      (on the GPU box; TORCH/PYTHON/OFFLINE as the build has them; --quick: few, short rounds)

Each figure is a ratio against a baseline of the same run:
(0) --build: ``./build.sh`` on this (fresh) checkout, then again: the first build's time against the no-op's.
(a) ``./start.sh`` (PROFILE, default demo-gpu) to healthy with a warm compile cache, against bare ``vllm serve``
    of the same command and environment (the rig's own plan) polled with one-token requests every 0.5 s:
    target <= 1.05x. The bare one starts beside the rig's idle engine (the two share the card for (c)), and the
    rig's warm restart comes last, beside the idle bare engines.
(b) the warm ``./start.sh`` against the cold one (an empty CACHE_ROOT, the model made on the box): target <= 0.6x.
(c) decode tokens/s through the rig's engine against the bare one, at concurrency 1 and 4. Both engines run at
    once on the card (the profile with ``memory_utilization`` 0.28 each), and the rounds alternate rig, bare,
    bare, rig ... so a drift of the card's clocks falls on both: each pair gives a ratio, and the figure is the
    pairs' median with their spread (the half-width of the middle half): the rig adds nothing to the data path,
    so 1.00x, and a spread above 2% says the run cannot tell 2% apart (more pairs or longer answers).
(d) with a ``[speculative]`` profile: decode with it against the same checkpoint without it (a third engine, the
    profile with ``speculative = {}``), interleaved the same way, and the drafts' acceptance from the log.
(e) the card memory of the rig's engine (NVML, its processes) against the KV cache it reports.

Every start is one the figures need: the rig's cold start, its warm restart, the bare engine and the one without
drafts; the engines of (c) and (d) are those of (a) and (b). --decode-only leaves out the warm restart, so (a)
and (b) too.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.facts import profiles, slots  # noqa: E402
from rig.plan import box, serve  # noqa: E402
from rig.running import enginerec  # noqa: E402
from rig.running.health import health  # noqa: E402

PROMPT = "Write a long story about the sea, the river and the town between them."
SHARE = 0.28  # of the card for each engine of (c) and (d): three fit at once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def card_free(limit: float = 90) -> None:
    """Wait until no compute process holds the card (the last engine's memory released)."""
    deadline = time.monotonic() + limit
    while box.read_nvml().gpus[0].compute_processes and time.monotonic() < deadline:
        time.sleep(0.5)


def timed_run(cmd: list[str], env: dict, log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "a") as fh:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    took = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {r.returncode}): see {log}")
    return took


def rig_start(env: dict, log: Path) -> float:
    return timed_run([str(ROOT / "start.sh")], env, log)


def rig_stop(env: dict, log: Path, wait_free: bool = True) -> None:
    timed_run([str(ROOT / "scripts" / "nox.sh"), "-s", "stop"], env, log)
    if wait_free:
        card_free()


class Bare:
    """The rig's own engine command and environment run as a bare ``vllm serve`` (its own state folder, so its
    runtime folder is apart from the rig's)."""

    def __init__(self, env: dict, log: Path, state: Path) -> None:
        self.env = {**env, "RIG_STATE": str(state), "PORT": str(free_port())}
        s = slots.settings(self.env)
        v, p = serve.inputs(s, self.env)
        plan = serve.plan(s, v, p, serve.check_box(s, v, p, check=False))
        enginerec.fresh_runtime(s)
        self.s, fh = s, open(log, "a")  # noqa: SIM115 - the engine writes it until it is killed
        t0 = time.monotonic()
        self.proc = subprocess.Popen(plan.engine.argv, env=plan.engine.full_env(self.env), stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"bare vllm serve ended (exit {self.proc.returncode}): see {log}")
            if health(s.host, s.port, v.names[0], v.api_key, timeout=10, extra=p.health)[0]:
                self.took = time.monotonic() - t0
                return
            time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        enginerec.clear_runtime(self.s)


def decode(env: dict, model: str, concurrency: int, tokens: int) -> float:
    """Generated tokens per second over ``concurrency`` parallel requests of ``tokens`` each (one round)."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if env.get("VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {env['VLLM_API_KEY']}"

    def one() -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{env['PORT']}/v1/completions", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        done = sum(ex.map(lambda _: one(), range(concurrency)))
    return done / (time.monotonic() - t0)


def interleaved(a: dict, b: dict, model: str, concurrency: int, pairs: int, tokens: int) -> dict:
    """Rounds of ``a`` and ``b`` in the order a b b a ...; per pair the ratio a / b; the median ratio and the
    half-width of the middle half of the ratios (as a fraction), with each side's median rate."""
    for env in (a, b):
        decode(env, model, concurrency, 16)  # a warm-up request
    ra, rb, ratios = [], [], []
    for i in range(pairs):
        order = (a, b) if i % 2 == 0 else (b, a)
        got = {id(env): decode(env, model, concurrency, tokens) for env in order}
        ra.append(got[id(a)])
        rb.append(got[id(b)])
        ratios.append(ra[-1] / rb[-1])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    med = statistics.median(ratios)
    return {"ratio": med, "spread": (q[2] - q[0]) / 2 / med, "a": statistics.median(ra), "b": statistics.median(rb),
            "pairs": pairs}


def variant(base: str, name: str, text: str) -> str:
    """A profile of this run on ``base`` (models/NAME.toml, removed at the end; git ignores models/bench-*.toml, so
    a copy of the working tree made while it runs keeps it): the profile's own everything else."""
    (profiles.MODELS_DIR / f"{name}.toml").write_text(f'base = "{base}"\n{text}')
    return name


def acceptance(log: Path) -> str:
    """The last SpecDecoding line's acceptance (vLLM's spec-decode metrics), or why there is none."""
    found = re.findall(r"Mean acceptance length: ([\d.]+).*Avg Draft acceptance rate: ([\d.]+)%",
                       log.read_text(errors="replace"))
    return f"mean accepted length {found[-1][0]}, draft acceptance {found[-1][1]}%" if found else "no metrics line"


def memory(env: dict, log: Path) -> tuple[float, float, int]:
    """(MiB of the card the rig's engine holds (NVML), GiB of KV cache it reports, its KV cache tokens)."""
    rec = enginerec.load(slots.settings(env))
    held = box.read_nvml().gpus[0].mib_by_process()
    mine = sum(mib for pid, mib in held.items() if rec and pid in enginerec.group_members(rec.pgid))
    text = log.read_text(errors="replace")
    kv = re.findall(r"Available KV cache memory: ([\d.]+) GiB", text)
    tokens = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
    return mine, float(kv[-1]) if kv else 0.0, int(tokens[-1].replace(",", "")) if tokens else 0


class Said(list):
    """The figures' lines, each printed as it is added: a run cut off (a device's time limit) keeps what it got."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.extend(lines)

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)

    def extend(self, lines) -> None:  # noqa: ANN001 - an iterable of str
        for line in lines:
            self.append(line)


def memory_line(used: float, kv_gib: float, kv_tokens: int, share: str) -> str:
    return (f"(e) the engine ({share}) holds {used} MiB of the card (NVML); its KV cache {kv_gib:.2f} GiB "
            f"({kv_gib * 1024 / used:.2f}x of it), {kv_tokens:,} tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="demo-gpu", help="the profile to serve (default demo-gpu)")
    ap.add_argument("--build", action="store_true", help="time ./build.sh on this checkout first (figure 0)")
    ap.add_argument("--pairs", type=int, default=8, help="interleaved pairs of decode rounds (default 8)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens a request in the decode rounds (default 512)")
    ap.add_argument("--quick", action="store_true", help="2 pairs of 128 tokens")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--decode-only", action="store_true", help="no warm restart, so no (a) and (b)")
    a = ap.parse_args()
    pairs, tokens = (2, 128) if a.quick else (a.pairs, a.tokens)
    work = Path(tempfile.mkdtemp(prefix="gpu-figures-"))
    log = work / "run.log"
    p = profiles.load(a.profile)
    env = {**os.environ, "PROFILE": a.profile, "DEVICE": "cuda", "CACHE_ROOT": str(work / "cache"),
           "LOG": str(work / "vllm.log"), "PORT": str(free_port()), "VLLM_API_KEY": "",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    figures: dict[str, float] = {}
    lines = Said([f"profile {a.profile}; {pairs} pairs of rounds, {tokens} tokens a request"])
    if a.build and (ROOT / "vllm").exists():  # a second build here is the no-op, not the figure (0) stands for
        lines.append(f"(0) not measured: {ROOT} is built already; --build times the first build of a fresh checkout")
    elif a.build:
        first = timed_run([str(ROOT / "build.sh")], env, log)
        again = timed_run([str(ROOT / "build.sh")], env, log)
        figures.update(build_s=first, noop_build_s=again)
        lines.append(f"(0) ./build.sh on a fresh checkout{' from the offline bundle' if env.get('OFFLINE') else ''}: "
                     f"{first:.1f} s; the no-op build after it {again:.2f} s ({first / again:.0f}x)")
    card_free()
    made = [variant(a.profile, f"bench-{a.profile}", f"memory_utilization = {SHARE}\n")]
    if p.speculative:
        made.append(variant(a.profile, f"bench-{a.profile}-nospec",
                            f"memory_utilization = {SHARE}\nspeculative = {{}}\n"))
    engines: list[Bare] = []
    shared = {**env, "PROFILE": made[0], "GPU_WAIT": "0", "LOG": str(work / "shared.log")}
    try:
        cold = rig_start(shared, log)
        used, kv_gib, kv_tokens = memory(shared, Path(shared["LOG"]))
        figures.update(engine_mib=used, kv_gib=kv_gib, kv_tokens=kv_tokens, rig_cold_s=cold)
        lines.append(memory_line(used, kv_gib, kv_tokens, f"memory_utilization {SHARE}"))
        engines.append(Bare(shared, work / "bare.log", work / "bare-b"))
        figures.update(bare_warm_s=engines[0].took)
        model = p.served_name
        for c in (1, 4):
            got = interleaved(shared, engines[0].env, model, c, pairs, tokens)
            figures.update({f"decode_c{c}_ratio": got["ratio"], f"decode_c{c}_spread": got["spread"],
                            f"rig_decode_c{c}": got["a"], f"bare_decode_c{c}": got["b"]})
            lines.append(f"(c) decode at concurrency {c}: through the rig {got['a']:.0f} tok/s, bare {got['b']:.0f} "
                         f"tok/s: {got['ratio']:.3f}x, spread +/-{got['spread']:.1%} over {pairs} pairs (target "
                         f"1.00x; {'resolves' if got['spread'] <= 0.02 else 'does not resolve'} 2%)")
        if p.speculative:
            engines.append(Bare({**shared, "PROFILE": made[1]}, work / "nospec.log", work / "bare-c"))
            for c in (1, 4):
                got = interleaved(engines[0].env, engines[1].env, model, c, pairs, tokens)
                figures.update({f"spec_c{c}_ratio": got["ratio"], f"spec_c{c}_spread": got["spread"]})
                lines.append(f"(d) decode at concurrency {c} with [speculative] {got['a']:.0f} tok/s, without "
                             f"{got['b']:.0f} tok/s: {got['ratio']:.2f}x, spread +/-{got['spread']:.1%}")
            lines.append(f"(d) {p.speculative}: {acceptance(work / 'bare.log')} (random weights accept few drafts)")
        if not a.decode_only:  # last: a run cut short by a device's time limit has the decode figures
            rig_stop(shared, log)
            warm = rig_start(shared, log)
            figures.update(rig_warm_s=warm)
            lines.extend([f"(a) start to healthy, warm cache: ./start.sh {warm:.1f} s, bare vllm serve "
                          f"{engines[0].took:.1f} s: {warm / engines[0].took:.2f}x (target <= 1.05x)",
                          f"(b) ./start.sh warm {warm:.1f} s against cold {cold:.1f} s: {warm / cold:.2f}x "
                          f"(target <= 0.6x)"])
    finally:
        for e in engines:
            e.stop()
        rig_stop(shared, log, wait_free=False)
        for name in made:
            (profiles.MODELS_DIR / f"{name}.toml").unlink(missing_ok=True)
    if a.out:
        a.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
