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
    target <= 1.05x. Both are started last, each alone on the card, after (c) and (d), --start-pairs times in
    the order rig bare bare rig ...; the figure is the pairs' median ratio.
(b) the warm ``./start.sh`` against the cold one (an empty CACHE_ROOT, the model made on the box): target <= 0.6x.
(c) decode tokens/s through the rig's engine against the bare one, at concurrency 1 and 4. Both engines run at
    once on the card (the profile with ``memory_utilization`` 0.28 each), and the rounds alternate rig, bare,
    bare, rig ... so a drift of the card's clocks falls on both: each pair gives a ratio, and the figure is the
    pairs' median with its 95% interval (distribution-free, from the order statistics). Pairs are added (from
    --pairs up to --max-pairs) until that interval is within +/-2%: the rig adds nothing to the data path, so
    1.00x, and the line says whether the run resolves 2%.
(d) with a ``[speculative]`` profile: decode with it against the same checkpoint without it (a third engine, the
    profile with ``speculative = {}``), interleaved the same way, and the drafts' acceptance from the log.
(e) the card memory of the rig's engine (NVML, its processes) against the KV cache it reports.

The rig's cold start is the engine of (c) and (e); --decode-only leaves out (a) and (b), the two warm starts.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
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
RESOLVE = 0.02  # the precision the decode ratio is read at: pairs are added until its interval is within it


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


