"""Parse a ``vllm serve`` argv with vLLM's own serve parser and validation; print what it took as JSON.

Run with the built venv's Python (no GPU needed: ``VLLM_TARGET_DEVICE=cpu``).
"""

import json
import sys

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

p = FlexibleArgumentParser(prog="vllm")
sub = p.add_subparsers(dest="subparser")
cmd = ServeSubcommand()
cmd.subparser_init(sub)
args = p.parse_args(sys.argv[1:])
cmd.validate(args)
keep = ("model_tag", "model", "served_model_name", "host", "port", "tensor_parallel_size", "pipeline_parallel_size",
        "enable_expert_parallel", "disable_custom_all_reduce", "kv_cache_dtype", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "block_size", "speculative_config", "compilation_config", "api_key",
        "nnodes", "node_rank", "master_addr", "master_port", "headless", "distributed_executor_backend")
print(json.dumps({k: getattr(args, k, None) for k in keep}, default=str))
