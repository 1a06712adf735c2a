"""Every variable the rig reads, with its default and meaning, in one place.

The README's variables table is checked against :data:`VARS` by a test, so
the two cannot drift apart. Code reads values through :func:`settings`, never
through ``os.environ`` directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rig import REPO_ROOT
from rig.errors import BadInput, problem


@dataclass(frozen=True)
class Var:
    """One variable: its name, the default as the README shows it, its meaning."""

    name: str
    default: str
    meaning: str
    reader: str = "rig"  # "compose": read by docker-compose.yml only, not by the rig's code


VARS: tuple[Var, ...] = (
    Var("MAX_JOBS", "32", "Compile jobs for the kernels. Lower it when the compile runs out of RAM."),
    Var("ARCH", "8.6", "GPU architectures to compile for (`TORCH_CUDA_ARCH_LIST`); 8.6 is Ampere."),
    Var("NVCC_THREADS", "1", "Threads per nvcc job; `MAX_JOBS` is divided by it, as vLLM's setup.py does."),
    Var("OPS_ROUTE", "auto",
        "Kernels: `auto` (the official wheel's when the series touches no compiled input), `precompiled`, `compile`."),
    Var("STATUS_INTERVAL", "60", "Seconds between the status lines of a long compile or install."),
    Var("BUILD_LOG_DIR", ".", "Where `build-<timestamp>.log` (the full output of the ops step) goes: the repo root."),
    Var("UV", "unset", "Unset: use `uv` from PATH for the venv; `0`: refuse uv; a path: use that uv."),
    Var("FETCH", "0", "`1` fetches the upstream base again and re-applies the series."),
    Var("PACK", "1", "`0` skips step 8, the kernel pack (same as `--no-pack`)."),
    Var("CCACHE_DIR", "ccache's own", "Where ccache keeps compiled objects."),
    Var("VLLM_UPSTREAM_URL", "`[upstream].git` of series.toml",
        "Git URL or local path of upstream vLLM (a mirror works)."),
    Var("VLLM_SOURCE", "auto", "Where the base comes from: `auto` (git, else the PyPI sdist), `git`, or `sdist`."),
    Var("INDEX_URL", "https://pypi.org/simple", "Package index whose simple API serves the vLLM sdist."),
    Var("RIG_CACHE", "~/.cache/vllm-rig", "Downloads kept between runs (the vLLM sdist)."),
    Var("PATCHES_DIR", "patches", "The series: `NNNN-name.patch` files and `series.toml`."),
    Var("VLLM_DIR", "vllm", "The serving tree: the upstream base plus the series, a git repository."),
    Var("PYTHON", "unset", "The CPython 3.13 for the venv; unset: `UV_PYTHON`, uv's discovery, then pyenv's versions."),
    Var("UV_PYTHON", "unset", "uv's own choice of Python, read the same way as `PYTHON` (which wins)."),
    Var("VENV_DIR", ".venv", "The serving venv (CPython 3.13) that vLLM is installed into."),
    Var("RUNTIME_LOCK", "scripts/runtime.lock",
        "The hash-pinned runtime and build requirements (`nox -s lock` writes it)."),
    Var("CUDA_HOME", "unset",
        "A system CUDA toolkit to use; unset: the NVIDIA wheels in the venv, then /usr/local/cuda."),
    Var("ARTIFACTS_DIR", "artifacts", "Where step 8 writes the kernels tarball, its sha256 list and manifest."),
    Var("LOG", "/var/log/vllm.log", "The engine's log file; empty keeps the output on the terminal."),
    Var("VLLM_CONTAINER", "vllm", "The container `./vllm-logs.sh` reads with `docker logs` when not given `-f`."),
    Var("CKPT", "/data/models/halt95/Swift1.5-Qwen3.8-Flash-Next-W4A16-Merlin",
        "The checkpoint folder on the host (with its `config.json`)."),
    Var("SCALES", "`$CKPT/qsa_kv_scales.json`", "The FP8 KV scales sidecar of that checkpoint."),
    Var("HOST", "127.0.0.1", "The address the API listens on; `0.0.0.0` serves every interface."),
    Var("PORT", "8000", "The port the API listens on."),
    Var("CUDA_VISIBLE_DEVICES", "0,1,2,3", "The cards to use, in PCI bus order."),
    Var("RIG_STATE", ".rig", "The rig's own state: the build record, the build lock, cmake and ninja from PyPI, "
        "the engine's pid file."),
    Var("MODEL_NAME", "`qwen38-flash-next` (`start.sh`), `Hinata` (compose, systemd)",
        "The served model name (a request's `model`); spaces make aliases."),
    Var("VLLM_API_KEY", "empty", "The API key; empty: no authentication. Reaches vLLM through its environment, "
        "never the command line."),
    Var("CACHE_ROOT", ".vllm-cache", "One cache root for vLLM, Triton, TorchInductor and FlashInfer "
        "(`./start.sh --clear-cache` empties it)."),
    Var("MAX_SEQS", "4", "Concurrent requests; CUDA graphs are captured up to `MAX_SEQS` x 4 tokens (MTP K=3)."),
    Var("MAX_BATCHED_TOKENS", "2048", "The prefill chunk in tokens, and the KV block size; must be >= `MAX_SEQS`."),
    Var("VLLM_LOG_STATS_INTERVAL", "1", "Seconds between the engine's stats lines (vLLM's own default is 10)."),
    Var("PLE_HOME", "0", "The card that hosts the PLE offload (the series reads it)."),
    Var("QWEN38_ABLITERATION", "Qwen3.8-Flash-Next-Uncensored",
        "Refusal-direction removal at run time (the series reads it); empty turns it off."),
    Var("ABLITERATION_DIR", "abliteration", "The folder with the refusal-direction files."),
    Var("GUARD", "warn", "Bounds-guard telemetry of the series: `off`, `warn` or `raise`."),
    Var("COUNTERS", "0", "`1` adds the series' kernel counters to the log."),
    Var("START_TIMEOUT", "1800", "Seconds `./start.sh` waits for the first healthy answer (a first start "
        "compiles CUDA graphs)."),
    Var("STOP_TIMEOUT", "20", "Seconds `nox -s stop` waits after SIGTERM before it sends SIGKILL."),
    Var("BASE_URL", "`http://127.0.0.1:$PORT/v1`", "The server `benchmarks/bench.sh` measures."),
    Var("MODEL", "the first `MODEL_NAME`", "The model name `benchmarks/bench.sh` asks for."),
    Var("TOKENIZER", "`$CKPT`", "The tokenizer `benchmarks/bench.sh` counts tokens with (a folder with "
        "`tokenizer.json`, or the file)."),
    Var("MODEL_DIR", "none, required", "Container: the host folder of the checkpoint; compose stops with a message "
        "when it is empty.", "compose"),
    Var("MODEL_MOUNT_PATH", "/models/Qwen3.8-Flash-Next", "Container: where the checkpoint is mounted (read-only).",
        "compose"),
    Var("HOST_PORT", "8080", "Container: the host port the API is published on.", "compose"),
    Var("BIND_ADDR", "127.0.0.1", "Container: the host address the port is published on; `0.0.0.0` opens it to "
        "the network (Docker's publishing bypasses the host firewall).", "compose"),
    Var("CACHE_HOST_DIR", ".vllm-cache", "Container: the host folder mounted as the compile cache at `/cache`.",
        "compose"),
)

#: The served name of each path when MODEL_NAME is unset: start.sh's, and the container's and service's.
START_MODEL_NAME = "qwen38-flash-next"
SERVICE_MODEL_NAME = "Hinata"

VAR_NAMES = frozenset(v.name for v in VARS)
RIG_VARS = frozenset(v.name for v in VARS if v.reader == "rig")
SOURCES = ("auto", "git", "sdist")
ROUTES = ("auto", "precompiled", "compile")


@dataclass(frozen=True)
class Settings:
    """The variables of :data:`VARS`, parsed and checked."""

    root: Path
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
    upstream_url: str | None  # None: series.toml's [upstream].git
    source: str
    index_url: str
    cache: Path
    patches_dir: Path
    vllm_dir: Path
    state_dir: Path
    python: str | None  # PYTHON, else UV_PYTHON
    venv_dir: Path
    runtime_lock: Path
    cuda_home: Path | None
    artifacts_dir: Path
    log: str  # "" keeps the output on the terminal
    ckpt: Path
    scales: Path | None  # None: $CKPT/qsa_kv_scales.json (or the older name)
    host: str
    port: int
    visible: str
    container: str


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise BadInput(problem(name, "0 or 1", repr(raw), f"set {name}=0 or {name}=1, or unset it"))


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(problem(name, "a whole number >= 1", repr(raw), f"set {name}={default} or unset it"))
    return int(raw)


def _port(env: Mapping[str, str]) -> int:
    raw = env.get("PORT", "").strip() or "8000"
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise BadInput(problem("PORT", "a port number from 1 to 65535", repr(raw), "set PORT=8000, or unset it"))
    return int(raw)


@dataclass(frozen=True)
class BoxProfile:
    """What the reference box needs: four free 24 GB cards of one model, and room around them."""

    gpus: int = 4
    gpu_memory_gb: float = 24.0
    cuda: tuple[int, int] = (13, 0)
    ram_gib: float = 96.0  # the PLE table alone takes 69 GiB of host RAM
    shm_gb: float = 1.0
    disk_gb: float = 30.0  # for the build


REFERENCE_BOX = BoxProfile()


def _index(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if not raw.isdigit():
        raise BadInput(problem(name, "a card index (0, 1, ...)", repr(raw), f"set {name}={default} or unset it"))
    return int(raw)


def _seconds(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip() or default
    try:
        ok = float(raw) > 0
    except ValueError:
        ok = False
    if not ok:
        raise BadInput(problem(name, "a number of seconds > 0", repr(raw), f"set {name}={default} or unset it"))
    return raw


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "").strip() or choices[0]
    if raw not in choices:
        raise BadInput(problem(name, " or ".join(choices), repr(raw),
                               f"set {name} to one of {', '.join(choices)}, or unset it for {choices[0]}"))
    return raw


def _path(env: Mapping[str, str], name: str, default: Path, root: Path) -> Path:
    raw = env.get(name, "").strip()
    path = Path(raw).expanduser() if raw else default
    return path if path.is_absolute() else root / path


def settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Settings:
    """Read every variable from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    root = REPO_ROOT if root is None else Path(root)
    source = _choice(env, "VLLM_SOURCE", SOURCES)
    uv = env.get("UV", "").strip() or None
    return Settings(
        root=root,
        max_jobs=_int(env, "MAX_JOBS", 32),
        arch=env.get("ARCH", "").strip() or "8.6",
        nvcc_threads=_int(env, "NVCC_THREADS", 1),
        ops_route=_choice(env, "OPS_ROUTE", ROUTES),
        status_interval=_int(env, "STATUS_INTERVAL", 60),
        build_log_dir=_path(env, "BUILD_LOG_DIR", Path("."), root),
        uv=uv,
        fetch=_flag(env, "FETCH", False),
        pack=_flag(env, "PACK", True),
        ccache_dir=env.get("CCACHE_DIR", "").strip() or None,
        upstream_url=env.get("VLLM_UPSTREAM_URL", "").strip() or None,
        source=source,
        index_url=(env.get("INDEX_URL", "").strip() or "https://pypi.org/simple").rstrip("/"),
        cache=_path(env, "RIG_CACHE", Path.home() / ".cache" / "vllm-rig", root),
        patches_dir=_path(env, "PATCHES_DIR", Path("patches"), root),
        vllm_dir=_path(env, "VLLM_DIR", Path("vllm"), root),
        state_dir=_path(env, "RIG_STATE", Path(".rig"), root),
        python=env.get("PYTHON", "").strip() or env.get("UV_PYTHON", "").strip() or None,
        venv_dir=_path(env, "VENV_DIR", Path(".venv"), root),
        runtime_lock=_path(env, "RUNTIME_LOCK", Path("scripts/runtime.lock"), root),
        cuda_home=Path(env["CUDA_HOME"].strip()) if env.get("CUDA_HOME", "").strip() else None,
        artifacts_dir=_path(env, "ARTIFACTS_DIR", Path("artifacts"), root),
        log=env.get("LOG", "/var/log/vllm.log").strip(),
        container=env.get("VLLM_CONTAINER", "").strip() or "vllm",
        ckpt=Path(env.get("CKPT", "").strip() or "/data/models/halt95/Swift1.5-Qwen3.8-Flash-Next-W4A16-Merlin"),
        scales=Path(env["SCALES"].strip()) if env.get("SCALES", "").strip() else None,
        host=env.get("HOST", "").strip() or "127.0.0.1",
        port=_port(env),
        visible=env.get("CUDA_VISIBLE_DEVICES", "0,1,2,3").strip(),
    )


