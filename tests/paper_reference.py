"""The reference box on paper: a checkpoint of safetensors headers alone (sparse files, no weights) with the shapes
of Qwen3-Next-80B-A3B's published config (the nearest published model of the reference's family) in W4A16 as
rig/build/refshape.py writes it (symmetric int4, group 128, pack-quantized: an int32 of 8 values, a BF16 scale a
group, the shape; gates, embeddings, the LM head and norms in BF16), for rig/plan/fit.py's verdict on four 24 GiB
cards. Assumed: the published config's sizes; one MTP layer; the reference's own W4A16 recipe (its checkpoint is
not published)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from rig.build import refshape

#: Qwen3-Next-80B-A3B-Instruct's config.json (Hugging Face, Qwen), the keys the shape reads
SHAPE_80B = {
    "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4, "max_position_embeddings": 262144,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 1,
}
VOCAB = 151936
GROUP = 128


def make(folder: Path) -> int:
    """config.json and one sparse model.safetensors whose header lists every tensor; its size in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    table, at = {}, 0

    def add(name: str, dtype: str, shape: tuple[int, ...]) -> None:
        nonlocal at
        n = math.prod(shape) * {"BF16": 2, "I32": 4, "I64": 8}[dtype]
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n

    for name, dims, init in refshape.tensors(SHAPE_80B, VOCAB):
        if init == "linear":  # pack-quantized: 8 int4 a 32-bit word, a BF16 scale a group of 128
            add(f"{name}.weight_packed", "I32", (dims[0], dims[1] // 8))
            add(f"{name}.weight_scale", "BF16", (dims[0], dims[1] // GROUP))
            add(f"{name}.weight_shape", "I64", (2,))
        else:
            add(name, "BF16", dims)
    head = json.dumps(table).encode()
    path = folder / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        fh.truncate(8 + len(head) + at)  # sparse: the size the header says, no bytes on disk
    (folder / "config.json").write_text(json.dumps(refshape.config(SHAPE_80B, VOCAB, {})))
    return 8 + len(head) + at
