"""The exact ``vllm serve`` command line and environment for the reference model.

A pure function of the settings and the topology, so the dry run, the supervisor, the tests
and the parse check under vLLM's real argument parser all see the same command. The API key
travels in the environment only: a command line is readable by every user of the box.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rig.base.errors import BadInput, problem
from rig.facts.config import Serve, Settings
from rig.facts.profiles import Profile
from rig.plan import extraargs, ple
from rig.plan.topology import Topology, engine_args

#: Variables the series defines; the rig checks their shape and passes them on unchanged.
SERIES_VARS = ("PLE_OFFLOAD", "PLE_HOME", "QWEN38_ABLITERATION", "ABLITERATION_DIR", "GUARD", "COUNTERS",
               "SCALES")
SECRET = "VLLM_API_KEY"
#: The rig's own secrets, for the rigs of a multi-node setting only: kept out of vLLM's environment and its
#: workers' (VLLM_API_KEY and HF_TOKEN are vLLM's own and pass).
RIG_SECRETS = ("NODES_SECRET",)
#: Each engine's own runtime folder under :func:`runtime_dir`: ``/`` and 8 hex digits (rig/running/supervise.py makes
#: it).
OWN_FOLDER = 9
#: An AF_UNIX socket's path holds at most 107 bytes, and vLLM names its sockets ``<base>/<uuid4>`` (37 more) inside
#: the engine's own folder.
SOCKET_ROOM = 107 - 37 - OWN_FOLDER


@dataclass(frozen=True)
class Engine:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # what the rig sets on top of the caller's environment

    def full_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment without the rig's own secrets, and what the rig sets on top."""
        given = os.environ if base is None else base
        return {**{k: v for k, v in given.items() if k not in RIG_SECRETS}, **self.env}

    def shown(self) -> list[str]:
        """The command and the variables the rig sets, the key masked: what a dry run prints."""
        out = ["command: " + shlex.join(self.argv), "environment:"]
        for k, v in sorted(self.env.items()):
            out.append(f"  {k}={'<set, ' + str(len(v)) + ' characters>' if k == SECRET and v else shlex.quote(v)}")
        return out


def cache_env(root: Path) -> dict[str, str]:
    """One cache root for every compile cache, so a crash-corrupted one is one folder to clear."""
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer")}


def runtime_dir(s: Settings) -> Path:
    """The engines' runtime folder: each engine the supervisor starts gets a folder of its own in it for vLLM's
    IPC sockets (``VLLM_RPC_BASE_PATH``) and temporary files (``TMPDIR``: the ``vllm_dist_*`` rendezvous files),
    removed when that engine is stopped or found dead, so none pile up in /tmp and a failed engine's cleanup never
    touches the next one's files. It is ``RIG_STATE/run``; a state path too long to hold a socket's name gets a
    short folder in /tmp named by a hash of it instead, made safely (rig/running/supervise.py: never through a link,
    ours and 0700)."""
    d = s.state_dir.resolve() / "run"
    if len(str(d)) <= SOCKET_ROOM:
        return d
    return Path("/tmp") / f"rig-run-{hashlib.sha256(str(d).encode()).hexdigest()[:12]}"


def clear_cache(root: Path) -> list[str]:
    """Empty the rig's caches under ``root`` (the folders :func:`cache_env` names); what was removed.

    CACHE_ROOT is a user's setting: it may name a folder that holds other things (a model, a home).
    Only the rig's own subfolders are removed, and a root holding anything else is refused whole.
    """
    known = sorted(Path(p).name for p in cache_env(root).values())
    if not root.exists() and not root.is_symlink():
        return []
    if not root.is_dir():
        raise BadInput(problem(f"CACHE_ROOT={root}", "a folder", "not a folder", "point CACHE_ROOT at a folder "
                               "of its own (the default is .vllm-cache); nothing was removed"))
    others = sorted(p.name for p in root.iterdir() if p.name not in known)
    if others:
        shown = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
        raise BadInput(problem(
            f"CACHE_ROOT={root} for --clear-cache", f"a folder holding only the rig's caches ({', '.join(known)})",
            f"also {shown}", "point CACHE_ROOT at a folder of its own (the default is .vllm-cache), or move "
            "those out of it; nothing was removed"))
    removed = []
    for name in known:
        path = root / name
        if path.is_symlink() or path.is_file():
            path.unlink()  # a link is removed, never what it points at
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        removed.append(name)
    return removed


