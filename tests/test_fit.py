"""Will it fit (rig/plan/fit.py): the checkpoint's headers read and checked, and the KV pool sized as vLLM v0.30.0
sizes it. The four figures vLLM itself printed (the CPU demo, the CPU PLE demo, the tiny reference shape on an H100
at two memory shares) are what the shapes of the rig's own makers must give; the served demo's own line is compared
in tests/test_serve_real.py."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
from conftest import run_rig

from rig.base.errors import BadInput
from rig.build import demo, refshape
from rig.plan import fit

GIB = 1 << 30
RAM = (32 * GIB, 30 * GIB)  # a box's RAM: total, available (0.92 of it is free)
SPEC = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})]


def argv(*flags: str) -> list[str]:
    return ["vllm", "serve", "ckpt", *flags]


def tokens(sh: fit.Shape, pool: int) -> int:
    return int(sh.requests(pool) * sh.max_model_len)


@pytest.mark.parametrize("name,cmd,device,config,pool,printed", [
    # CPU demo, 2026-12-07: "CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 262,144 tokens: 8.00x"
    ("demo", argv("--kv-cache-dtype", "fp8", "--max-model-len", "262144", "--block-size", "2048"), "cpu",
     {**demo.SHAPE, "dtype": "bfloat16"}, 1 * GIB, 2_097_152),
    # CPU PLE demo: "CPU KV cache size: 3,876,324 tokens ... 118.30x" (sliding and full layers, two shared)
    ("demo-ple", argv("--max-model-len", "32768"), "cpu", {**demo.PLE_SHAPE, "dtype": "bfloat16"}, 1 * GIB,
     3_876_324),
    # the tiny reference shape on the H100: 72.05 GiB -> 23,357,410 tokens; 21.38 GiB -> 6,929,719 (docs/gpu.md)
    ("reference-tiny", argv("--kv-cache-dtype", "fp8", "--max-model-len", "262144", "--block-size", "2048", *SPEC),
     "cuda", refshape.config(refshape.SHAPE, 151936, {}), int(72.05 * GIB), 23_357_410),
    ("reference-tiny, 0.28", argv("--kv-cache-dtype", "fp8", "--max-model-len", "262144", "--block-size", "2048",
                                  *SPEC), "cuda", refshape.config(refshape.SHAPE, 151936, {}), int(21.38 * GIB),
     6_929_719),
])
def test_the_pool_holds_the_tokens_vllm_printed(name, cmd, device, config, pool, printed):
    sh, _, _ = fit.shape(cmd, device, config)
    assert tokens(sh, pool) == printed, name


def test_tensor_and_pipeline_parallel_split_the_heads_and_the_layers():
    config = refshape.config(refshape.SHAPE, 151936, {})
    one, _, _ = fit.shape(argv("--max-model-len", "262144", "--kv-cache-dtype", "fp8", *SPEC), "cuda", config)
    four, tp, pp = fit.shape(argv("--max-model-len", "262144", "--kv-cache-dtype", "fp8", "--tensor-parallel-size",
                                  "2", "--pipeline-parallel-size", "2", *SPEC), "cuda", config)
    assert (tp, pp) == (2, 2) and [lay.kind for lay in four.layers] == ["state"] * 3 + ["full"] * 2  # the last
    # stage: layers 4-7 and the MTP head's
    full = [next(lay for lay in sh.layers if lay.kind == "full") for sh in (four, one)]
    assert full[0].per_token * 2 == full[1].per_token  # the 2 KV heads: one a rank at TP2
    assert four.requests(GIB) > one.requests(GIB)


def safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], lie: int = 0) -> None:
    """A safetensors file of zeros; ``lie``: bytes the header claims that the file does not hold."""
    table, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = fit.DTYPES.get(dtype, 1)
        for d in shape:
            n *= d
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(table).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(max(at - lie, 0)))


def checkpoint(folder: Path, **tensors: tuple[str, list[int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**demo.SHAPE, "dtype": "bfloat16", "vocab_size": 2048}))
    safetensors(folder / "model.safetensors", tensors or {"model.embed_tokens.weight": ("BF16", [2048, 256]),
                                                          "model.norm.weight": ("BF16", [256]),
                                                          "mtp.fc.weight": ("BF16", [256, 512])})
    return folder


def test_the_weights_are_every_tensors_bytes_the_mtp_head_apart(tmp_path):
    w = fit.weights(checkpoint(tmp_path / "c"))
    assert (w.total, w.mtp, w.whole, w.tensors) == ((2048 * 256 + 256 + 256 * 512) * 2, 256 * 512 * 2, 512, 3)


@pytest.mark.parametrize("case,want", [
    ("no safetensors", "a checkpoint with *.safetensors files"),
    ("a header longer than the file", "a safetensors header of at most"),
    ("an unknown dtype", "model.x: expected a dtype of"),
    ("a shape that is not one", "model.x: expected a shape of whole numbers"),
    ("a header that is a list", "expected a JSON object of tensors"),
    ("an entry that is not a tensor", "model.x: expected a dtype of"),
    ("data the file does not hold", "model.x: expected 1,024 bytes"),
    ("offsets that are not numbers", "model.x: expected 1,024 bytes"),
])
def test_a_checkpoint_the_headers_refuse_is_exit_2_naming_the_file_and_the_tensor(tmp_path, case, want):
    c = tmp_path / "c"
    c.mkdir()
    f = c / "model.safetensors"
    if case == "a header longer than the file":
        f.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    elif case == "an unknown dtype":
        safetensors(f, {"model.x": ("Q4_K", [16])})
    elif case == "a shape that is not one":
        head = json.dumps({"model.x": {"dtype": "BF16", "shape": "512", "data_offsets": [0, 1024]}}).encode()
        f.write_bytes(struct.pack("<Q", len(head)) + head + bytes(1024))
    elif case in ("a header that is a list", "an entry that is not a tensor"):
        head = json.dumps(["model.x"] if case == "a header that is a list" else {"model.x": 3}).encode()
        f.write_bytes(struct.pack("<Q", len(head)) + head)
    elif case == "offsets that are not numbers":
        head = json.dumps({"model.x": {"dtype": "BF16", "shape": [512], "data_offsets": ["0", "1024"]}}).encode()
        f.write_bytes(struct.pack("<Q", len(head)) + head + bytes(1024))
    elif case == "data the file does not hold":
        safetensors(f, {"model.x": ("BF16", [512])}, lie=1)
    with pytest.raises(BadInput) as e:
        fit.weights(c)
    assert e.value.code == 2 and want in e.value.message and "Fix:" in e.value.message, e.value.message
    if case != "no safetensors":
        assert str(f) in e.value.message
    safetensors(f, {"model.x": ("BF16", [512])})  # the fix: the file made again
    assert fit.weights(c).total == 1024


def test_a_config_without_what_sizes_the_cache_is_exit_2_naming_the_key(tmp_path):
    ckpt = checkpoint(tmp_path / "c")
    good = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in json.loads(good).items()
                                                  if k != "num_hidden_layers"}))
    cmd = argv("--max-model-len", "4096")
    with pytest.raises(BadInput) as e:
        fit.estimate(cmd, {}, "cpu", ckpt)
    assert e.value.code == 2 and "config.json" in e.value.message and "num_hidden_layers" in e.value.message
    (ckpt / "config.json").write_text(good)  # the fix: a config that names its layers
    assert fit.estimate(cmd, {}, "cpu", ckpt, ram=RAM).fits
    for bad in ("lots", "-1", "nan", "0.5", "0", "\u0661", ""):  # vLLM reads it with int(): whole GiB
        with pytest.raises(BadInput) as e:
            fit.estimate(cmd, {"VLLM_CPU_KVCACHE_SPACE": bad}, "cpu", ckpt, ram=RAM)
        assert e.value.code == 2 and "VLLM_CPU_KVCACHE_SPACE: expected GiB" in e.value.message
        assert "a whole number > 0" in e.value.message and repr(bad) in e.value.message
    assert fit.estimate(cmd, {"VLLM_CPU_KVCACHE_SPACE": "1"}, "cpu", ckpt, ram=RAM).fits  # the fix's value


def test_a_pool_too_small_names_the_largest_context_and_following_it_fits(tmp_path):
    ckpt = checkpoint(tmp_path / "c")
    cmd = argv("--kv-cache-dtype", "fp8", "--max-model-len", "4194304", "--block-size", "2048")
    small = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # 512 bytes a token (2 layers, K and V, 2 heads of 64, FP8)
    f = fit.estimate(cmd, small, "cpu", ckpt, ram=RAM)
    assert not f.fits and f.largest_context() == 2_097_152
    why = fit.refusal(f)
    assert "lower max_model_len to 2,097,152" in why and "4,194,304" in why and "VLLM_CPU_KVCACHE_SPACE" in why
    cmd[cmd.index("4194304")] = "2097152"
    got = fit.estimate(cmd, small, "cpu", ckpt, ram=RAM)
    assert got.fits and not fit.refusal(got)
    cmd[cmd.index("2097152")] = "2099200"  # one block more: not
    assert not fit.estimate(cmd, small, "cpu", ckpt, ram=RAM).fits


def test_a_cpu_pool_the_ram_cannot_hold_is_refused_and_following_the_fix_fits(tmp_path):
    """vLLM's CPU worker refuses at start a VLLM_CPU_KVCACHE_SPACE over the RAM available, and without it a
    memory_utilization share of the RAM over what is available; the verdict says so first, and its fix clears it."""
    ckpt = checkpoint(tmp_path / "c")
    cmd = argv("--kv-cache-dtype", "fp8", "--max-model-len", "262144", "--block-size", "2048")
    ram = (32 * GIB, 5 * GIB + 300 * fit.MIB)
    f = fit.estimate(cmd, {"VLLM_CPU_KVCACHE_SPACE": "8"}, "cpu", ckpt, ram=ram)
    assert not f.fits and f.requests >= 1  # the pool would hold requests: the RAM is what stops it
    why = fit.refusal(f)
    assert "VLLM_CPU_KVCACHE_SPACE=8 GiB is more than the 5.3 GiB of RAM available" in why
    assert "set VLLM_CPU_KVCACHE_SPACE in the profile's [env] to 5 (GiB) or less" in why
    assert fit.lines(f)[-1].startswith("does not fit: VLLM_CPU_KVCACHE_SPACE=8 GiB")
    assert fit.estimate(cmd, {"VLLM_CPU_KVCACHE_SPACE": "5"}, "cpu", ckpt, ram=ram).fits  # the fix followed
    auto = fit.estimate(cmd, {}, "cpu", ckpt, ram=ram)  # none set: 0.92 of 32 GiB asked, 5.3 available
    assert not auto.fits and "memory_utilization 0.92 of the RAM is 29.4 GiB" in fit.refusal(auto)
    assert fit.estimate(cmd, {"VLLM_CPU_KVCACHE_SPACE": "5"}, "cpu", ckpt, ram=ram).fits
    share = fit.estimate([*cmd, "--gpu-memory-utilization", "0.1"], {}, "cpu", ckpt, ram=ram)
    assert share.fits and share.pool == -(-32 * GIB // 10) - share.per_card_weights - fit.CPU_NON_KV_MIB * fit.MIB


def test_a_card_pool_is_its_share_less_the_weights_and_the_rest(tmp_path):
    ckpt = checkpoint(tmp_path / "c")
    cmd = argv("--kv-cache-dtype", "fp8", "--max-model-len", "262144", "--gpu-memory-utilization", "0.5")
    f = fit.estimate(cmd, {}, "cuda", ckpt, card_mib=24576)
    assert f.pool == int(24576 * fit.MIB * 0.5) - f.per_card_weights - fit.NON_KV_MIB * fit.MIB


def test_nox_fit_answers_for_four_cards_of_24_gib_and_refuses_a_bad_size(tmp_path):
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(refshape.config(refshape.SHAPE, 151936, {})))
    safetensors(ckpt / "model.safetensors", {"model.embed_tokens.weight": ("BF16", [151936, 128]),
                                             "mtp.fc.weight": ("BF16", [128, 256])})
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "PROFILE", "CUDA_VISIBLE_DEVICES")}
    env.update(PROFILE="reference", CKPT=str(ckpt), RIG_STATE=str(tmp_path / "state"))
    r = run_rig(env, "fit", "--cards", "4", "--card-memory", "24GiB")
    assert r.code == 0, r.out + r.err
    assert "TP2 x PP2 + EP" in r.out and "fits:" in r.out and "24,576 MiB a card x 0.92" in r.out, r.out
    assert "layers a card: 3 state, 2 full" in r.out, r.out  # PP2: the last stage, layers 4-7 and the MTP head
    bad = run_rig(env, "fit", "--cards", "4", "--card-memory", "lots")
    assert bad.code == 2 and "--card-memory: expected a size such as 24GiB" in bad.err, bad.err
    unread = run_rig(env, "fit", "--cards", "4")  # no driver here: no card memory to read
    assert unread.code == 2 and "--card-memory: expected each card's memory" in unread.err, unread.err
    assert "Fix: give it, e.g. scripts/nox.sh -s fit -- --card-memory 24GiB" in unread.err  # followed above


def test_the_reference_on_four_24_gib_cards_on_paper(tmp_path):
    """The reference profile on the reference box (four 24 GiB cards: TP2 x PP2 + EP) with a checkpoint of headers
    alone in the shapes of Qwen3-Next-80B-A3B (tests/paper_reference.py): the verdict, printed for docs/serving.md."""
    import paper_reference

    size = paper_reference.make(tmp_path / "ckpt")
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "PROFILE", "CUDA_VISIBLE_DEVICES")}
    env.update(PROFILE="reference", CKPT=str(tmp_path / "ckpt"), RIG_STATE=str(tmp_path / "state"))
    r = run_rig(env, "fit", "--cards", "4", "--card-memory", "24GiB")
    assert r.code == 0, r.out + r.err
    weights = re.search(r"weights: ([\d,.]+) MiB in (\d+) tensors .*; ([\d,.]+) MiB a card at TP2 x PP2", r.out)
    assert weights and abs(float(weights[1].replace(",", "")) * fit.MIB / size - 1) < 0.01, r.out
    assert "layers a card: 18 state, 7 full" in r.out and "fits:" in r.out, r.out  # the last stage: 24 + MTP
    print(f"\nthe reference on paper ({size / 2**30:.1f} GiB of W4A16 headers):\n{r.out}")
