"""Parse ``vllm serve`` argvs with vLLM's own serve parser and validation; print what each took as JSON.

The argvs come on stdin as a JSON object, name -> argv (without the program); the answer is an object, name ->
the parsed values, or ``{"error": ...}`` for one the parser or the validation refused. One process for them
all: importing vLLM's parser takes most of the time. Run with the built venv's Python (no GPU needed:
``VLLM_TARGET_DEVICE=cpu``).
"""

import json
import sys

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEEP = ("model_tag", "model", "served_model_name", "host", "port", "tensor_parallel_size", "pipeline_parallel_size",
        "enable_expert_parallel", "disable_custom_all_reduce", "kv_cache_dtype", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "block_size", "speculative_config", "compilation_config", "api_key",
        "nnodes", "node_rank", "master_addr", "master_port", "headless", "distributed_executor_backend")


def parse(argv: list) -> dict:
    p = FlexibleArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    try:
        args = p.parse_args(argv)
        cmd.validate(args)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - the refusal is the answer
        return {"error": f"{exc.__class__.__name__}: {exc}"}
    return {k: getattr(args, k, None) for k in KEEP}


print(json.dumps({name: parse(argv) for name, argv in json.loads(sys.stdin.read()).items()}, default=str))
