"""The reference-tiny checkpoint (rig/build/refshape.py, kind ``qwen3next``): made by the CPU build's serving venv as
``./start.sh`` makes it (rig.build.demo.ensure), twice alike; its W4A16 format read back with compressed-tensors; and
every tensor vLLM v0.30.0's Qwen3NextForCausalLM and Qwen3NextMTP load, by names derived here from its config."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

from rig.build import demo

pytestmark = [pytest.mark.slow, pytest.mark.engine]

KIND = "qwen3next"


@pytest.fixture(scope="module")
def made(cpu_build, tmp_path_factory) -> tuple[Path, Path, Path, float]:
    """(the serving venv's python, the checkpoint, the same made again, seconds the first took)."""
    dest, cpu, _ = cpu_build
    assert cpu.returncode == 0, (cpu.stdout + cpu.stderr)[-3000:]
    python = dest / ".venv-cpu" / "bin" / "python"
    d = tmp_path_factory.mktemp("refshape")
    first, took = demo.ensure(python, d / "a", ROOT, KIND)
    assert first
    assert demo.ensure(python, d / "b", ROOT, KIND)[0]
    return python, d / "a", d / "b", took


def test_made_twice_every_file_hashes_the_same(made):
    _, a, b, took = made
    assert demo.ready(a, KIND) and demo.ready(b, KIND) and not demo.ready(a, "qwen3")
    assert demo.digest(a) == demo.digest(b)
    assert {"config.json", "model.safetensors", demo.SIDECAR, "tokenizer.json"} <= set(demo.digest(a))
    size = sum(p.stat().st_size for p in a.iterdir()) / 2**20
    print(f"\nreference-tiny: made in {took:.1f} s, {size:.1f} MiB")


def check(python: Path, *folders: Path) -> list[list[str]]:
    """refshape.check_format on each folder, in the serving venv (compressed-tensors and torch are there)."""
    code = ("import json, sys; from pathlib import Path; from rig.build import refshape; "
            "print(json.dumps([refshape.check_format(Path(f)) for f in sys.argv[1:]]))")
    r = subprocess.run([str(python), "-c", code, *map(str, folders)], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def mutated(src: Path, dest: Path, change) -> Path:  # noqa: ANN001 - (the quantization_config) -> None
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    change(cfg["quantization_config"])
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_the_format_is_what_was_asked_and_a_changed_copy_is_caught(made, tmp_path):
    python, a, _, _ = made
    groups = mutated(a, tmp_path / "groups", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=64))
    gate = mutated(a, tmp_path / "gate", lambda q: q["ignore"].remove("model.layers.0.mlp.gate"))
    fine, wrong_groups, wrong_gate = check(python, a, groups, gate)
    assert fine == []
    assert "group_size: asked 128, found 64" in wrong_groups, wrong_groups
    assert any(d.startswith("group_size (weight_scale not [out, in / 64])") for d in wrong_groups), wrong_groups
    assert "ignore: model.layers.0.mlp.gate asked, missing" in wrong_gate, wrong_gate
    assert "ignore (Linear stored in BF16 but not ignored): 1 modules, e.g. model.layers.0.mlp.gate" in wrong_gate


def header(path: Path) -> tuple[dict, int]:
    """The safetensors header (name -> dtype, shape, offsets) and where the data starts: read without torch."""
    with path.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}, 8 + n


def expected(cfg: dict) -> dict[str, str]:
    """Tensor name -> dtype that vLLM v0.30.0 loads, from the config alone: Qwen3NextForCausalLM's layers
    (linear_attn.* where layer_types says linear, self_attn.* where full; the MoE's gate, shared expert and its
    gate, per-expert gate/up/down_proj as RoutedExperts' expert mapping names them), and Qwen3NextMTP's
    mtp.* (fc, its norms, num_nextn_predict_layers full-attention layers)."""
    def quant(m: str) -> dict[str, str]:
        return {f"{m}.weight_packed": "I32", f"{m}.weight_scale": "BF16", f"{m}.weight_shape": "I64"}

    def layer(p: str, kind: str) -> dict[str, str]:
        out = {f"{p}.input_layernorm.weight": "BF16", f"{p}.post_attention_layernorm.weight": "BF16"}
        if kind == "linear_attention":  # Qwen3-Next's fused, interleaved projections (gqa_interleaved_layout)
            for m in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
                out |= quant(f"{p}.linear_attn.{m}")
            out |= {f"{p}.linear_attn.{n}": "BF16" for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")}
        else:
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out |= quant(f"{p}.self_attn.{m}")
            out |= {f"{p}.self_attn.q_norm.weight": "BF16", f"{p}.self_attn.k_norm.weight": "BF16"}
        out |= {f"{p}.mlp.gate.weight": "BF16", f"{p}.mlp.shared_expert_gate.weight": "BF16"}
        for e in [f"experts.{e}" for e in range(cfg["num_experts"])] + ["shared_expert"]:
            for m in ("gate_proj", "up_proj", "down_proj"):
                out |= quant(f"{p}.mlp.{e}.{m}")
        return out

    names = {n: "BF16" for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "mtp.norm.weight",
                                 "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")}
    names |= quant("mtp.fc")
    for i, kind in enumerate(cfg["layer_types"]):
        names |= layer(f"model.layers.{i}", kind)
    for i in range(cfg["num_nextn_predict_layers"]):
        names |= layer(f"mtp.layers.{i}", "full_attention")
    return names


def test_every_tensor_vllm_loads_is_there_and_nothing_else(made):
    _, a, _, _ = made
    cfg = json.loads((a / "config.json").read_text())
    every = cfg["full_attention_interval"]
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"] and cfg["model_type"] == "qwen3_next"
    assert cfg["layer_types"] == ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                  for i in range(cfg["num_hidden_layers"])]
    assert "full_attention" in cfg["layer_types"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["num_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2 and cfg["shared_expert_intermediate_size"]
    t0 = time.monotonic()
    tensors, start = header(a / "model.safetensors")
    want = expected(cfg)
    assert sorted(set(want) - set(tensors)) == [] and sorted(set(tensors) - set(want)) == []
    assert {n: v["dtype"] for n, v in tensors.items()} == want
    raw = (a / "model.safetensors").read_bytes()
    for name in (n for n in tensors if n.endswith(".weight_shape")):
        m = name.removesuffix(".weight_shape")
        s, e = tensors[name]["data_offsets"]
        out_f, in_f = struct.unpack("<2q", raw[start + s:start + e])
        assert tensors[f"{m}.weight_packed"]["shape"] == [out_f, in_f // 8], m  # 8 int4 values an int32
        assert tensors[f"{m}.weight_scale"]["shape"] == [out_f, in_f // 128], m  # one scale a group of 128
        if ".experts." in m:
            inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
            assert (out_f, in_f) == ((hidden, inter) if m.endswith("down_proj") else (inter, hidden)), m
    assert time.monotonic() - t0 < 5


def test_the_sidecar_has_an_entry_for_every_decoder_layer_as_patch_0004_reads_it(made):
    """vllm/kv_scales.py (patch 0004) refuses a count other than num_hidden_layers and indexes entries by the
    ``layers.<i>.`` of each attention module: the full-attention layers' indices here, and 0 for the MTP
    drafter's own attention (``model.layers.0`` inside Qwen3NextMTP)."""
    _, a, _, _ = made
    cfg = json.loads((a / "config.json").read_text())
    layers = json.loads((a / demo.SIDECAR).read_text())["layers"]
    assert len(layers) == cfg["num_hidden_layers"]
    assert all(e["k_scale"] > 0 and e["v_scale"] > 0 for e in layers)