def node_args(v: Serve) -> list[str]:
    """The switches of one node of a multi-node engine (none on one box): vLLM's multiprocessing executor gets
    the node count, this node's rank and the head's master address, and a worker runs headless (no API);
    with Ray, only the head runs ``vllm serve``, and Ray places the ranks."""
    if v.nodes == 1:
        return []
    if v.dist_backend == "ray":
        return ["--distributed-executor-backend", "ray"]
    args = ["--nnodes", str(v.nodes), "--node-rank", str(v.node_rank), "--master-addr", v.head_addr,
            "--master-port", str(v.head_port)]
    return args + (["--headless"] if v.node_rank else [])


def command(s: Settings, v: Serve, t: Topology, scales: Path | None, p: Profile,
            net: dict[str, str] | None = None, kv_cache_dtype: str | None = None) -> Engine:
    """The ``vllm serve`` argv and the environment the rig adds for it, from the profile and the settings
    (``net``: the variables that pin this node's interface, rig/base/netif.py; ``kv_cache_dtype``: instead of the
    profile's, when the plan found that this box cannot keep it)."""
    if v.ple_offload:
        ple.check_home(v.ple_home, t.order, s.device)
    argv = [str(s.venv_dir / "bin" / "vllm"), "serve", str(s.ckpt),
            "--served-model-name", *v.names,
            "--host", s.host, "--port", str(s.port),
            *engine_args(t), *node_args(v),
            "--kv-cache-dtype", kv_cache_dtype or p.kv_cache_dtype,
            "--max-model-len", str(p.max_model_len),
            "--max-num-seqs", str(v.max_seqs),
            "--max-num-batched-tokens", str(v.max_batched_tokens)]
    if v.drain_timeout:  # a stop lets the requests in flight finish (vLLM's drain; 0: its abort)
        argv += ["--shutdown-timeout", str(v.drain_timeout)]
    if p.block_size == "max_batched_tokens":
        argv += ["--block-size", str(v.max_batched_tokens)]
    if p.speculative:
        argv += ["--speculative-config", json.dumps(p.speculative)]
    if p.cudagraph_tokens_per_seq:
        # Each decode step of a request carries 1 + K tokens: graphs up to MAX_SEQS x (1 + K) cover them all.
        argv += ["--compilation-config",
                 json.dumps({"max_cudagraph_capture_size": v.max_seqs * p.cudagraph_tokens_per_seq})]
    if p.memory_utilization:
        argv += ["--gpu-memory-utilization", str(p.memory_utilization)]
    argv += extraargs.merge(argv, list(p.extra_args), p.path)
    run = str(runtime_dir(s))
    env = {
        "VLLM_LOG_STATS_INTERVAL": v.stats_interval,
        "PYTHONUNBUFFERED": "1",  # log lines reach the file as they happen, not at exit
        **cache_env(v.cache_root),
        "TMPDIR": run,
        "VLLM_RPC_BASE_PATH": run,
        **t.env,
        **p.env,
        "PLE_OFFLOAD": "1" if v.ple_offload else "0",
        "PLE_HOME": str(v.ple_home),
        "QWEN38_ABLITERATION": v.abliteration,
        "ABLITERATION_DIR": str(v.abliteration_dir),
        "GUARD": v.guard,
        "COUNTERS": "1" if v.counters else "0",
    }
    if s.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"  # the version says so too; the variable makes it certain
    else:
        env.update({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, t.order))})
    if scales is not None:
        env["SCALES"] = str(scales)
    env.update(net or {})
    if v.api_key:
        env[SECRET] = v.api_key
    return Engine(argv, env)


def open_to_network(host: str) -> bool:
    """True when the address is reachable from other machines (anything but loopback)."""
    return not (host == "localhost" or host.startswith("127.") or host == "::1")
