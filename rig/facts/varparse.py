"""The variables' row type (:class:`Var`) and their parsers: each parser gets its row (name, default) and the
environment, and returns the value or raises one line of bad input (exit 2) naming the variable. rig/facts/config.py
holds the table of rows."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rig.base.errors import BadInput, problem
from rig.facts import profiles

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
    group: str = "build"  # build | serve | bench | image | compose (read by docker-compose.yml only)
    derived: bool = False
    service: bool = False

    @property
    def literal(self) -> str | None:
        """The default as a value: None when it is derived (or unset)."""
        return None if self.derived else self.default

    @property
    def reader(self) -> str:
        return "compose" if self.group == "compose" else "rig"


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


def digits(raw: str) -> bool:
    """ASCII digits only: ``str.isdigit`` takes other scripts' digits too, some of which ``int`` refuses."""
    return raw.isascii() and raw.isdigit()


def whole(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not digits(raw) or int(raw) < 1:
        raise BadInput(problem(v.name, "a whole number >= 1", repr(raw), _fix(v)))
    return int(raw)


def whole_or_off(v: Var, env: Mapping[str, str], root: Path) -> int:
    """A whole number >= 0, where 0 turns the thing off."""
    raw = _raw(v, env) or ""
    if not digits(raw):
        raise BadInput(problem(v.name, "a whole number >= 0 (0 turns it off)", repr(raw), _fix(v)))
    return int(raw)


def whole_or_derived(v: Var, env: Mapping[str, str], root: Path) -> int | None:
    """A whole number >= 0, or None when unset: the settings derive it (the table's default says from what)."""
    raw = env.get(v.name, "").strip()
    if not raw:
        return None
    if not digits(raw):
        raise BadInput(problem(v.name, "a whole number >= 0", repr(raw), f"unset {v.name} ({v.default})"))
    return int(raw)


def index(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not digits(raw):
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
        ok = raw.isascii() and math.isfinite(float(raw)) and float(raw) > 0
    except ValueError:
        ok = False
    if not ok:
        raise BadInput(problem(v.name, "a number of seconds > 0", repr(raw), _fix(v)))
    return raw


def port(v: Var, env: Mapping[str, str], root: Path) -> int:
    raw = _raw(v, env) or ""
    if not digits(raw) or not 0 < int(raw) < 65536:
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


def _device_default(v: Var, env: Mapping[str, str], cuda: str, cpu: str) -> str:
    return env.get(v.name, "").strip() or (cpu if env.get("DEVICE", "").strip() == "cpu" else cuda)


def per_device(cuda: str, cpu: str) -> Parser:
    """A folder whose default depends on DEVICE, so the two builds sit side by side and never meet."""
    def parse(v: Var, env: Mapping[str, str], root: Path) -> Path:
        p = Path(_device_default(v, env, cuda, cpu)).expanduser()
        return p if p.is_absolute() else root / p
    return parse


def per_device_text(cuda: str, cpu: str) -> Parser:
    """A name whose default depends on DEVICE (an image tag: the two images never overwrite each other)."""
    def parse(v: Var, env: Mapping[str, str], root: Path) -> str:
        return _device_default(v, env, cuda, cpu)
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


def optional_host(v: Var, env: Mapping[str, str], root: Path) -> str:
    """An address or hostname, or '' when unset (whoever needs it says so)."""
    return host(v, env, root) if env.get(v.name, "").strip() else ""


def cards(v: Var, env: Mapping[str, str], root: Path) -> str:
    """Card indices in PCI bus order, each once (empty: every card). The topology chooser works on indices."""
    raw = (env.get(v.name, v.literal or "") or "").strip()
    if not raw:
        return raw
    items = [x.strip() for x in raw.split(",")]
    bad = [x for x in items if not digits(x)]
    if bad:
        uuid = any(x.startswith(("GPU-", "MIG-")) for x in bad)
        raise BadInput(problem(v.name, "card indices in PCI bus order, comma-separated (0,1,2,3)", repr(raw),
                               "set CUDA_VISIBLE_DEVICES to the indices nvidia-smi -L prints (CUDA_VISIBLE_DEVICES=0 "
                               "for the first card, CUDA_VISIBLE_DEVICES=0,1 for two), or unset it for every card"
                               + (" (GPU UUIDs are not supported: the "
                               "topology is chosen from indices and their P2P links)" if uuid else "")))
    twice = sorted({x for x in items if items.count(x) > 1})
    if twice:
        raise BadInput(problem(v.name, "each card once", f"{raw!r} (card {', '.join(twice)} more than once)",
                               f"list each card once, e.g. {','.join(dict.fromkeys(items))}"))
    return ",".join(items)


def _profile(env: Mapping[str, str]) -> profiles.Profile:
    return profiles.load(env.get("PROFILE", "").strip() or profiles.DEFAULT)


def abliteration(v: Var, env: Mapping[str, str], root: Path) -> str:
    """QWEN38_ABLITERATION: set, even to nothing, the value (empty: off); unset, the profile's ``abliteration``."""
    raw = env[v.name].strip() if v.name in env else _profile(env).abliteration
    if raw and not profiles.SET_NAME.match(raw):
        raise BadInput(problem(v.name, "the name of a direction set in ABLITERATION_DIR (letters, digits, . _ + -)",
                               repr(raw), f"put the file in ABLITERATION_DIR and set {v.name} to its name, or "
                               f"set {v.name}= to turn abliteration off"))
    return raw


def ple_offload(v: Var, env: Mapping[str, str], root: Path) -> bool:
    """PLE_OFFLOAD: 0 or 1; unset or empty (the environment file's line as written), the profile's ``ple_offload``."""
    raw = env.get(v.name, "").strip() or ("1" if _profile(env).ple_offload else "0")
    if raw not in ("0", "1"):
        raise BadInput(problem(v.name, "0 or 1", repr(raw), f"set {v.name}=0 or {v.name}=1, or unset it for the "
                               "profile's default"))
    return raw == "1"


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


def checkpoint(cache: Var) -> Parser:
    """CKPT, else the profile's checkpoint ({RIG_CACHE} in it is the rig's download cache, the row ``cache``)."""
    def parse(v: Var, env: Mapping[str, str], root: Path) -> Path:
        if env.get(v.name, "").strip():
            return path(v, env, root)
        return _profile(env).checkpoint_path(path(cache, env, root))
    return parse
