"""Will it fit: the memory a plan's engine takes on each card, read before any engine starts.

The parts, per card, from what this tree will run (the engine's own command: its context, block size, KV dtype,
batch, drafts and parallelism) and the checkpoint's files, never an engine:

* the weights: every tensor's bytes from the safetensors headers (dtype x shape, quantized formats as stored),
  split by the plan's TP x PP; the MTP head and what each card keeps whole (embeddings, norms) named apart;
* the KV cache a request of ``max_model_len`` takes, as vLLM v0.30.0 sizes its pool (rig/plan/fit.py follows
  ``get_max_concurrency_for_kv_cache_config``): every attention layer's blocks (full: the whole context; sliding:
  its window plus one batch, plus a block), every Gated DeltaNet layer's state blocks (2 + the drafts, prefix
  caching on), one page size for all (the largest), a KV head per rank at least;
* the pool: on the CPU build ``VLLM_CPU_KVCACHE_SPACE`` GiB, which must be free in the box's RAM, or without it
  the RAM at ``memory_utilization`` (which must be free too) less the weights and :data:`CPU_NON_KV_MIB`, as
  vLLM v0.30.0's CPU worker sizes it; on a card, its memory at ``memory_utilization`` less the weights and
  :data:`NON_KV_MIB`;
* the verdict: how many requests of ``max_model_len`` the pool holds (vLLM's "Maximum concurrency"), and the
  tokens it prints ("KV cache size: N tokens"); under one request it does not fit, and the fix names the largest
  ``max_model_len`` that would.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from rig.base.errors import BadInput, problem
from rig.plan import extraargs
from rig.plan.box import Reading

#: bytes of each safetensors dtype
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8, "I32": 4,
          "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
#: bytes of a KV cache element by --kv-cache-dtype ("auto": the model's dtype)
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "float16": 2, "float": 4}
MODEL_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "half": 2, "float": 4}
#: vLLM v0.30.0's block size when --block-size is not given: 128 on the CPU engine, 16 on CUDA
DEFAULT_BLOCK = {"cpu": 128, "cuda": 16}
#: what a card holds beyond the weights and the KV pool (activations of one batch, the CUDA graph pools, the
#: sampler): 818 MiB measured for the tiny reference shape on an H100 (2026-12-07: 72.05 GiB of KV at 0.92 and
#: 21.38 GiB at 0.28 of torch's 81,089 MiB, weights 0.04 GiB, graphs 0.31 GiB), rounded up
NON_KV_MIB = 1024
MIB = 1 << 20
#: what the CPU worker's own memory holds beyond the weights when vLLM sizes the pool from the RAM (no
#: VLLM_CPU_KVCACHE_SPACE: the share of the RAM less the worker's RSS after its warm-up): torch, vLLM and one
#: batch's activations; 0.96 GiB measured with the (eager) demo on the 2-core box, 2026-12-07 ("0.96 GiB memory
#: was consumed by non-kv usages"; benchmarks/fit.py's case without the variable), rounded up
CPU_NON_KV_MIB = 1024
#: --gpu-memory-utilization when the command has none: vLLM v0.30.0's CacheConfig default
DEFAULT_UTILIZATION = 0.92
#: what the driver keeps of a card's memory out of torch's sight: NVML's total 81,559 MiB, torch's 81,089 MiB on
#: the H100 of 2026-12-07
DRIVER_MIB = 470


@dataclass(frozen=True)
class Weights:
    """The checkpoint's tensors in bytes: all, the MTP head's (``mtp.*``), and those every rank keeps whole."""

    total: int
    mtp: int
    whole: int
    tensors: int


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One safetensors file's tensors (name -> dtype, shape), each checked against the file: a known dtype, its
    bytes equal to dtype x shape, and inside the file. Bad: exit 2 naming the file and the tensor."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise BadInput(problem(str(path), f"a safetensors header of at most {max(size - 8, 0):,} bytes (the file's "
                                   "size)", f"{n:,} bytes" if n >= 0 else "no header", "make the file again: it is "
                                   "cut short or not safetensors"))
        try:
            table = json.loads(fh.read(n))
        except ValueError:
            table = None
    if not isinstance(table, dict):
        raise BadInput(problem(str(path), "a JSON object of tensors as its header", "something else",
                               "make the file again"))
    out = {}
    for name, meta in table.items():
        if name == "__metadata__":
            continue
        meta = meta if isinstance(meta, dict) else {}  # not a tensor's entry: refused for its dtype below
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in DTYPES:
            raise BadInput(problem(f"{path}: {name}", f"a dtype of {', '.join(DTYPES)}", repr(dtype),
                                   "convert the checkpoint to a dtype vLLM loads"))
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise BadInput(problem(f"{path}: {name}", "a shape of whole numbers", repr(shape),
                                   "make the file again: its header does not match its data"))
        nbytes = math.prod(shape) * DTYPES[dtype]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and offsets[1] - offsets[0] == nbytes
                and 8 + n + offsets[1] <= size):
            raise BadInput(problem(f"{path}: {name}", f"{nbytes:,} bytes ({dtype} x {shape}) inside the file",
                                   f"data_offsets {offsets} in a file of {size:,} bytes",
                                   "make the file again: its header does not match its data"))
        out[name] = (dtype, tuple(shape))
    return out


def weights(ckpt: Path) -> Weights:
    """Every tensor of the checkpoint's safetensors files. None: exit 2 naming the folder."""
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise BadInput(problem(str(ckpt), "a checkpoint with *.safetensors files", "none",
                               "point CKPT at the checkpoint's folder (its config.json beside the weights)"))
    total = mtp = whole = count = 0
    for f in files:
        for name, (dtype, shape) in header(f).items():
            b = math.prod(shape) * DTYPES[dtype]
            total, count = total + b, count + 1
            mtp += b if name.startswith("mtp.") else 0
            whole += b if len(shape) < 2 else 0  # norms, biases, scales of one dimension: on every rank
    return Weights(total, mtp, whole, count)


