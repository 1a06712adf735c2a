# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""The PLE offload (patch 0007) on one GPU: the same engine with the table in host RAM and on the card.

  python3 benchmarks/ple_offload.py [--quick] [--out FILE]   (on a GPU box with the CUDA build current)

Serves PROFILE=demo-ple-gpu (a tiny Gemma 3n with a 2 GiB per-layer-embedding table, made on the box; a fixed
KV cache size) through the rig twice, PLE_OFFLOAD=1 then 0, and prints each figure as a ratio in the run:
(a) the card memory the engine's processes hold (NVML), off minus on, against the table's size: target 1.00x
    (within 0.05);
(b) the host memory of the engine's processes (PSS, so the table shared by the child and the worker counts
    once), on minus off, against the table's size;
(c) decode tokens/s with the offload on against off, at concurrency 1 and 4 (256 tokens a request, the median
    of 3 rounds; --quick: 1);
(d) greedy completions of fixed prompts (16 tokens, top-5 logprobs): how many have the same tokens on and off,
    and the largest logprob difference, against that of a third start with the offload off (the card's own
    run-to-run difference: torch.compile picks kernels by timing them).
With ``--out`` it also writes what it saw (outputs, memory, the child's pid, whether NVML lists it, whether it
maps the CUDA driver) as JSON: tests/test_ple_gpu.py asserts on that file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_figures import card_free, decode, free_port, timed_run  # noqa: E402

from rig.facts.slots import settings  # noqa: E402
from rig.plan import box, ple  # noqa: E402
from rig.running import enginerec  # noqa: E402

PROFILE = "demo-ple-gpu"
MODEL = "demo-ple"
CHILD = "VLLM::PLEServer"
PROMPTS = ("the river runs to the sea and the", "a town between two hills", "tell me about the harbour at night",
           "one two three four five six")


def engine_processes(env: dict) -> list[psutil.Process]:
    """The live processes of the engine's group, from the engine's record."""
    rec = enginerec.load(settings(env))
    assert rec is not None, "the engine left no record"
    return [psutil.Process(pid) for pid in enginerec.group_members(rec.pgid)]


def card_mib() -> dict[int, int]:
    """pid -> MiB of card 0 that each compute process holds (NVML)."""
    return box.read_nvml().gpus[0].mib_by_process()