def median_interval(ratios: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median: the order statistics k and n + 1 - k, k the largest with
    P(Binomial(n, 1/2) < k) <= 2.5%. No k exists below 6 values: the whole range is given then."""
    r, n = sorted(ratios), len(ratios)
    k, below = 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return r[k - 1], r[n - k]


def resolved(ratios: list[float]) -> float:
    """The interval's half-width as a fraction of the median: the run tells apart what differs by more."""
    lo, hi = median_interval(ratios)
    return (hi - lo) / 2 / statistics.median(ratios)


def interleaved(a: dict, b: dict, model: str, concurrency: int, pairs: tuple[int, int], tokens: int,
                target: float = RESOLVE) -> dict:
    """Rounds of ``a`` and ``b`` in the order a b b a ...; per pair the ratio a / b. At least ``pairs[0]`` pairs,
    then more until the median's 95% interval is within +/-``target`` of it or ``pairs[1]`` pairs are done: the
    median ratio, that half-width, and each side's median rate."""
    for env in (a, b):
        decode(env, model, concurrency, 16)  # a warm-up request
    ra, rb, ratios = [], [], []
    while len(ratios) < pairs[0] or (len(ratios) < pairs[1] and resolved(ratios) > target):
        order = (a, b) if len(ratios) % 2 == 0 else (b, a)
        got = {id(env): decode(env, model, concurrency, tokens) for env in order}
        ra.append(got[id(a)])
        rb.append(got[id(b)])
        ratios.append(ra[-1] / rb[-1])
    return {"ratio": statistics.median(ratios), "within": resolved(ratios), "a": statistics.median(ra),
            "b": statistics.median(rb), "pairs": len(ratios)}


def warm_starts(env: dict, work: Path, log: Path, pairs: int) -> tuple[list[float], list[float]]:
    """``pairs`` warm starts of the rig and of the bare engine, each alone on the card, in the order rig bare bare
    rig ...: the seconds to healthy of each side."""
    rigs, bares = [], []
    for i in range(pairs):
        for side in ("rig", "bare") if i % 2 == 0 else ("bare", "rig"):
            if side == "rig":
                rigs.append(rig_start(env, log))
                rig_stop(env, log)
            else:
                bare = Bare(env, work / "bare-alone.log", work / f"bare-a{i}")
                bare.stop()
                card_free()
                bares.append(bare.took)
    return rigs, bares


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


def within(got: dict) -> str:
    """The decode ratio's precision, and whether it resolves what the figure is read at (RESOLVE)."""
    return (f"95% interval of the median +/-{got['within']:.1%} over {got['pairs']} pairs "
            f"({'resolves' if got['within'] <= RESOLVE else 'does not resolve'} {RESOLVE:.0%})")


def memory_line(used: float, kv_gib: float, kv_tokens: int, share: str) -> str:
    return (f"(e) the engine ({share}) holds {used} MiB of the card (NVML); its KV cache {kv_gib:.2f} GiB "
            f"({kv_gib * 1024 / used:.2f}x of it), {kv_tokens:,} tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="demo-gpu", help="the profile to serve (default demo-gpu)")
    ap.add_argument("--build", action="store_true", help="time ./build.sh on this checkout first (figure 0)")
    ap.add_argument("--pairs", type=int, default=8, help="interleaved pairs of decode rounds, at least (default 8)")
    ap.add_argument("--max-pairs", type=int, default=40, help="pairs, at most, while the median's 95%% interval is "
                    "wider than +/-2%% (default 40)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens a request in the decode rounds (default 512)")
    ap.add_argument("--quick", action="store_true", help="2 pairs of 128 tokens, one warm start each")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--start-pairs", type=int, default=3, help="warm starts of each, rig and bare, for (a) (default 3)")
    ap.add_argument("--no-drafts", action="store_true", help="leave out (d), the [speculative] figure")
    ap.add_argument("--decode-only", action="store_true", help="no warm restart, so no (a) and (b)")
    a = ap.parse_args()
    pairs, tokens = ((2, 2), 128) if a.quick else ((a.pairs, max(a.pairs, a.max_pairs)), a.tokens)
    a.start_pairs = 1 if a.quick else max(1, a.start_pairs)
    work = Path(tempfile.mkdtemp(prefix="gpu-figures-"))
    log = work / "run.log"
    p = profiles.load(a.profile)
    env = {**os.environ, "PROFILE": a.profile, "DEVICE": "cuda", "CACHE_ROOT": str(work / "cache"),
           "LOG": str(work / "vllm.log"), "PORT": str(free_port()), "VLLM_API_KEY": "",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    figures: dict[str, float] = {}
    lines = Said([f"profile {a.profile}; {pairs[0]} to {pairs[1]} pairs of rounds, {tokens} tokens a request"])
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
        model = p.served_name
        for c in (1, 4):
            got = interleaved(shared, engines[0].env, model, c, pairs, tokens)
            figures.update({f"decode_c{c}_ratio": got["ratio"], f"decode_c{c}_within": got["within"],
                            f"rig_decode_c{c}": got["a"], f"bare_decode_c{c}": got["b"]})
            lines.append(f"(c) decode at concurrency {c}: through the rig {got['a']:.0f} tok/s, bare {got['b']:.0f} "
                         f"tok/s: {got['ratio']:.3f}x, {within(got)} (target 1.00x)")
        if p.speculative and not a.no_drafts:
            engines.append(Bare({**shared, "PROFILE": made[1]}, work / "nospec.log", work / "bare-c"))
            for c in (1, 4):
                got = interleaved(engines[0].env, engines[1].env, model, c, pairs, tokens)
                figures.update({f"spec_c{c}_ratio": got["ratio"], f"spec_c{c}_within": got["within"]})
                lines.append(f"(d) decode at concurrency {c} with [speculative] {got['a']:.0f} tok/s, without "
                             f"{got['b']:.0f} tok/s: {got['ratio']:.3f}x, {within(got)}")
            lines.append(f"(d) {p.speculative}: {acceptance(work / 'bare.log')} (random weights accept few drafts)")
        if not a.decode_only:  # last, each alone on the card: a run cut short has the decode figures
            for e in engines:
                e.stop()
            engines.clear()
            rig_stop(shared, log)
            rigs, bares = warm_starts(shared, work, log, a.start_pairs)
            warm = statistics.median(rigs)
            ratios = [r / b for r, b in zip(rigs, bares, strict=True)]
            figures.update(rig_warm_s=warm, bare_warm_s=statistics.median(bares),
                           warm_ratio=statistics.median(ratios))
            lines.extend([f"(a) start to healthy, warm cache, {len(ratios)} pairs: ./start.sh "
                          f"{' '.join(f'{x:.1f}' for x in rigs)} s, bare vllm serve "
                          f"{' '.join(f'{x:.1f}' for x in bares)} s: median {statistics.median(ratios):.3f}x, "
                          f"pairs {min(ratios):.3f}-{max(ratios):.3f}x (target <= 1.05x)",
                          f"(b) ./start.sh warm {warm:.1f} s (median) against cold {cold:.1f} s: {warm / cold:.2f}x "
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