@dataclass(frozen=True)
class Layer:
    """One layer's share of the KV pool on a rank: ``kind`` full, sliding or state (a Gated DeltaNet layer)."""

    kind: str
    per_token: int = 0  # bytes a token takes (attention)
    window: int = 0  # sliding
    state: int = 0  # bytes of one request's state (state)


@dataclass(frozen=True)
class Shape:
    """What sizes the pool, from the engine's command and the checkpoint's config."""

    max_model_len: int
    block: int
    max_batched: int
    drafts: int
    layers: tuple[Layer, ...]

    def blocks(self, layer: Layer) -> int:
        """The blocks one request of max_model_len takes in that layer's group (vLLM's max_memory_usage_bytes)."""
        if layer.kind == "full":
            return -(-self.max_model_len // self.block)
        if layer.kind == "sliding":
            return -(-min(layer.window - 1 + self.max_batched, self.max_model_len) // self.block) + 1
        return 2 + self.drafts  # mamba_cache_mode "align" (prefix caching on): two states and one a draft

    @property
    def page(self) -> int:
        """One page size for every group: the largest of an attention block's and a state's."""
        return max([lay.per_token * self.block for lay in self.layers] + [lay.state for lay in self.layers])

    @property
    def need(self) -> int:
        """Bytes one request of max_model_len takes on this card."""
        return sum(self.blocks(lay) for lay in self.layers) * self.page

    def requests(self, pool: int) -> float:
        """Requests of max_model_len the pool holds: its blocks (a block of each of ``group`` layers at once) over
        the blocks one request takes in every group."""
        kinds = {}
        for lay in self.layers:
            kinds.setdefault(lay.kind, []).append(lay)
        if not kinds:
            return math.inf
        group = min(len(v) for v in kinds.values())
        blocks = pool // (self.page * group)
        need = sum(-(-len(v) // group) * self.blocks(v[0]) for v in kinds.values())
        return blocks / need


def _flags(argv: list[str]) -> dict[str, str]:
    """The command's flags (without ``--``, aliases and underscores as vLLM reads them) and their values."""
    return {flag.removeprefix("--"): value or "" for flag, value, _ in extraargs.options(argv) if flag}


def shape(argv: list[str], device: str, config: Mapping) -> tuple[Shape, int, int]:
    """The pool's shape on one rank from the engine's ``argv`` and the checkpoint's ``config``; with TP and PP."""
    f = _flags(argv)
    tp, pp = int(f.get("tensor-parallel-size", 1)), int(f.get("pipeline-parallel-size", 1))
    t = config.get("text_config") or config
    dtype = str(t.get("dtype") or t.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    kv = KV_BYTES.get(f.get("kv-cache-dtype", "auto"), MODEL_BYTES.get(dtype, 2))
    spec = json.loads(f.get("speculative-config") or "{}")
    drafts = int(spec.get("num_speculative_tokens", 0))
    n = int(t["num_hidden_layers"])
    types = list(t.get("layer_types") or ["full_attention"] * n)
    shared = int(t.get("num_kv_shared_layers") or 0)  # Gemma 3n: the last ones read an earlier layer's cache
    kv_heads = max(1, int(t.get("num_key_value_heads") or t["num_attention_heads"]) // tp)
    head_dim = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
    per_token = 2 * kv_heads * head_dim * kv
    state = _gdn_state(t, tp, drafts, 4 if device == "cpu" else MODEL_BYTES.get(dtype, 2), MODEL_BYTES.get(dtype, 2))
    layers = []
    for kind in types[:n - shared]:
        if kind == "linear_attention":
            layers.append(Layer("state", state=state))
        elif kind == "sliding_attention":
            layers.append(Layer("sliding", per_token, window=int(t.get("sliding_window") or 0)))
        else:
            layers.append(Layer("full", per_token))
    size, extra = divmod(len(layers), pp)  # PP: the decoder layers in pp runs, one more in the first ``extra``
    stages, at = [], 0
    for i in range(pp):
        stages.append(layers[at:at + size + (i < extra)])
        at += size + (i < extra)
    if spec.get("method") == "mtp":  # the MTP head's attention layers, on the last stage, keep a cache of their own
        stages[-1] += [Layer("full", per_token)] * int(t.get("num_nextn_predict_layers") or 1)
    block = int(f.get("block-size") or DEFAULT_BLOCK.get(device, 16))
    shapes = [Shape(int(f["max-model-len"]), block, int(f.get("max-num-batched-tokens", 2048)), drafts, tuple(st))
              for st in stages]
    return max(shapes, key=lambda sh: sh.need), tp, pp  # the card whose requests take the most


def _gdn_state(t: Mapping, tp: int, drafts: int, ssm_bytes: int, conv_bytes: int) -> int:
    """One request's Gated DeltaNet state on a rank (vLLM's gated_delta_net_state_shape): the conv state and the
    recurrent one (float32 on the CPU engine, which resets it so)."""
    if "linear_num_value_heads" not in t:
        return 0
    vh, kh = int(t["linear_num_value_heads"]), int(t["linear_num_key_heads"])
    vd, kd = int(t["linear_value_head_dim"]), int(t["linear_key_head_dim"])
    conv = (kd * kh * 2 + vd * vh) // tp * (int(t.get("linear_conv_kernel_dim", 4)) - 1 + drafts) * conv_bytes
    return conv + vh // tp * vd * kd * ssm_bytes


@dataclass(frozen=True)
class Fit:
    """The verdict for the card whose requests take the most (of the pipeline's stages)."""

    weights: Weights
    per_card_weights: int
    pool: int  # bytes of KV pool on the card
    pool_from: str
    shape: Shape
    tp: int
    pp: int
    short: str = ""  # why the engine would refuse to start before sizing its pool (the CPU build's RAM), or ''
    ram: tuple[int, int] = (0, 0)  # the CPU build's: the box's RAM, total and available, in bytes

    @property
    def requests(self) -> float:
        return self.shape.requests(self.pool) if self.pool > 0 else 0.0

    @property
    def tokens(self) -> int:
        return int(self.requests * self.shape.max_model_len)

    @property
    def fits(self) -> bool:
        return self.requests >= 1 and not self.short

    def largest_context(self) -> int:
        """The largest max_model_len (a multiple of the block) one request of which the pool holds."""
        lo, hi = 0, self.shape.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            s = Shape(mid, self.shape.block, self.shape.max_batched, self.shape.drafts, self.shape.layers)
            lo, hi = (mid, hi) if s.requests(self.pool) >= 1 else (lo, mid - 1)
        return lo // self.shape.block * self.shape.block


def estimate(argv: list[str], env: Mapping[str, str], device: str, ckpt: Path, card_mib: float = 0.0,
             ram: tuple[int, int] | None = None) -> Fit:
    """The verdict for the engine ``argv`` and its environment ``env`` on ``device``: the CPU pool from
    VLLM_CPU_KVCACHE_SPACE or the RAM (``ram``: total and available bytes; this box's when None); a card's
    from ``card_mib`` (torch's view of its memory) at the command's --gpu-memory-utilization (vLLM's default
    without it)."""
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(problem(f"{ckpt}/config.json", "the checkpoint's config", f"none readable ({exc})",
                               "point CKPT at the checkpoint's folder")) from None
    w = weights(ckpt)
    try:
        sh, tp, pp = shape(argv, device, config)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        raise BadInput(problem(f"{ckpt}/config.json", "the keys the KV cache is sized by (num_hidden_layers, "
                               "num_attention_heads, head_dim ...), as numbers", f"{type(exc).__name__}: {exc}",
                               "use a checkpoint whose config.json vLLM loads")) from None
    per_card = (w.total - w.whole) // (tp * pp) + w.whole
    util = float(_flags(argv).get("gpu-memory-utilization") or DEFAULT_UTILIZATION)
    if device == "cpu":
        ram = ram or host_ram()
        pool, src, short = _cpu_pool(env, util, per_card, ram)
        return Fit(w, per_card, max(pool, 0), src, sh, tp, pp, short, ram)
    pool = int(card_mib * MIB * util) - per_card - NON_KV_MIB * MIB
    src = f"{card_mib:,.0f} MiB a card x {util:g} - the weights {per_card / MIB:,.0f} MiB - the rest {NON_KV_MIB} MiB"
    return Fit(w, per_card, max(pool, 0), src, sh, tp, pp)


def host_ram() -> tuple[int, int]:
    """This box's RAM, total and available, in bytes, as the box check reads it (vLLM's CPU worker reads its NUMA
    node's)."""
    mem = psutil.virtual_memory()
    return mem.total, mem.available


def _cpu_pool(env: Mapping[str, str], util: float, per_card: int, ram: tuple[int, int]) -> tuple[int, str, str]:
    """The CPU engine's pool as vLLM v0.30.0 sizes it (vllm/platforms/cpu.py, v1/worker/cpu_worker.py), where it
    comes from, and why the engine would refuse to start ('' when it would not)."""
    total, available = ram
    raw = env.get("VLLM_CPU_KVCACHE_SPACE")
    gib = 1 << 30
    if raw is not None:  # vLLM reads it with int() when it is set, empty too: whole GiB
        if not (raw.strip().isascii() and raw.strip().isdigit() and int(raw) > 0):
            raise BadInput(problem("VLLM_CPU_KVCACHE_SPACE", "GiB for the CPU engine's KV cache, a whole number > 0 "
                                   "(vLLM reads it with int())", repr(raw),
                                   "set it in the profile's [env], e.g. VLLM_CPU_KVCACHE_SPACE = \"1\""))
        pool = int(raw) * gib
        short = "" if not total or pool <= available else (
            f"VLLM_CPU_KVCACHE_SPACE={raw} GiB is more than the {available / gib:.1f} GiB of RAM available "
            f"(of {total / gib:.1f} GiB); vLLM refuses it at start")
        return pool, f"VLLM_CPU_KVCACHE_SPACE={raw} GiB; RAM available {available / gib:.1f} GiB", short
    asked = math.ceil(total * util)
    pool = asked - per_card - CPU_NON_KV_MIB * MIB
    short = "" if asked <= available else (
        f"memory_utilization {util:g} of the RAM is {asked / gib:.1f} GiB, more than the {available / gib:.1f} GiB "
        "available; vLLM refuses it at start")
    return pool, (f"RAM {total / gib:.1f} GiB x {util:g} - the weights {per_card / MIB:,.0f} MiB - the rest "
                  f"{CPU_NON_KV_MIB} MiB (no VLLM_CPU_KVCACHE_SPACE)"), short


def card_mib(reading: Reading | None) -> float:
    """The smallest card's memory as torch sees it (NVML's total less what the driver keeps); 0 with no reading."""
    if reading is None or not reading.gpus:
        return 0.0
    return min(g.memory_total for g in reading.gpus) / MIB - DRIVER_MIB


def lines(f: Fit) -> list[str]:
    """The verdict as the rig prints it."""
    kinds = Counter(lay.kind for lay in f.shape.layers)
    out = [f"weights: {f.weights.total / MIB:,.1f} MiB in {f.weights.tensors} tensors (MTP head "
           f"{f.weights.mtp / MIB:,.1f} MiB); {f.per_card_weights / MIB:,.1f} MiB a card at TP{f.tp} x PP{f.pp}",
           f"KV pool: {f.pool / MIB:,.0f} MiB ({f.pool_from}); layers a card: "
           + ", ".join(f"{n} {k}" for k, n in kinds.items()) + f"; block {f.shape.block}, page {f.shape.page:,} B"]
    if f.short:
        out.append(f"does not fit: {f.short}")
    elif f.fits:
        out.append(f"fits: {f.requests:.2f} requests of {f.shape.max_model_len:,} tokens, KV cache size "
                   f"{f.tokens:,} tokens")
    else:
        out.append(f"does not fit: {f.requests:.2f} of one request of {f.shape.max_model_len:,} tokens")
    return out


def refusal(f: Fit, also: str = "") -> str:
    """Why a start stops before its engine (exit 2), or '' when it fits; ``also``: one more way out."""
    if f.fits:
        return ""
    if f.short:
        space = f.ram[1] >> 30
        ways = [f"set VLLM_CPU_KVCACHE_SPACE in the profile's [env] to {space} (GiB) or less"] if space else []
        return problem("the CPU engine's RAM", "its KV cache within the RAM available", f.short,
                       ", or ".join([*ways, "free RAM", *([also] if also else [])]))
    longest = f.largest_context()
    ways = [f"lower max_model_len to {longest:,} (a profile of your own: base = the profile, max_model_len = "
            f"{longest})"] if longest else []
    ways += ["give the KV pool more memory (VLLM_CPU_KVCACHE_SPACE on the CPU, memory_utilization on a card)",
             "spread the model over more cards"] + ([also] if also else [])
    return problem("the KV cache", f"room for one request of max_model_len {f.shape.max_model_len:,}",
                   f"{f.requests:.2f} of one ({f.pool / MIB:,.0f} MiB: {f.pool_from})", ", or ".join(ways))
