"""The demo models, made by this module run as a script on purpose (the serving venv's ``python -m rig.build.demo``).

Tiny checkpoints the rig makes on the box, so the whole serve path runs anywhere with the real engine:

* ``qwen3`` (profiles demo, demo-gpu): 2 layers, hidden 256, 4 heads of size 64 (a head size vLLM's CPU
  attention supports), with the FP8 KV scales sidecar;
* ``qwen3next`` (profile reference-tiny): the reference model's architecture in miniature, W4A16, with MTP and
  the sidecar (rig/build/refshape.py);
* ``gemma3n`` (profile demo-ple): a Gemma 3n text model, 4 layers, hidden 128, whose per-layer-embedding table
  (2048 x 4 x 1024) is three quarters of its weights, for the PLE offload (patch 0007); ``gemma3n-gpu``
  (profile demo-ple-gpu) the same with a 262144-row table (2 GiB).

Random weights (seeded), a byte-level BPE tokenizer trained with ``tokenizers`` on the prose rig/base/prose.py
generates, and a ChatML chat template. Made with the serving venv's own ``transformers``, ``tokenizers`` and
``torch`` (the runtime lock), into the profile's folder under ``RIG_CACHE/models/``, atomically: a folder made
beside it and renamed when complete. Nothing is downloaded. Made twice, its files hash the same.

  python -m rig.build.demo OUT [KIND]   (run by the serving venv's Python; ./start.sh --demo does it)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rig.base import prose
from rig.base.console import say
from rig.base.errors import WorkFailed, problem
from rig.build import refshape

SEED = 1661
VOCAB = 2048
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: The config the checkpoint is made with; ``max_position_embeddings`` lets the demo use the reference's context.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 262144}
#: The Gemma 3n model's config: the table (``vocab_size_per_layer_input`` x layers x ``hidden_size_per_layer_input``)
#: dwarfs the rest, so the PLE offload's effect on memory shows.
PLE_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 32768,
             "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 1024, "num_kv_shared_layers": 2,
             "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 512, "laurel_rank": 16,
             "activation_sparsity_pattern": [0.0] * 4}
#: The same model for the card, with Gemma's own per-layer vocabulary (262144 rows: a 2 GiB table, nearly all
#: its weights), so the card memory the offload frees stands far above the card's own noise.
PLE_GPU_SHAPE = {**PLE_SHAPE, "vocab_size_per_layer_input": 262144}
SHAPES = {"qwen3": SHAPE, "gemma3n": PLE_SHAPE, "gemma3n-gpu": PLE_GPU_SHAPE, "qwen3next": refshape.SHAPE}
#: The profiles whose checkpoint the rig makes, and which model each is.
MADE = {"demo": "qwen3", "demo-gpu": "qwen3", "demo-ple": "gemma3n", "demo-ple-gpu": "gemma3n-gpu",
        "reference-tiny": "qwen3next"}
#: The demo's profile for each build: ``./start.sh --demo`` picks the one of the build it serves with.
PROFILES = {"cpu": "demo", "cuda": "demo-gpu"}
MARK = ".rig-demo.json"  # written last: a folder without it is not trusted
#: The FP8 KV scales sidecar (patch 0004) the demo carries: 1.0 for every layer, the cache's plain FP8 range.
SIDECAR = "qsa_kv_scales.json"
SIDECAR_KINDS = ("qwen3", "qwen3next")


def make(out: Path, kind: str = "qwen3") -> None:
    """Write the checkpoint ``kind`` into ``out`` (an empty folder). Runs in the serving venv."""
    # The serving venv's own: the rig's Python, which imports this module to call ensure(), has none of them.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prose.generate(60_000, seed=SEED).split("\n\n"), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    _json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": SHAPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "chat_template": CHAT_TEMPLATE})
    _json(out / "special_tokens_map.json", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    torch.manual_seed(SEED)
    tokens = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
              "pad_token_id": ids["<|endoftext|>"]}
    if kind == "qwen3next":
        refshape.make(out, SEED, VOCAB, tokens)
        _json(out / SIDECAR, refshape.sidecar())
    elif kind.startswith("gemma3n"):
        from transformers import Gemma3nForCausalLM, Gemma3nTextConfig  # the serving venv's, as above

        cfg = Gemma3nTextConfig(vocab_size=VOCAB, tie_word_embeddings=True, **tokens, **SHAPES[kind])
        cfg.architectures = ["Gemma3nForCausalLM"]
        model = Gemma3nForCausalLM(cfg)
        with torch.no_grad():  # initialised to zero, it would scale away everything the per-layer path adds
            for layer in model.model.layers:
                layer.altup.correct_output_scale.normal_(1.0, 0.1)
        model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM  # the serving venv's, as above

        cfg = Qwen3Config(vocab_size=VOCAB, rope_theta=1_000_000.0, tie_word_embeddings=True,
                          torch_dtype="bfloat16", **tokens, **SHAPE)
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
        _json(out / SIDECAR, {"layers": [{"k_scale": 1.0, "v_scale": 1.0}] * SHAPE["num_hidden_layers"]})
    for p in out.iterdir():
        os.chmod(p, 0o644)


def _json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint (the mark aside)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MARK}


def ready(folder: Path, kind: str = "qwen3") -> bool:
    """Whether ``folder`` holds a complete demo checkpoint of ``kind`` (its mark, and the files the mark lists,
    the scales sidecar of the kinds that carry one: one made before it had one is made again)."""
    try:
        mark = json.loads((folder / MARK).read_text())
    except (FileNotFoundError, ValueError):
        return False
    files = mark.get("files", {})
    return (mark.get("kind", "qwen3") == kind and (kind not in SIDECAR_KINDS or SIDECAR in files)
            and set(files) <= {p.name for p in folder.iterdir()})


def ensure(python: Path, folder: Path, root: Path, kind: str = "qwen3") -> tuple[bool, float]:
    """The demo checkpoint ``kind`` at ``folder``, made with ``python`` (the serving venv's) when missing;
    (made, seconds).

    Made in a sibling folder and renamed, so a kill leaves nothing a later run trusts; leftovers of a killed
    run are removed first. One maker at a time (a lock beside the folder): two rigs sharing RIG_CACHE, or two
    starts at once, must not remove each other's half-made folder or the complete one an engine already loads.
    """
    if ready(folder, kind):
        return False, 0.0
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _maker_lock(folder):
        if ready(folder, kind):  # made by the maker this one waited for
            return False, 0.0
        return _make(python, folder, root, kind)


@contextlib.contextmanager
def _maker_lock(folder: Path):  # noqa: ANN202 - a context manager
    with open(folder.parent / f".{folder.name}.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another maker of {folder}", err=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _make(python: Path, folder: Path, root: Path, kind: str) -> tuple[bool, float]:
    for stale in folder.parent.glob(f".{folder.name}.making-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.parent / f".{folder.name}.making-{os.getpid()}"
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        r = subprocess.run([str(python), "-m", "rig.build.demo", str(tmp), kind], cwd=root, env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise WorkFailed(problem(f"the demo model ({python} -m rig.build.demo)", "made",
                                     (r.stderr.strip().splitlines() or ["no output"])[-1],
                                     f"./build.sh (the venv {python.parent.parent} needs torch, transformers, "
                                     "tokenizers, compressed-tensors)"))
        _json(tmp / MARK, {"seed": SEED, "kind": kind, "shape": SHAPES[kind], "files": digest(tmp)})
        if folder.exists():
            shutil.rmtree(folder)  # an incomplete one (no mark): the rig's own, never trusted
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True, time.monotonic() - t0


if __name__ == "__main__":
    make(Path(sys.argv[1]), *sys.argv[2:3])
