"""Greedy outputs of the real engine, in one process: run with the served venv's python.

    python greedy_probe.py OUT.json MODEL [vllm serve arguments ...]

The arguments are the rig's own ``vllm serve`` command (``./start.sh --demo --dry-run`` prints it); the engine
is vLLM's ``LLM`` built from them by vLLM's own parser, with the engine core in this process. It writes the
generated token ids of each prompt and the top logprobs of each step. With ``PROBE_DIRECTION`` naming a
``.safetensors`` vector (or one per layer), it also writes, after each decoder layer, the largest
|stream . r| / |stream| over the prompts' tokens, where stream is what the layer hands on to the residual stream.
With ``PROBE_PLE_ROWS`` (token ids, comma-separated) on a Gemma 3n model, it also writes the per-layer-embedding
rows the model looks up for them, unscaled (to compare with the checkpoint's table). With ``PROBE_FIRST``, the
engine's first step is a prompt of one token (its greedy tokens are written as ``first``): on a CPU with AMX tiles,
upstream's worker died on such a step (SIGILL; patch 0008).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process: hooks can see it

PROMPTS = ["hello there", "the quick brown fox", "one two three four", "tell me a story about a cat"]
MAX_TOKENS = 24
LOGPROBS = 5  # the top 5 of each step too: equal outputs mean equal numbers, not only equal argmaxes


def main() -> None:
    out, model, *args = sys.argv[1:]
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", model, *args])
    engine_args = EngineArgs.from_cli_args(ns)
    llm = LLM(**{k: getattr(engine_args, k) for k in vars(engine_args)})
    direction = os.environ.get("PROBE_DIRECTION")
    if direction:
        from safetensors.torch import load_file

        (r,) = load_file(direction).values()
        r = r.reshape(-1, r.shape[-1]).float()
        r = r / r.norm(dim=-1, keepdim=True)

        def hook(model):
            model.probe = {}

            def measure(i):
                def fn(module, inputs, output):
                    hidden, residual = output
                    stream = (hidden + residual).float()
                    ri = r[0] if len(r) == 1 else r[i]
                    ratio = ((stream @ ri).abs() / stream.norm(dim=-1)).max().item()
                    model.probe[i] = max(model.probe.get(i, 0.0), ratio)
                return fn

            for i, layer in enumerate(model.model.layers):
                layer.register_forward_hook(measure(i))

        llm.apply_model(hook)
    first = None
    if os.environ.get("PROBE_FIRST"):
        from vllm.inputs import TokensPrompt

        (one,) = llm.generate([TokensPrompt(prompt_token_ids=[100])], SamplingParams(temperature=0.0, max_tokens=2,
                                                                                     ignore_eos=True))
        first = list(one.outputs[0].token_ids)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  logprobs=LOGPROBS))
    import vllm

    result = {"vllm": os.path.dirname(vllm.__file__), "tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                           for o in outs]}
    if first is not None:
        result["first"] = first
    if direction:
        (probe,) = llm.apply_model(lambda model: dict(model.probe))
        result["component"] = [probe[i] for i in sorted(probe)]
    if os.environ.get("PROBE_PLE_ROWS"):  # a Gemma 3n: the per-layer rows the model looks up, for some token ids
        import torch

        ids = [int(x) for x in os.environ["PROBE_PLE_ROWS"].split(",")]

        def rows(model):
            decoder = model.model.self_decoder
            got = decoder.get_per_layer_input_embeddings(torch.tensor(ids)) / decoder.embed_scale_per_layer
            return got.float().tolist()

        (result["ple_rows"],) = llm.apply_model(rows)
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
