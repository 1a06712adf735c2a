"""The serve plan: settings, then the box report, the topology, the engine's command and environment.

:class:`Plan` is what ``./start.sh`` would run on this box, made by pure functions of the settings, the
profile and the box as read (NVML, psutil, the checkpoint's ``config.json``): the box check (rig/plan/box.py), the
cards the free-GPU gate waits for, the topology (rig/plan/topology.py), the interface between nodes (rig/base/netif.py)
and the ``vllm serve`` command with its environment (rig/plan/engine.py). ``./start.sh --dry-run`` prints it, the
tests read it, and rig/control/start.py acts on it (the gate, the supervised engine, the nodes). Nothing here starts a
process or writes a file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rig.base import cpuinfo, netif
from rig.base.console import say, warn
from rig.base.errors import BadInput, problem
from rig.build import demo
from rig.facts import config, profiles
from rig.facts.config import Serve, Settings
from rig.facts.profiles import Profile
from rig.plan import box, engine, topology
from rig.plan.engine import Engine
from rig.plan.topology import Topology


def inputs(s: Settings, env: Mapping[str, str]) -> tuple[Serve, Profile]:
    """The serve settings and the profile a plan of the build ``s`` is made from; a combination that cannot serve
    is refused (exit 2)."""
    v = config.serve_settings(env)
    p = profiles.load(s.profile)
    if v.nodes > 1 and v.dist_backend == "ray" and s.device == "cpu":
        raise BadInput(problem("DIST_BACKEND=ray", "mp with the CPU build: vLLM's CPU platform has no Ray executor "
                               "(its own check: 'current platform cpu does not support ray')", "ray",
                               "set DIST_BACKEND=mp; nox -s ray -- up brings a Ray cluster up on its own"))
    return v, p


# -- the box report -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BoxReport:
    """What the box check found: the NVML reading (None for the CPU build, or with no driver) and every check
    (none when the check was skipped: ``checked`` False)."""

    reading: box.Reading | None
    checks: tuple[box.Check, ...] = ()
    checked: bool = True

    @property
    def failed(self) -> list[box.Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def busy(self) -> bool:
        """Whether every check that failed is one that passes by itself later (the port: what holds it ends)."""
        return bool(self.failed) and all(c.name in box.TRANSIENT for c in self.failed)

    @property
    def refusal(self) -> str:
        """Why a start stops here (exit 2, or 75 when :attr:`busy`), or "" when the box passed or was not
        checked."""
        if not self.failed:
            return ""
        return problem("the box check", "every check to pass", f"{len(self.failed)} of {len(self.checks)} checks "
                       "failed (each is above, with its fix)", "fix those (nox -s doctor lists them all), or start "
                       "anyway with ./start.sh --skip-box-check")


def check_box(s: Settings, v: Serve, p: Profile, check: bool = True) -> BoxReport:
    """The box check of the profile's box (``check`` False, ``--skip-box-check``: only the cards are read)."""
    if check:
        reading, checks = box.start_checks(s, p, gpu_wait=v.gpu_wait, v=v)  # a busy card: the gate waits for it
        return BoxReport(reading, tuple(checks))
    try:
        reading = box.read_nvml() if s.device == "cuda" else None
    except box.NoDriver:
        reading = None
    return BoxReport(reading, checked=False)


def show_box(report: BoxReport, dry_run: bool) -> None:
    """The checks that did not pass, one line each with its fix (a dry run: every check), then one summary line."""
    if not report.checked:
        say("box: check skipped (--skip-box-check)")
        return
    for c in report.checks:
        if dry_run or c.status != "pass":
            say(c.line(), err=c.status != "pass")
    warned = sum(c.status == "warn" for c in report.checks)
    if not report.failed:
        say(f"box: {len(report.checks)} checks passed" + (f", {warned} warned" if warned else ""))


# -- the plan -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a start runs on this box, and how; made by :func:`plan`, acted on by rig/control/start.py."""

    s: Settings
    v: Serve
    profile: Profile
    report: BoxReport
    cards: tuple[int, ...]  # this node's cards (the CPU build: one engine, ``(0,)``)
    topology: Topology
    engine: Engine
    foreground: bool  # stays attached until the engine ends (--foreground, or LOG= empty)
    gate: tuple[int, ...] = ()  # the cards the free-GPU gate waits for, as positions in the reading; () no gate
    gate_note: str = ""  # why there is no gate, when it is worth a line
    kv_note: str = ""  # why the KV cache is not the profile's dtype on this box
    iface: netif.Interface | None = None  # the interface to the other nodes (NODES > 1)


def _layers(ckpt: Path, profile: Profile) -> int:
    """The checkpoint's decoder layers (``num_hidden_layers``, of the text model for a multimodal one).

    The demo's own folder before a real start has made it: the shape it will be made with."""
    if profile.name in demo.MADE and not (ckpt / "config.json").exists() and not ckpt.exists():
        return demo.SHAPES[demo.MADE[profile.name]]["num_hidden_layers"]
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(problem(f"{ckpt}/config.json", "the checkpoint's config, for the layers each node holds",
                               str(exc), "set CKPT to the checkpoint folder")) from None
    layers = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(layers, int):
        raise BadInput(problem(f"{ckpt}/config.json: num_hidden_layers", "a whole number", repr(layers),
                               "use a checkpoint whose config.json names its layers"))
    return layers


