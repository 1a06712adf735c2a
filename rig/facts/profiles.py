"""Model profiles: everything model-specific, one TOML file per model under ``models/``.

``PROFILE`` picks one (``reference``, the seed's model, by default). A profile says
which build it needs (``device``), where its checkpoint is, the names it is served
under, the engine's flags (context, KV cache dtype and scales sidecar, speculative
decoding, the block-size and CUDA-graph rules, extra arguments and environment),
the one-token health request, and the box it needs. Adding a model is adding one
file: the loader checks every key and type, so a bad file stops with the file,
the key, the expected and the found value.

A profile may inherit: ``base = "reference"`` takes every key of that profile and
overrides only what the file names (a table such as ``[box]`` key by key; an
empty table removes the base's). So a profile made to run the reference's shape
on a smaller box cannot drift from the reference's settings. An error names the
file the key came from.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rig import REPO_ROOT
from rig.base.errors import BadInput, problem

MODELS_DIR = REPO_ROOT / "models"
DEFAULT = "reference"

#: key -> (type, required, what it holds); the tables are checked key by key below.
TOP: dict[str, tuple[type | tuple[type, ...], bool, str]] = {
    "base": (str, False, "a profile whose every key this one takes, overriding only what it names"),
    "description": (str, True, "one line on the model"),
    "device": (str, True, "the build it needs: cuda or cpu"),
    "checkpoint": (str, True, "the default CKPT ({RIG_CACHE} is replaced)"),
    "served_name": (str, True, "start.sh's default MODEL_NAME"),
    "service_name": (str, True, "compose's and systemd's default MODEL_NAME"),
    "max_model_len": (int, True, "the context length in tokens"),
    "kv_cache_dtype": (str, False, "auto or fp8"),
    "scales": (list, False, "KV scales sidecar names in the checkpoint, current first"),
    "abliteration": (str, False, "the default QWEN38_ABLITERATION: a direction set's name, empty for none"),
    "ple_offload": (bool, False, "the default PLE_OFFLOAD: the per-layer-embedding table in host RAM (Gemma 3n)"),
    "block_size": (str, False, "max_batched_tokens, or empty for vLLM's default"),
    "cudagraph_tokens_per_seq": (int, False, "CUDA graphs up to MAX_SEQS x this many tokens (0: vLLM's default)"),
    "memory_utilization": ((int, float), False, "--gpu-memory-utilization (0: vLLM's default)"),
    "extra_args": (list, False, "more vllm serve arguments"),
    "speculative": (dict, False, "the --speculative-config table"),
    "health": (dict, False, "fields added to the one-token health request"),
    "env": (dict, False, "variables the engine gets"),
    "box": (dict, True, "what the box needs"),
}
BOX: dict[str, tuple[type | tuple[type, ...], str]] = {
    "gpus": (int, "cards"), "gpu_memory_gb": ((int, float), "GB per card"), "cuda": (str, "driver CUDA, e.g. 13.0"),
    "ram_gib": ((int, float), "host RAM"), "shm_gb": ((int, float), "/dev/shm"), "disk_gb": ((int, float), "free disk"),
    "cores": (int, "CPU cores"), "cpu_flags": (list, "CPU flags, e.g. [\"avx2\"]"),
}
#: The range of every numeric key, top-level and ``box.*``: (lowest, highest), both allowed; finite always.
RANGES: dict[str, tuple[float, float]] = {
    "max_model_len": (1, 2**31 - 1), "cudagraph_tokens_per_seq": (0, 1024),
    "memory_utilization": (0, 1),  # a share of each card; 0 leaves it to vLLM
    "box.gpus": (0, 1024), "box.gpu_memory_gb": (0, 1e6), "box.ram_gib": (0, 1e6), "box.shm_gb": (0, 1e6),
    "box.disk_gb": (0, 1e9), "box.cores": (0, 1e6),
}
DEVICES = ("cuda", "cpu")
#: The tables a profile that inherits merges key by key with its base's (an empty one removes the base's).
TABLES = ("speculative", "health", "env", "box")
#: an abliteration direction set's name: a file in ABLITERATION_DIR, never a path out of it
SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Box:
    """What a profile needs of the box; 0 means no need."""

    gpus: int = 0
    gpu_memory_gb: float = 0.0
    cuda: tuple[int, int] = (0, 0)
    ram_gib: float = 0.0
    shm_gb: float = 0.0
    disk_gb: float = 0.0
    cores: int = 0
    cpu_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    description: str
    device: str
    checkpoint: str
    served_name: str
    service_name: str
    max_model_len: int
    kv_cache_dtype: str = "auto"
    scales: tuple[str, ...] = ()
    abliteration: str = ""
    ple_offload: bool = False
    block_size: str = ""
    cudagraph_tokens_per_seq: int = 0
    memory_utilization: float = 0.0
    extra_args: tuple[str, ...] = ()
    speculative: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    box: Box = Box()
    base: str = ""  # the profile it inherits from, if any

    def checkpoint_path(self, cache: Path) -> Path:
        return Path(self.checkpoint.replace("{RIG_CACHE}", str(cache))).expanduser()


def names(folder: Path = MODELS_DIR) -> list[str]:
    return sorted(p.stem for p in Path(folder).glob("*.toml"))


def _bad(path: Path, key: str, expected: str, found: object, fix: str) -> BadInput:
    return BadInput(problem(f"{path}: {key}", expected, repr(found), fix))


def _typed(path: Path, key: str, value: object, kind: type | tuple[type, ...], what: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        want = " or ".join(k.__name__ for k in kinds)
        raise _bad(path, key, f"a {want} ({what})", value, f"write {key} as a {want}")


def _in_ranges(data: dict, at: Callable[[str], Path]) -> None:
    """Every numeric key within its range (RANGES): a value vLLM would refuse late, or take, stops here."""
    for key, (lo, hi) in RANGES.items():
        table, _, sub = key.rpartition(".")
        value = (data.get(table) or {}).get(sub) if table else data.get(key)
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            fmt = "{:g}".format
            raise _bad(at(key), key, f"a number from {fmt(lo)} to {fmt(hi)}", value,
                       f"set {key} within that range (profiles: docs/serving.md)")


def _read(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(problem(str(path), "valid TOML", f"a syntax error ({exc})", "fix the line named")) from None
    for key, value in data.items():
        if key not in TOP:
            raise _bad(path, key, f"one of the keys {', '.join(TOP)}", key, f"remove {key}, or fix its spelling")
        _typed(path, key, value, TOP[key][0], TOP[key][2])
    return data


def _inherited(path: Path, folder: Path, chain: tuple[str, ...] = ()) -> tuple[dict, dict[str, Path]]:
    """The keys of the profile at ``path`` over those of its base, recursively, and the file each key came from
    (``box.gpus`` for a table's key)."""
    data = _read(path)
    origin = {k: path for k in data} | {f"{k}.{sub}": path for k in TABLES if isinstance(data.get(k), dict)
                                        for sub in data[k]}
    base = data.pop("base", None)
    if base is None:
        return data, origin
    chain = (*chain, path.stem)
    if base in chain:
        raise _bad(path, "base", "a chain of profiles that ends", base, "remove base from one of the profiles of "
                   f"the cycle {' -> '.join((*chain, base))}")
    if not (Path(folder) / f"{base}.toml").is_file():
        raise _bad(path, "base", f"one of the profiles in {folder}: {', '.join(names(folder))}", base,
                   f"set base to one of them, or add {Path(folder) / f'{base}.toml'}")
    parent, where = _inherited(Path(folder) / f"{base}.toml", folder, chain)
    if "device" in data and "device" in parent and data["device"] != parent["device"]:
        raise _bad(path, "device", f"{parent['device']!r}, the device of its base {where['device']}", data["device"],
                   f"remove device from {path.name} (it takes its base's), or choose a base of device "
                   f"{data['device']!r}")
    merged = {**parent, **data}
    for k in TABLES:
        if data.get(k) and isinstance(parent.get(k), dict):
            merged[k] = {**parent[k], **data[k]}
    return merged, {**where, **origin}


def load(name: str, folder: Path = MODELS_DIR) -> Profile:
    """The profile ``name`` from ``folder``, with what it inherits, every key checked."""
    path = Path(folder) / f"{name}.toml"
    if not path.is_file():
        raise BadInput(problem(f"PROFILE={name}", f"one of the profiles in {folder}: {', '.join(names(folder))}",
                               "no such profile", f"set PROFILE to one of them, or add {path}"))
    base = _read(path).get("base", "")
    data, origin = _inherited(path, folder)
    return _profile(name, path, base, data, origin)


def _profile(name: str, path: Path, base: str, data: dict, origin: dict[str, Path]) -> Profile:
    """The checked profile from its merged keys (``origin``: the file each came from, for the errors)."""
    def at(key: str) -> Path:
        return origin.get(key, path)

    for key, (_, required, what) in TOP.items():
        if required and key not in data:
            raise _bad(path, key, f"a value ({what})", None, f"add {key} to {path.name}")
    if data["device"] not in DEVICES:
        raise _bad(at("device"), "device", "cuda or cpu", data["device"], "set device = \"cuda\" or \"cpu\"")
    if data.get("block_size", "") not in ("", "max_batched_tokens"):
        raise _bad(at("block_size"), "block_size", "max_batched_tokens, or empty", data["block_size"],
                   "set block_size = \"max_batched_tokens\" or remove it")
    for key in ("scales", "extra_args"):
        if not all(isinstance(x, str) for x in data.get(key, [])):
            raise _bad(at(key), key, "a list of strings", data[key], f"write {key} as [\"...\", ...]")
    if not all(isinstance(v, str) for v in data.get("env", {}).values()):
        raise _bad(at("env"), "env", "a table of strings", data["env"], "quote every value of [env]")
    if data.get("abliteration") and not SET_NAME.match(data["abliteration"]):
        raise _bad(at("abliteration"), "abliteration", "a direction set's name in ABLITERATION_DIR (letters, "
                   "digits, . _ + -)", data["abliteration"], "write the file's name without its folder, or remove the "
                   "key")
    box = data["box"]
    for key, value in box.items():
        if key not in BOX:
            raise _bad(at(f"box.{key}"), f"box.{key}", f"one of the keys {', '.join(BOX)}", key, f"remove box.{key}")
        _typed(at(f"box.{key}"), f"box.{key}", value, BOX[key][0], BOX[key][1])
    _in_ranges(data, at)
    if "cuda" in box and not re.fullmatch(r"\d+\.\d+", box["cuda"]):
        raise _bad(at("box.cuda"), "box.cuda", "a CUDA version like 13.0", box["cuda"], "write cuda = \"13.0\"")
    cuda = tuple(int(x) for x in box["cuda"].split(".")) if "cuda" in box else (0, 0)
    return Profile(
        name=name, path=path, description=data["description"], device=data["device"],
        checkpoint=data["checkpoint"], served_name=data["served_name"], service_name=data["service_name"],
        max_model_len=data["max_model_len"], kv_cache_dtype=data.get("kv_cache_dtype", "auto"),
        scales=tuple(data.get("scales", ())), abliteration=data.get("abliteration", ""),
        ple_offload=data.get("ple_offload", False),
        block_size=data.get("block_size", ""), cudagraph_tokens_per_seq=data.get("cudagraph_tokens_per_seq", 0),
        memory_utilization=float(data.get("memory_utilization", 0)), extra_args=tuple(data.get("extra_args", ())),
        speculative=data.get("speculative", {}), health=data.get("health", {}), env=data.get("env", {}),
        box=Box(gpus=box.get("gpus", 0), gpu_memory_gb=float(box.get("gpu_memory_gb", 0)), cuda=cuda,
                ram_gib=float(box.get("ram_gib", 0)), shm_gb=float(box.get("shm_gb", 0)),
                disk_gb=float(box.get("disk_gb", 0)), cores=box.get("cores", 0),
                cpu_flags=tuple(box.get("cpu_flags", ()))), base=base)
