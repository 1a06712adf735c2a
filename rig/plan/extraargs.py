"""A profile's ``extra_args`` beside the flags the rig sets itself: a repeat is merged, a contradiction refused.

vLLM takes the last of a repeated flag, so an ``extra_args`` entry such as ``--max-model-len 999`` would
silently override the profile's own ``max_model_len`` (and a repeat of ``--enable-expert-parallel`` doubled
the command line). Each flag the rig sets has the key or variable to use instead.
"""

from __future__ import annotations

from pathlib import Path

from rig.base.errors import BadInput, problem

#: The flags the rig sets, and where a user sets each.
OWNERS = {
    "--served-model-name": "MODEL_NAME", "--host": "HOST", "--port": "PORT",
    "--kv-cache-dtype": "the profile's kv_cache_dtype", "--max-model-len": "the profile's max_model_len",
    "--max-num-seqs": "MAX_SEQS", "--max-num-batched-tokens": "MAX_BATCHED_TOKENS",
    "--block-size": "the profile's block_size (it follows MAX_BATCHED_TOKENS)",
    "--speculative-config": "the profile's [speculative] table",
    "--compilation-config": "the profile's cudagraph_tokens_per_seq",
    "--gpu-memory-utilization": "the profile's memory_utilization",
    "--tensor-parallel-size": "the topology (CUDA_VISIBLE_DEVICES: the cards it is chosen from)",
    "--pipeline-parallel-size": "the topology (CUDA_VISIBLE_DEVICES: the cards it is chosen from)",
    "--enable-expert-parallel": "the topology (expert parallelism on a MoE of more than one card)",
    "--nnodes": "NODES", "--node-rank": "NODE_RANK", "--master-addr": "HEAD_ADDR", "--master-port": "HEAD_PORT",
    "--headless": "NODE_RANK", "--distributed-executor-backend": "DIST_BACKEND", "--shutdown-timeout": "DRAIN_TIMEOUT",
}
ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}


def _flag(token: str) -> str:
    name = token.split("=", 1)[0]
    name = ALIASES.get(name, name)
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def options(args: list[str]) -> list[tuple[str | None, str | None, list[str]]]:
    """``args`` in groups: (flag, its value or None, the words), and (None, None, [word]) for a lone word."""
    out: list[tuple[str | None, str | None, list[str]]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("-"):
            out.append((None, None, [tok]))
            i += 1
        elif "=" in tok:
            out.append((_flag(tok), tok.split("=", 1)[1], [tok]))
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            out.append((_flag(tok), args[i + 1], args[i:i + 2]))
            i += 2
        else:
            out.append((_flag(tok), None, [tok]))
            i += 1
    return out


def merge(rig_argv: list[str], extra: list[str], profile: Path) -> list[str]:
    """``extra`` without the flags the rig already sets to the same value; one set otherwise is exit 2."""
    mine = {flag: value for flag, value, _ in options(rig_argv) if flag in OWNERS}
    kept: list[str] = []
    for flag, value, words in options(extra):
        if flag not in mine:
            kept += words
        elif value != mine[flag]:
            given = " ".join(words)
            raise BadInput(problem(f"{profile}: extra_args", f"no flag the rig sets itself ({flag} is "
                                   f"{mine[flag] or 'set'} from {OWNERS[flag]})", given,
                                   f"remove {given!r} from extra_args and use {OWNERS[flag]}"))
    return kept
