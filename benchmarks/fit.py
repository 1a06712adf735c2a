# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""Will it fit, measured: rig/plan/fit.py's verdict against what vLLM then allocates (docs/serving.md quotes it).

  uv run benchmarks/fit.py [--rig DIR] [--quick] [--case PROFILE[:KEY=VALUE;...]] ...

Each case is a profile served as the rig plans it: its engine command and environment, started bare (its own state
folder), and stopped as soon as vLLM has printed its KV cache size. The verdict is made before the engine starts,
from the checkpoint's headers, the plan and the card NVML reads; then, as ratios predicted / vLLM:

  weights    against "Model loading took X GiB" (a card; vLLM's CPU engine prints no such line)
  KV memory  against "Available KV cache memory: X GiB" (a card; on the CPU both are VLLM_CPU_KVCACHE_SPACE)
  tokens     against "GPU KV cache size: N tokens" / "CPU KV cache size: N tokens"

Targets: weights within 2%, tokens within 5%, and no "fits" verdict for an engine that then fails for memory.
Cases (default): on the CPU build the demo and the PLE demo; on the CUDA build (a card) the GPU demo, the PLE GPU
demo and reference-tiny, each as it is and at a second memory_utilization and max_model_len (a variant profile
of this run, models/bench-fit-*.toml); on the CPU also the demo without VLLM_CPU_KVCACHE_SPACE (the pool from
the RAM). --case PROFILE:memory_utilization=0.5;max_model_len=8192 names a case of your own (unset=VAR: the
engine without that variable). --quick: the demo alone (CI runs it on its CPU-built copy with --rig; the PLE
demo's figure is checked there on the engine tests/test_ple_real.py serves).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.build import demo  # noqa: E402
from rig.control.start import made_kind  # noqa: E402
from rig.facts import profiles, slots  # noqa: E402
from rig.plan import box, fit, serve  # noqa: E402
from rig.running.enginerec import clear_runtime, fresh_runtime, terminate  # noqa: E402

CPU_CASES = ("demo", "demo-ple", "demo:memory_utilization=0.2;unset=VLLM_CPU_KVCACHE_SPACE")
GPU_CASES = tuple(f"{p}{extra}" for p in ("demo-gpu", "demo-ple-gpu", "reference-tiny")
                  for extra in ("", ":memory_utilization=0.5", ":max_model_len=8192"))
GIB = 1 << 30
#: vLLM's lines, as v0.30.0 prints them (vllm/v1/worker/gpu_model_runner.py, gpu_worker.py, core/kv_cache_utils.py).
LOADED = re.compile(r"Model loading took ([\d.]+) GiB")
AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
TOKENS = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")
MEMORY = re.compile(r"out of memory|OutOfMemory|No available memory for the cache blocks|larger than the available "
                    r"KV cache memory|not enough (?:GPU )?memory", re.I)
WEIGHTS_WITHIN, TOKENS_WITHIN = 0.02, 0.05


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def card_here() -> bool:
    try:
        return bool(box.read_nvml().gpus)
    except box.NoDriver:
        return False


def profile_of(case: str, n: int) -> str:
    """The profile a case names, or a variant of it with the case's keys (models/bench-fit-N.toml)."""
    name, _, keys = case.partition(":")
    keys = ";".join(kv for kv in keys.split(";") if kv and not kv.startswith("unset="))
    if not keys:
        return name
    variant = f"bench-fit-{n}"
    body = "".join(f"{k.strip()} = {v.strip()}\n" for k, v in (kv.split("=", 1) for kv in keys.split(";")))
    (profiles.MODELS_DIR / f"{variant}.toml").write_text(f'base = "{name}"\n{body}')
    return variant


def serve_until_sized(argv: list[str], env: dict, log: Path, timeout: float) -> tuple[str, str]:
    """The engine started bare, stopped once it has printed its KV cache size (or ended): (outcome, its log)."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    deadline, outcome = time.monotonic() + timeout, "timed out"
    try:
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if TOKENS.search(text):
                outcome = "sized"
                break
            if proc.poll() is not None:
                outcome = f"ended (exit {proc.returncode})" + (": out of memory" if MEMORY.search(text) else "")
                break
            time.sleep(0.5)
    finally:
        terminate(proc.pid, 2)  # its figures are printed: nothing to drain
    return outcome, log.read_text(errors="replace")


def ratio(predicted: float, measured: float | None) -> str:
    return f"{predicted / measured:.3f}x" if measured else "-"


def measure(case: str, n: int, rig: Path, base_env: dict, work: Path, timeout: float) -> tuple[str, list[str]]:
    """One case: its line, and what in it misses a target."""
    profile = profile_of(case, n)
    device = base_env.get("DEVICE") or profiles.load(profile).device  # each case on its profile's build
    env = {**base_env, "DEVICE": device, "PROFILE": profile, "PORT": str(free_port()),
           "RIG_STATE": str(work / f"state-{n}"), "LOG": str(work / f"engine-{n}.log"), "VLLM_API_KEY": ""}
    s = slots.settings(env, root=rig)
    v, p = serve.inputs(s, env)
    if kind := made_kind(p):
        demo.ensure(s.venv_dir / "bin" / "python", s.ckpt, s.root, kind)
    report = serve.check_box(s, v, p, check=False)
    plan = serve.plan(s, v, p, report)
    engine_env = plan.engine.full_env(env)
    for kv in case.partition(":")[2].split(";"):  # unset=VAR: the engine without it (vLLM's own default)
        if kv.startswith("unset="):
            engine_env.pop(kv.removeprefix("unset="), None)
    f = fit.estimate(plan.engine.argv, engine_env, s.device, s.ckpt, fit.card_mib(report.reading))
    fresh_runtime(s)
    try:
        outcome, text = serve_until_sized(plan.engine.argv, engine_env, work / f"engine-{n}.log", timeout)
    finally:
        clear_runtime(s)
    loaded, available, tokens = (m[-1] if (m := rx.findall(text)) else None for rx in (LOADED, AVAILABLE, TOKENS))
    tokens = int(tokens.replace(",", "")) if tokens else None
    misses = []
    parts = [f"{case}: {'fits' if f.fits else 'does not fit'} ({f.requests:.2f} requests), vLLM {outcome}"]
    if loaded:
        w = f.per_card_weights / GIB
        parts.append(f"weights {w:.3f} / {float(loaded):.2f} GiB {ratio(w, float(loaded))}")
        if abs(w - float(loaded)) > max(WEIGHTS_WITHIN * float(loaded), 0.005):  # vLLM prints hundredths of a GiB
            misses.append(f"{case}: weights off by more than {WEIGHTS_WITHIN:.0%}")
    if available:
        kv = f.pool / GIB
        parts.append(f"KV memory {kv:.2f} / {float(available):.2f} GiB {ratio(kv, float(available))}")
    if tokens:
        parts.append(f"tokens {f.tokens:,} / {tokens:,} {ratio(f.tokens, tokens)}")
        if abs(f.tokens / tokens - 1) > TOKENS_WITHIN:
            misses.append(f"{case}: KV cache tokens off by more than {TOKENS_WITHIN:.0%}")
    if outcome != "sized":
        if "out of memory" not in outcome:
            misses.append(f"{case}: vLLM {outcome} (see {work / f'engine-{n}.log'})")
        elif f.fits:
            misses.append(f"{case}: said fits, and vLLM failed for memory")
    return "  | ".join(parts), misses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rig", type=Path, default=ROOT, help="the built copy of the rig (default: this one)")
    ap.add_argument("--case", action="append", help="PROFILE or PROFILE:KEY=VALUE;... (again for more)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds an engine may take to size its cache")
    ap.add_argument("--quick", action="store_true", help="the demo alone, on the CPU (CI)")
    a = ap.parse_args()
    rig = a.rig.resolve()
    env = {**os.environ, **({"DEVICE": "cpu"} if a.quick else {})}
    device = env.get("DEVICE") or ("cuda" if card_here() else "cpu")
    cases = a.case or (CPU_CASES[:1] if a.quick else CPU_CASES if device == "cpu" else GPU_CASES)
    made, misses = [], []
    work = Path(tempfile.mkdtemp(prefix="fit-bench-"))
    print(f"fit: {len(cases)} case(s) on {'a card' if device == 'cuda' else 'the CPU'} with {rig}; engines' logs "
          f"in {work}")
    try:
        for n, case in enumerate(cases):
            if ":" in case:
                made.append(profiles.MODELS_DIR / f"bench-fit-{n}.toml")
            line, missed = measure(case, n, rig, env, work, a.timeout)
            print(line, flush=True)
            misses += missed
    finally:
        for path in made:
            path.unlink(missing_ok=True)
    for m in misses:
        print(f"missed: {m}")
    print(f"fit: {len(cases)} case(s), {len(misses)} missed (targets: weights within {WEIGHTS_WITHIN:.0%}, tokens "
          f"within {TOKENS_WITHIN:.0%}, no fits verdict for a start that fails for memory)")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
