"""The reference model's shape in miniature (kind ``qwen3next``, profile reference-tiny), made by rig/build/demo.py.

A vLLM ``Qwen3NextForCausalLM`` laid out as the reference checkpoint is: Gated DeltaNet linear attention with full
attention every fourth layer, a sparse MoE (routed experts, a shared expert and its gate) on every layer, one MTP
layer (``mtp.*``, vLLM's ``Qwen3NextMTP``); W4A16 in compressed-tensors' ``pack-quantized`` format (symmetric int4,
groups of 128) quantized and packed by the ``compressed-tensors`` library itself. Random weights (seeded), BF16
where not quantized, the demo's tokenizer. Each size is the smallest vLLM v0.30.0 takes at TP1 and TP2 (and TP2 x
PP2 with expert parallel), on the cards and on the CPU build at TP1:

* ``hidden_size`` 128: the Marlin MoE kernel wants ``hidden_size % 128 == 0`` (marlin_utils
  check_moe_marlin_supports_config), the WNA16 MoE method ``hidden_size % group_size == 0``;
* ``moe_intermediate_size`` 256: the WNA16 MoE method wants the size per TP partition a multiple of the group size
  128 ("Scale groups would otherwise cross TP shard boundaries"): 128 at TP2;
* ``shared_expert_intermediate_size`` 256: its down_proj is row-parallel, its input per partition must be a multiple
  of 128 (verify_group_size_divides_partition, Marlin's can_implement): 128 at TP2;
* ``num_experts`` 8, ``num_experts_per_tok`` 2: the floor asked for (8 routed, top-2); EP2 holds 4 a rank;
* ``num_hidden_layers`` 8, ``full_attention_interval`` 4: layers 3 and 7 full; PP2 gives each stage one whole
  period (3 linear + 1 full): vLLM's KV cache grouping takes the stages' layer mix as alike (get_kv_cache_configs);
* full attention: ``head_dim`` 256 as the real model; 2 KV heads as the real model (one a rank at TP2: split, not
  replicated), 4 query heads (2 a KV head); o_proj's input 1024 is 512 a rank, a multiple of 128;
* Gated DeltaNet: head dims 128 as the real model (the fused CUDA decode kernel, and FlashInfer's prefill on
  Blackwell, want 128); 2 key heads (TP2 splits the heads); 16 value heads: ``in_proj_ba`` has 2 rows a value head,
  and the CPU build's only int4 linear kernel (CPUWNA16) wants its 32 outputs a multiple of 32 (Marlin pads any);
  out_proj's input 2048 is 1024 a rank.

The ``ignore`` list is what llm-compressor's W4A16 recipe for Qwen3-Next (examples/awq/qwen3_next_example.py:
targets ``Linear``, ignore ``lm_head``, ``re:.*mlp.gate$``, ``re:.*mlp.shared_expert_gate$``) saves, as
compressed-tensors' QuantizationConfig.from_pretrained writes it: each unquantized Linear by name (embeddings and
conv1d are not Linear, so not listed); the linear-attention projections are quantized. The MTP layer is quantized
like a decoder layer, its router gates ignored: vLLM v0.30.0 builds ``mtp.fc`` and the MTP layer with the
checkpoint's quant config (BF16 ``mtp.*`` not in ``ignore`` would not load).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 8, "full_attention_interval": 4, "max_position_embeddings": 262144,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 2, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "intermediate_size": 256,  # unused: every layer is MoE (decoder_sparse_step 1), as in the real config
    # vLLM v0.30.0 reads num_nextn_predict_layers (qwen3_next_mtp.py, config/speculative.py); Qwen's own key too
    "num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 1,
}
#: What the maker is asked for: compressed-tensors' W4A16 preset, packed (check_format compares with it).
QUANT: dict[str, Any] = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                         "format": "pack-quantized"}
WEIGHTS = "model.safetensors"


def layer_types(shape: dict[str, Any] = SHAPE) -> list[str]:
    """The real config's pattern: full attention at every ``full_attention_interval``-th layer."""
    every = shape["full_attention_interval"]
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(shape["num_hidden_layers"])]


def ignore(shape: dict[str, Any] = SHAPE) -> list[str]:
    """The Linear modules left unquantized, in module order (compressed-tensors writes them so), MTP's last."""
    moe = ("mlp.gate", "mlp.shared_expert_gate")
    layers = [f"model.layers.{i}.{m}" for i in range(shape["num_hidden_layers"]) for m in moe]
    mtp = [f"mtp.layers.{i}.{m}" for i in range(shape["num_nextn_predict_layers"]) for m in moe]
    return [*layers, "lm_head", *mtp]