def _topology(s: Settings, v: Serve, profile: Profile, cards: list[int], p2p: dict) -> Topology:
    """This box's topology; with NODES > 1, every node is taken to hold cards like this one (the head checks
    each node's card count when it joins)."""
    if v.nodes == 1:
        return topology.choose(cards, p2p)
    try:
        return topology.across([(cards, p2p)] * v.nodes, _layers(s.ckpt, profile))
    except topology.Unfit as exc:
        raise BadInput(problem(f"NODES={v.nodes}", exc.expected, exc.found, exc.fix)) from None


def _cards(s: Settings, reading: box.Reading | None) -> tuple[list[int], dict]:
    if s.device != "cuda":
        return [0], {}  # the CPU: one engine, no cards
    if reading is not None:
        return [g.index for g in box.visible(reading, s.visible)], reading.p2p
    want = [int(x) for x in s.visible.split(",") if x.strip().isdigit()]
    return want or [0], {}  # no reading: assume no P2P, the safe switches


def _gate(s: Settings, v: Serve, reading: box.Reading | None) -> tuple[list[int], str]:
    """The cards the free-GPU gate (rig/running/gpugate.py) waits for, and why none; none for the CPU build, GPU_WAIT=0
    or no driver."""
    if s.device != "cuda":
        return [], ""
    if not v.gpu_wait:
        return [], "GPU gate: off (GPU_WAIT=0): the engine sizes its KV cache from whatever memory is free"
    if reading is None:
        return [], "GPU gate: skipped, no NVML reading (no NVIDIA driver here)"
    return box.positions(reading, s.visible), ""


def _kv_cache(s: Settings, p: Profile) -> tuple[str, str]:
    """The KV cache's dtype, and why when it is not the profile's: vLLM's CPU attention keeps an FP8 cache only
    with AVX-512 or AMX (it stops at load otherwise), so on another CPU the cache takes the model's dtype."""
    if s.device != "cpu" or not p.kv_cache_dtype.startswith("fp8") or cpuinfo.fp8_kv():
        return p.kv_cache_dtype, ""
    return "auto", (f"KV cache: {p.kv_cache_dtype} needs AVX-512 or AMX on vLLM's CPU engine and this CPU has "
                    "neither: the cache takes the model's dtype (auto); a SCALES sidecar is still checked and "
                    "loaded, with no FP8 cache to act on")


def plan(s: Settings, v: Serve, p: Profile, report: BoxReport, *, foreground: bool = False) -> Plan:
    """The plan for this node from its settings, profile and box report (``foreground``: ``--foreground``)."""
    cards, p2p = _cards(s, report.reading)
    gate, note = _gate(s, v, report.reading)
    topo = _topology(s, v, p, cards, p2p)
    iface = netif.choose(v.net_iface, v.head_addr, v.head_port) if v.nodes > 1 else None
    kv, kv_note = _kv_cache(s, p)
    eng = engine.command(s, v, topo, box.scales_path(s, p), p, iface.env() if iface else None, kv)
    return Plan(s, v, p, report, tuple(cards), topo, eng, foreground or not s.log, tuple(gate), note, kv_note,
                iface)


def show(pl: Plan) -> None:
    """The plan as a start says it: the gate, the topology, this node's part, and what is open to the network."""
    s, v, t = pl.s, pl.v, pl.topology
    if pl.gate_note:
        say(pl.gate_note)
    if pl.kv_note:
        warn(pl.kv_note)
    say(f"topology: TP{t.tp} x PP{t.pp}{' + EP' if t.ep else ''} on cards {','.join(map(str, t.order))}: {t.why}")
    if pl.iface:
        role = "the head" if v.node_rank == 0 else f"worker {v.node_rank}"
        say(f"nodes: {role} of {v.nodes} ({v.dist_backend}), head {v.head_addr}:{v.head_port}; interface "
            f"{pl.iface.name} {pl.iface.address} ({pl.iface.how}): VLLM_HOST_IP, NCCL_SOCKET_IFNAME, "
            "GLOO_SOCKET_IFNAME")
        netif.warn_if_public(pl.iface.address, "the node-to-node address")
    if engine.open_to_network(s.host) and v.api_key:
        warn(f"HOST={s.host}: VLLM_API_KEY guards only vLLM's /v1 routes; /metrics, /tokenize, /invocations and "
             f"others stay open to whoever reaches port {s.port} (vLLM issues 58144, 18892). Keep the port on a "
             "private network, or behind a proxy that checks the key")
    if engine.open_to_network(s.host) and not v.api_key:
        warn(f"HOST={s.host} with an empty VLLM_API_KEY: the API is OPEN to the network, anyone who reaches "
             f"port {s.port} can use it. Set VLLM_API_KEY, or HOST=127.0.0.1")


def show_command(pl: Plan) -> None:
    """The command and the variables the rig sets, the key masked: what a dry run prints."""
    for line in pl.engine.shown():
        say(line)