GUARDS = ("warn", "off", "raise")


@dataclass(frozen=True)
class Serve:
    """The variables only the serve path reads (a bad one never blocks a build)."""

    names: tuple[str, ...]
    api_key: str
    cache_root: Path
    max_seqs: int
    max_batched_tokens: int
    stats_interval: str
    ple_home: int
    abliteration: str
    abliteration_dir: Path
    guard: str
    counters: bool
    start_timeout: int
    stop_timeout: int


def serve_settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Serve:
    """Read and check the serve variables."""
    env = os.environ if env is None else env
    root = REPO_ROOT if root is None else Path(root)
    names = tuple((env.get("MODEL_NAME", "") or START_MODEL_NAME).split())
    if not names:
        raise BadInput(problem("MODEL_NAME", "one or more names", "only spaces", f"set MODEL_NAME={START_MODEL_NAME}"))
    max_seqs = _int(env, "MAX_SEQS", 4)
    batched = _int(env, "MAX_BATCHED_TOKENS", 2048)
    if batched < max_seqs:
        raise BadInput(problem("MAX_BATCHED_TOKENS", f">= MAX_SEQS ({max_seqs}): a prefill step must fit every "
                               "running request", str(batched), f"raise MAX_BATCHED_TOKENS to at least {max_seqs} "
                               "(2048 is the default), or lower MAX_SEQS"))
    return Serve(
        names=names,
        api_key=env.get("VLLM_API_KEY", "").strip(),
        cache_root=_path(env, "CACHE_ROOT", Path(".vllm-cache"), root),
        max_seqs=max_seqs,
        max_batched_tokens=batched,
        stats_interval=_seconds(env, "VLLM_LOG_STATS_INTERVAL", "1"),
        ple_home=_index(env, "PLE_HOME", 0),
        abliteration=env.get("QWEN38_ABLITERATION", "Qwen3.8-Flash-Next-Uncensored").strip(),
        abliteration_dir=_path(env, "ABLITERATION_DIR", Path("abliteration"), root),
        guard=_choice(env, "GUARD", GUARDS),
        counters=_flag(env, "COUNTERS", False),
        start_timeout=_int(env, "START_TIMEOUT", 1800),
        stop_timeout=_int(env, "STOP_TIMEOUT", 20),
    )


@dataclass(frozen=True)
class Bench:
    """What ``benchmarks/bench.sh`` measures against."""

    base_url: str
    model: str
    tokenizer: Path


def bench_settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Bench:
    env = os.environ if env is None else env
    s = settings(env, root)
    v = serve_settings(env, root)
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(s.host, s.host)
    return Bench(
        base_url=(env.get("BASE_URL", "").strip() or f"http://{host}:{s.port}/v1").rstrip("/"),
        model=env.get("MODEL", "").strip() or v.names[0],
        tokenizer=_path(env, "TOKENIZER", s.ckpt, s.root),
    )


def markdown_table() -> str:
    """The README's variables table, as this module defines it."""
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