def sidecar(shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    """The FP8 KV scales sidecar as patch 0004 reads it: one entry per decoder layer, all layers (it refuses another
    count), indexed by the ``layers.<i>.`` of each attention module's name. Only the full-attention entries reach a
    KV cache; the linear-attention ones are checked (positive numbers) and unused, save entry 0, which the MTP
    drafter's attention (``mtp.layers.0``, ``model.layers.0`` inside Qwen3NextMTP) takes. 1.0: plain FP8 range."""
    return {"layers": [{"k_scale": 1.0, "v_scale": 1.0} for _ in layer_types(shape)]}


def config(shape: dict[str, Any], vocab: int, tokens: dict[str, int]) -> dict[str, Any]:
    """config.json as the real Qwen3-Next's (its keys and defaults), at ``shape``; the quant config is added later."""
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": vocab,
            "layer_types": layer_types(shape), "attention_bias": False, "attention_dropout": 0.0,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "initializer_range": 0.02,
            "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
            "partial_rotary_factor": 0.25, "rope_theta": 10_000_000, "rope_scaling": None, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            **tokens, **shape}


def tensors(shape: dict[str, Any], vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the checkpoint before quantization: (name, shape, init), init ``linear`` for the quantized
    projections (named by module), ``dense`` for BF16 matrices, ``zeros``/``ones``/``alog``/``conv`` for the rest."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    kd = shape["linear_num_key_heads"] * shape["linear_key_head_dim"]
    nv = shape["linear_num_value_heads"]
    vd = nv * shape["linear_value_head_dim"]
    out: list[tuple[str, tuple[int, ...], str]] = []

    def layer(p: str, kind: str) -> None:
        out.extend([(f"{p}.input_layernorm.weight", (h,), "zeros"),
                    (f"{p}.post_attention_layernorm.weight", (h,), "zeros")])
        if kind == "linear_attention":  # Qwen3-Next's fused projections: q, k, v, z and b, a interleaved
            a = f"{p}.linear_attn"
            out.extend([(f"{a}.in_proj_qkvz", (2 * kd + 2 * vd, h), "linear"),
                        (f"{a}.in_proj_ba", (2 * nv, h), "linear"),
                        (f"{a}.conv1d.weight", (2 * kd + vd, 1, shape["linear_conv_kernel_dim"]), "conv"),
                        (f"{a}.A_log", (nv,), "alog"), (f"{a}.dt_bias", (nv,), "ones"),
                        (f"{a}.norm.weight", (shape["linear_value_head_dim"],), "ones"),
                        (f"{a}.out_proj", (h, vd), "linear")])
        else:  # q_proj carries the output gate: twice the heads
            a = f"{p}.self_attn"
            out.extend([(f"{a}.q_proj", (2 * heads * hd, h), "linear"), (f"{a}.k_proj", (kv * hd, h), "linear"),
                        (f"{a}.v_proj", (kv * hd, h), "linear"), (f"{a}.o_proj", (h, heads * hd), "linear"),
                        (f"{a}.q_norm.weight", (hd,), "zeros"), (f"{a}.k_norm.weight", (hd,), "zeros")])
        m = f"{p}.mlp"
        out.extend([(f"{m}.gate.weight", (shape["num_experts"], h), "dense"),
                    (f"{m}.shared_expert_gate.weight", (1, h), "dense")])
        for e, inter in [*((f"experts.{e}", shape["moe_intermediate_size"]) for e in range(shape["num_experts"])),
                         ("shared_expert", shape["shared_expert_intermediate_size"])]:
            out.extend([(f"{m}.{e}.gate_proj", (inter, h), "linear"), (f"{m}.{e}.up_proj", (inter, h), "linear"),
                        (f"{m}.{e}.down_proj", (h, inter), "linear")])

    out.append(("model.embed_tokens.weight", (vocab, h), "dense"))
    for i, kind in enumerate(layer_types(shape)):
        layer(f"model.layers.{i}", kind)
    out.extend([("model.norm.weight", (h,), "zeros"), ("lm_head.weight", (vocab, h), "dense"),
                ("mtp.fc", (h, 2 * h), "linear"), ("mtp.norm.weight", (h,), "zeros"),
                ("mtp.pre_fc_norm_embedding.weight", (h,), "zeros"), ("mtp.pre_fc_norm_hidden.weight", (h,), "zeros")])
    for i in range(shape["num_nextn_predict_layers"]):
        layer(f"mtp.layers.{i}", "full_attention")  # vLLM builds the MTP layer as full attention
    return out


def make(out: Path, seed: int, vocab: int, tokens: dict[str, int], shape: dict[str, Any] = SHAPE) -> None:
    """Write config.json, generation_config.json and model.safetensors into ``out``. Runs in the serving venv."""
    # The serving venv's own: the rig's Python, which imports this module through rig/build/demo.py, has none of them.
    import torch
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.format = QUANT["format"]
    args, group = scheme.weights, scheme.weights.group_size
    gen = torch.Generator().manual_seed(seed)
    made: dict[str, torch.Tensor] = {}
    for name, dims, init in tensors(shape, vocab):
        if init in ("linear", "dense", "conv"):
            w = torch.randn(dims, generator=gen) * 0.02
        elif init == "alog":  # the real model's init: A = uniform(0, 16), stored as its log
            w = torch.log(torch.empty(dims).uniform_(1, 16, generator=gen))
        else:  # Gemma-style norms scale by (1 + w): zeros are unit scale
            w = torch.zeros(dims) if init == "zeros" else torch.ones(dims)
        w = w.to(torch.bfloat16)
        if init != "linear":
            made[name] = w
            continue
        groups = w.reshape(dims[0], dims[1] // group, group)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero},
                                                       scheme)
        made.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
    save_file(made, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config(shape, vocab, tokens), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(tokens, indent=2, sort_keys=True) + "\n")
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore(shape), format=QUANT["format"],
                            quantization_status="compressed")
    ModelCompressor(quantization_config=qc).update_config(str(out))  # the library writes quantization_config