def greedy(env: dict) -> list[dict]:
    """Each prompt's greedy tokens and top-5 logprobs, exactly as the engine returned them."""
    out = []
    for prompt in PROMPTS:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                           "logprobs": 5}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{env['PORT']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.loads(r.read())["choices"][0]["logprobs"]
        out.append({"tokens": lp["tokens"], "logprobs": lp["token_logprobs"], "top": lp["top_logprobs"]})
    return out


def table_resident_mib(pid: int) -> float:
    """The child's memfd table as resident in RAM (its pages, whoever maps them): 0 when it holds none."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:vllm-ple-table"):
                return os.stat(fd).st_blocks * 512 / 2**20
        except OSError:
            continue
    return 0.0


def largest_difference(a: list[dict], b: list[dict]) -> float:
    """The largest difference between two runs' logprobs, chosen tokens' and top-5 alike (inf where the tokens or
    the top-5 sets differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x["tokens"] != y["tokens"]:
            return float("inf")
        worst = max([worst, *(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True))])
        for tx, ty in zip(x["top"], y["top"], strict=True):
            if set(tx) != set(ty):
                return float("inf")
            worst = max([worst, *(abs(tx[k] - ty[k]) for k in tx)])
    return worst


def measure(env: dict, work: Path, offload: str, rounds: int, name: str) -> dict:
    """One start with PLE_OFFLOAD=``offload``: what the engine holds, its outputs and (rounds > 0) its decode
    rates."""
    env = {**env, "PLE_OFFLOAD": offload, "LOG": str(work / f"vllm-{name}.log")}
    card_free()
    took = timed_run([str(ROOT / "start.sh")], env, work / "run.log")
    try:
        procs = engine_processes(env)
        held = card_mib()
        child = [p for p in procs if CHILD in " ".join(p.cmdline())]
        rec: dict = {"start_s": took, "card_mib": sum(held.get(p.pid, 0) for p in procs),
                     "host_pss_mib": sum(p.memory_full_info().pss for p in procs) / 2**20,
                     "outputs": greedy(env), "child": None}
        if child:
            c = child[0]
            maps = Path(f"/proc/{c.pid}/maps").read_text()
            rec["child"] = {"pid": c.pid, "in_nvml": c.pid in held, "maps_libcuda": "libcuda" in maps,
                            "rss_mib": c.memory_info().rss / 2**20, "table_mib": table_resident_mib(c.pid)}
        rec["decode"] = {c: decode(env, c, rounds=rounds, model=MODEL) for c in (1, 4)} if rounds else {}
        rec["log"] = Path(env["LOG"]).read_text(errors="replace")[-200_000:]
    finally:
        timed_run([str(ROOT / "scripts" / "nox.sh"), "-s", "stop"], env, work / "run.log")
        card_free()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write what it saw as JSON here")
    ap.add_argument("--quick", action="store_true", help="one decode round instead of three")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ple-offload-"))
    env = {**os.environ, "PROFILE": PROFILE, "DEVICE": "cuda", "CACHE_ROOT": str(work / "cache"),
           "PORT": str(free_port()), "VLLM_API_KEY": "", "START_TIMEOUT": "900",
           "RIG_STATE": os.environ.get("RIG_STATE", str(ROOT / ".rig")),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    rounds = 1 if a.quick else 3
    on = measure(env, work, "1", rounds, "on")
    off = measure(env, work, "0", rounds, "off")
    again = measure(env, work, "0", 0, "off-again")  # the card's own run-to-run noise, for (d)
    name, nbytes = ple.table_bytes(settings(env).ckpt) or ("none", 0)
    table = nbytes / 2**20
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(on["outputs"], off["outputs"], strict=True))
    diff, noise = largest_difference(on["outputs"], off["outputs"]), largest_difference(off["outputs"],
                                                                                       again["outputs"])
    card, host = off["card_mib"] - on["card_mib"], on["host_pss_mib"] - off["host_pss_mib"]
    print(f"(a) card memory of the engine (NVML): offload on {on['card_mib']:,} MiB, off {off['card_mib']:,} MiB; "
          f"off - on = {card:,} MiB against the table's {table:,.0f} MiB: {card / table:.2f}x (target 1.00x)")
    print(f"(b) host memory of the engine's processes (PSS): on {on['host_pss_mib']:,.0f} MiB, off "
          f"{off['host_pss_mib']:,.0f} MiB; on - off = {host:,.0f} MiB against the table's {table:,.0f} MiB: "
          f"{host / table:.2f}x")
    for c in (1, 4):
        print(f"(c) decode at concurrency {c}: offload on {on['decode'][c]:.0f} tok/s, off {off['decode'][c]:.0f} "
              f"tok/s: {on['decode'][c] / off['decode'][c]:.2f}x")
    print(f"(d) greedy completions, tokens identical on and off: {same} of {len(PROMPTS)} "
          f"({same / len(PROMPTS):.2f}x); the largest logprob difference on against off {diff:.1e}, off against "
          f"off again {noise:.1e}")
    child = on["child"] or {}
    print(f"    the child {CHILD}: pid {child.get('pid')}, in NVML's process list: {child.get('in_nvml')}, maps the "
          f"CUDA driver: {child.get('maps_libcuda')}; starts {on['start_s']:.0f} s (on), {off['start_s']:.0f} s (off)")
    if a.out:
        a.out.write_text(json.dumps({"table": {"name": name, "bytes": nbytes}, "on": on, "off": off,
                                     "off_again": again, "difference": diff, "noise": noise}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