def check_format(folder: Path, asked: dict[str, Any] | None = None) -> list[str]:
    """How the checkpoint in ``folder`` differs from what the maker was asked (``QUANT`` and ``ignore()`` unless
    ``asked``), read back with compressed-tensors: its config parsed by QuantizationConfig, the tensors unpacked.
    Each difference names its field; [] when none."""
    # The serving venv's own, as in make().
    from compressed_tensors.quantization import QuantizationConfig

    asked = {**QUANT, "ignore": ignore(), **(asked or {})}
    raw = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not isinstance(raw, dict):
        return ["quantization_config: missing from config.json"]
    try:
        qc = QuantizationConfig.model_validate(raw)
    except ValueError as exc:
        return [f"quantization_config: not compressed-tensors' ({str(exc).splitlines()[0]})"]
    diffs = [] if raw.get("quant_method") == "compressed-tensors" else [
        f"quant_method: asked compressed-tensors, found {raw.get('quant_method')!r}"]
    if len(qc.config_groups) != 1:
        return [*diffs, f"config_groups: asked one group, found {sorted(qc.config_groups)}"]
    scheme = next(iter(qc.config_groups.values()))
    w = scheme.weights
    found = {"num_bits": w.num_bits, "type": w.type, "symmetric": w.symmetric, "strategy": w.strategy,
             "group_size": w.group_size, "format": qc.format}
    diffs += [f"{k}: asked {asked[k]!r}, found {getattr(v, 'value', v)!r}" for k, v in found.items()
              if getattr(v, "value", v) != asked[k]]
    if scheme.input_activations is not None:
        diffs.append("input_activations: asked none (A16), found a scheme")
    missing, extra = set(asked["ignore"]) - set(qc.ignore), set(qc.ignore) - set(asked["ignore"])
    diffs += [f"ignore: {n} asked, missing" for n in sorted(missing)]
    diffs += [f"ignore: {n} not asked" for n in sorted(extra)]
    return diffs + _tensor_diffs(folder, qc)


def _tensor_diffs(folder: Path, qc: Any) -> list[str]:
    """The tensors against the quant config ``qc``: what is stored quantized or BF16 against its ``ignore``, and
    each packed weight's scale groups, zero point and bits."""
    # The serving venv's own, as in make().
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.utils import match_name
    from safetensors import safe_open

    w = next(iter(qc.config_groups.values())).weights
    wrong: dict[str, list[str]] = {}
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        names = set(f.keys())
        for key in sorted(names):
            module, _, leaf = key.rpartition(".")
            ignored = any(match_name(module, t) for t in qc.ignore)
            if leaf == "weight" and len(f.get_slice(key).get_shape()) == 2 and not module.endswith("embed_tokens"):
                if not ignored:  # a Linear the group targets, stored unquantized
                    wrong.setdefault("ignore (Linear stored in BF16 but not ignored)", []).append(module)
                continue
            if leaf != "weight_packed":
                continue
            if ignored:
                wrong.setdefault("ignore (ignored but quantized)", []).append(module)
            dims = tuple(int(d) for d in f.get_tensor(f"{module}.weight_shape"))
            scale = tuple(f.get_slice(f"{module}.weight_scale").get_shape())
            if scale != (dims[0], math.ceil(dims[1] / w.group_size)):
                wrong.setdefault(f"group_size (weight_scale not [out, in / {w.group_size}])", []).append(module)
            if w.symmetric == (f"{module}.weight_zero_point" in names):
                wrong.setdefault("symmetric (weight_zero_point present or missing)", []).append(module)
            packed = f.get_tensor(key)
            if packed.dtype != torch.int32 or packed.shape[-1] != math.ceil(dims[1] * w.num_bits / 32):
                wrong.setdefault(f"num_bits (weight_packed not int32 [out, in * {w.num_bits} / 32])", []).append(module)
                continue
            q = unpack_from_int32(packed, w.num_bits, torch.Size(dims))
            if q.min() < -(2 ** (w.num_bits - 1)) or q.max() >= 2 ** (w.num_bits - 1):
                wrong.setdefault(f"num_bits (values beyond signed {w.num_bits}-bit)", []).append(module)
    return [f"{what}: {len(mods)} modules, e.g. {mods[0]}" for what, mods in wrong.items()]
