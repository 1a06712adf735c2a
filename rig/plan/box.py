"""Test the box: GPUs, driver, RAM, /dev/shm, disk, port, checkpoint and its KV scales.

GPU facts come from NVML (nvidia-ml-py), never from parsing nvidia-smi; memory from psutil.
The requirements come from the model profile's ``[box]`` (rig/facts/profiles.py); a CPU build is
checked for RAM, cores and CPU flags instead of cards. Each check is one line:
what, expected, found, and the fix when it fails. ``nox -s doctor`` prints them all with the
PCIe link, power limit and P2P status of every card: what a bug report wants.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rig.base import cpuinfo
from rig.facts.config import Serve, Settings
from rig.facts.profiles import Box, Profile
from rig.plan import ple

P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by regkey", 5: "not supported", 6: "unknown"}


@dataclass
class Gpu:
    index: int
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    compute_capability: tuple[int, int]
    pcie_gen_cur: int
    pcie_gen_max: int
    pcie_width_cur: int
    pcie_width_max: int
    power_limit_mw: int
    compute_processes: list[int] = field(default_factory=list)
    # pid -> bytes NVML counts to that process on this card; a pid absent is unknown (usedGpuMemory is None
    # on some drivers, e.g. under MIG or in a container).
    process_memory: dict[int, int] = field(default_factory=dict)

    def mib_by_process(self) -> dict[int, int]:
        """pid -> MiB NVML counts to each compute process on this card (0 where the driver does not say)."""
        return {pid: self.process_memory.get(pid, 0) >> 20 for pid in self.compute_processes}


@dataclass
class Reading:
    driver: str
    cuda_driver: int  # 13000 = CUDA 13.0
    gpus: list[Gpu]
    p2p: dict[tuple[int, int], str]


class NoDriver(Exception):
    """NVML could not be loaded: no NVIDIA driver on this machine."""


def read_nvml() -> Reading:
    """What NVML says about every card (in PCI bus order)."""
    import pynvml as nv  # slow to import (0.2 s), and only the CUDA build reads the cards

    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise NoDriver(f"{type(exc).__name__}: {exc}") from None
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        gpus = []
        for i, h in enumerate(handles):
            mem = nv.nvmlDeviceGetMemoryInfo(h)

            def opt(fn, *a, default=0):
                try:
                    return fn(*a)
                except nv.NVMLError:
                    return default

            name = nv.nvmlDeviceGetName(h)
            procs = opt(nv.nvmlDeviceGetComputeRunningProcesses, h, default=[])
            bus = nv.nvmlDeviceGetPciInfo(h).busId
            gpus.append(Gpu(
                index=i, name=name.decode() if isinstance(name, bytes) else name,
                pci_bus_id=bus.decode() if isinstance(bus, bytes) else bus,
                memory_total=mem.total, memory_used=mem.used,
                compute_capability=tuple(nv.nvmlDeviceGetCudaComputeCapability(h)),
                pcie_gen_cur=opt(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_gen_max=opt(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width_cur=opt(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                pcie_width_max=opt(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                power_limit_mw=opt(nv.nvmlDeviceGetEnforcedPowerLimit, h),
                compute_processes=[p.pid for p in procs],
                process_memory={p.pid: p.usedGpuMemory for p in procs if getattr(p, "usedGpuMemory", None) is not None},
            ))
        p2p = {}
        for a, b in itertools.permutations(range(len(handles)), 2):
            try:
                code = nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], nv.NVML_P2P_CAPS_INDEX_READ)
            except nv.NVMLError:
                code = 6
            p2p[(a, b)] = P2P_STATUS.get(code, "unknown")
        driver = nv.nvmlSystemGetDriverVersion()
        return Reading(driver.decode() if isinstance(driver, bytes) else driver, nv.nvmlSystemGetCudaDriverVersion(),
                       sorted(gpus, key=lambda g: g.pci_bus_id), p2p)
    finally:
        nv.nvmlShutdown()


def _processes(d: dict) -> tuple[list[int], dict[int, int]]:
    """A recorded card's ``compute_processes``: pids, or NVML's own records ``{"pid", "used_gpu_memory"}``
    (``used_gpu_memory`` null or absent: unknown)."""
    pids, memory = [], {}
    for p in d.get("compute_processes", []):
        if isinstance(p, dict):
            pids.append(int(p["pid"]))
            if p.get("used_gpu_memory") is not None:
                memory[int(p["pid"])] = int(p["used_gpu_memory"])
        else:
            pids.append(int(p))
    return pids, memory


def reading_from_json(data: dict) -> Reading:
    """A recorded NVML reading (the shape of shared/reference/nvml-h200.json) for tests and bug reports."""
    gpus = [Gpu(index=d["index"], name=d["name"], pci_bus_id=d["pci_bus_id"], memory_total=d["memory_total"],
                memory_used=d["memory_used"], compute_capability=tuple(d["compute_capability"]),
                pcie_gen_cur=d["pcie_gen_cur"], pcie_gen_max=d["pcie_gen_max"], pcie_width_cur=d["pcie_width_cur"],
                pcie_width_max=d["pcie_width_max"], power_limit_mw=d.get("enforced_power_limit_mw", 0),
                compute_processes=_processes(d)[0], process_memory=_processes(d)[1]) for d in data["devices"]]
    p2p = {(int(a), int(b)): s for key, s in data.get("p2p", {}).items() for a, b in [key.split("-")]}
    return Reading(data["driver"], data["cuda_driver"], gpus, p2p)


@dataclass
class Check:
    name: str
    status: str  # pass | fail | warn
    expected: str
    found: str
    fix: str = ""

    def line(self) -> str:
        tail = f". Fix: {self.fix}" if self.status != "pass" and self.fix else ""
        return f"{self.status:4}  {self.name}: expected {self.expected}, found {self.found}{tail}"


def visible(reading: Reading, spec: str) -> list[Gpu]:
    """The cards CUDA_VISIBLE_DEVICES names (indices in PCI bus order), those that exist."""
    want = [int(x) for x in spec.split(",") if x.strip().isdigit()] if spec else [g.index for g in reading.gpus]
    by_pos = {i: g for i, g in enumerate(reading.gpus)}
    return [by_pos[i] for i in want if i in by_pos]


def positions(reading: Reading, spec: str) -> list[int]:
    """The cards ``CUDA_VISIBLE_DEVICES`` names, as positions in the reading (PCI bus order), like :func:`visible`:
    the cards the free-GPU gate (rig/running/gpugate.py) waits for."""
    at = {id(g): i for i, g in enumerate(reading.gpus)}
    return [at[id(g)] for g in visible(reading, spec)]


def gpu_checks(reading: Reading | None, s: Settings, profile: Box, why: str = "", gpu_wait: int = 0) -> list[Check]:
    """The card checks; ``gpu_wait`` > 0 (start with GPU_WAIT on): a busy card only warns, the free-GPU gate
    (rig/running/gpugate.py) waits for it before the engine starts."""
    if reading is None:
        return [Check("NVIDIA driver", "fail", "NVML (the driver's libnvidia-ml.so.1)", f"none ({why})",
                      "install the NVIDIA driver, or run on the GPU host")]
    out = []
    major, minor = divmod(reading.cuda_driver // 10, 100)
    want = f"CUDA {profile.cuda[0]}.{profile.cuda[1]} or newer"
    out.append(Check("driver", "pass" if (major, minor) >= profile.cuda else "fail", want,
                     f"driver {reading.driver}, CUDA {major}.{minor}", "update the NVIDIA driver"))
    cards = visible(reading, s.visible)
    out.append(Check("GPUs", "pass" if len(cards) >= profile.gpus else "fail",
                     f"{profile.gpus} cards in CUDA_VISIBLE_DEVICES={s.visible or 'all'}",
                     f"{len(cards)} ({len(reading.gpus)} on the box)",
                     "add cards, or set CUDA_VISIBLE_DEVICES to the free ones"))
    names = sorted({g.name for g in cards})
    out.append(Check("card models", "pass" if len(names) <= 1 else "fail", "one model", ", ".join(names) or "none",
                     "set CUDA_VISIBLE_DEVICES to cards of one model"))
    for g in cards:
        gb = g.memory_total / 1e9
        out.append(Check(f"GPU {g.index} memory", "pass" if gb >= profile.gpu_memory_gb * 0.95 else "fail",
                         f">= {profile.gpu_memory_gb:.0f} GB", f"{gb:.1f} GB ({g.name})", "use cards of 24 GB or more"))
        busy = "warn" if gpu_wait else "fail"
        out.append(Check(f"GPU {g.index} free", busy if g.compute_processes else "pass", "no compute process",
                         f"pids {', '.join(map(str, g.compute_processes))}" if g.compute_processes else "none",
                         f"start waits up to GPU_WAIT={gpu_wait} s for it to end; stop it if it will not "
                         "(nox -s stop if it is an earlier engine)"
                         if gpu_wait else "stop the other process (nox -s stop if it is an earlier engine)"))
    return out


def host_checks(s: Settings, p: Profile) -> list[Check]:
    profile = p.box
    out = []
    if profile.cores:
        cores = os.cpu_count() or 0
        out.append(Check("CPU cores", "pass" if cores >= profile.cores else "fail", f">= {profile.cores}",
                         str(cores), f"run {p.name} on a box with more cores"))
    if profile.cpu_flags:
        lacking = [f for f in profile.cpu_flags if f not in cpuinfo.flags()]
        out.append(Check("CPU flags", "fail" if lacking else "pass", " ".join(profile.cpu_flags),
                         f"missing {' '.join(lacking)}" if lacking else "present",
                         f"serve {p.name} on a CPU with {' '.join(lacking)}"))
    ram = psutil.virtual_memory().total / 2**30
    out.append(Check("RAM", "pass" if ram >= profile.ram_gib else "fail", f">= {profile.ram_gib:.0f} GiB",
                     f"{ram:.1f} GiB", f"add memory (the {p.name} profile's [box] ram_gib)"))
    try:
        shm = shutil.disk_usage("/dev/shm").total / 1e9
    except FileNotFoundError:
        shm = 0.0
    size = f"{max(1, math.ceil(profile.shm_gb))}g"
    out.append(Check("/dev/shm", "pass" if shm >= profile.shm_gb else "fail", f">= {profile.shm_gb:g} GB",
                     f"{shm:.2f} GB", f"mount a larger /dev/shm (docker run --shm-size={size}; compose: shm_size)"))
    free = shutil.disk_usage(s.root).free / 1e9
    out.append(Check("disk", "pass" if free >= profile.disk_gb else "warn", f">= {profile.disk_gb:.0f} GB free",
                     f"{free:.0f} GB free at {s.root}", "free disk space for the build"))
    out.append(port_check(s))
    out += model_checks(s, p)
    return out


#: The checks whose failure passes by itself later (a start fails with exit 75, which the unit restarts).
TRANSIENT = ("port",)


def port_check(s: Settings) -> Check:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((s.host, s.port))
            return Check("port", "pass", f"{s.host}:{s.port} free", "free")
        except OSError as exc:
            return Check("port", "fail", f"{s.host}:{s.port} free", f"in use ({exc.strerror})",
                         "stop what listens there, or set PORT")


def model_checks(s: Settings, p: Profile) -> list[Check]:
    ckpt = s.ckpt
    if not ckpt.is_dir():
        return [Check("checkpoint", "fail", f"a folder at CKPT={ckpt}", "no such folder",
                      "set CKPT to the checkpoint folder")]
    if not (ckpt / "config.json").is_file():
        return [Check("checkpoint", "fail", f"{ckpt}/config.json", "no config.json",
                      "point CKPT at the checkpoint folder itself")]
    out = [Check("checkpoint", "pass", "a folder with config.json", str(ckpt)), *context_check(ckpt, p)]
    if s.device == "cpu":
        out += cpu_engine_checks(ckpt, p)
    if not p.scales and not s.scales:
        return out  # the profile's KV cache needs no scales sidecar
    if s.scales:
        ok = s.scales.is_file()
        out.append(Check("KV scales", "pass" if ok else "fail", f"the FP8 KV scales at SCALES={s.scales}",
                         "present" if ok else "no such file", "set SCALES to this checkpoint's sidecar"))
        return out
    new, *olds = (ckpt / n for n in p.scales)
    old = next((o for o in olds if o.is_file()), None)
    if new.is_file():
        out.append(Check("KV scales", "pass", f"{new.name} in the checkpoint", str(new)))
    elif old is not None:
        out.append(Check("KV scales", "warn", f"{new.name} in the checkpoint", f"the older name {old.name}",
                         f"it is used; rename it to {new.name} to silence this"))
    else:
        out.append(Check("KV scales", "fail", f"{new.name} in {ckpt}", "none",
                         "copy this checkpoint's FP8 KV scales there, or set SCALES "
                         "(another checkpoint's will not do)"))
    return out


#: config.json's keys for the longest context a model was made for (vLLM v0.30.0 reads these, and text_config's).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len", "model_max_length")


def context_check(ckpt: Path, p: Profile) -> list[Check]:
    """The profile's max_model_len against the checkpoint's own limit: vLLM refuses a longer one only after 20-40 s
    of its start, with a pydantic traceback. The limit is the largest of the context keys, with a RoPE scaling
    factor applied: so a start is refused here only where vLLM would refuse it too."""
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return []  # vLLM names a malformed config itself
    tables = [t for t in (config, config.get("text_config")) if isinstance(t, dict)]
    found = [(t[k], k) for t in tables for k in CONTEXT_KEYS
             if isinstance(t.get(k), int) and not isinstance(t.get(k), bool) and t[k] > 0]
    if not found:
        return []
    limit, key = max(found)
    scaling = [t.get("rope_scaling") or {} for t in tables]
    factor = max([float(r.get("factor", 1) or 1) for r in scaling if isinstance(r, dict)] + [1.0])
    if p.max_model_len <= limit * factor:
        return []
    scaled = f" x its rope_scaling factor {factor:g}" if factor > 1 else ""
    return [Check("context", "fail", f"max_model_len at most the checkpoint's {key} {limit:,}{scaled}",
                  f"{p.max_model_len:,} ({p.path.name})", f"lower max_model_len (a profile of your own with base = "
                  f"\"{p.name}\" and max_model_len = {int(limit * factor)}), or serve a checkpoint made for that "
                  "context")]


def cpu_engine_checks(ckpt: Path, p: Profile) -> list[Check]:
    """What vLLM's CPU build cannot run of this model and profile (rig/base/cpuinfo.py's engine_gaps): each a failed
    check, before any engine starts, instead of a traceback minutes into its start."""
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return []  # the checkpoint check above names an unreadable one; vLLM names a malformed one
    fix = (f"serve {p.name} on the CUDA build (a GPU box), or make a profile of your own with base = \"{p.name}\" "
           "that leaves it out (speculative = {} removes the speculative decoding)")
    return [Check("CPU engine", "fail", f"{what}: something vLLM's CPU build runs", why, fix)
            for what, why in cpuinfo.engine_gaps(config if isinstance(config, dict) else {}, p.speculative)]


def abliteration_file(v: Serve) -> Path | None:
    """The direction set QWEN38_ABLITERATION names (patch 0005 reads the same path), or None when it is off."""
    if not v.abliteration:
        return None
    name = v.abliteration if v.abliteration.endswith(".safetensors") else f"{v.abliteration}.safetensors"
    return v.abliteration_dir / name


def ple_check(v: Serve, ckpt: Path) -> list[Check]:
    """PLE_OFFLOAD=1: the checkpoint has the table, and the host has its size available in RAM."""
    if not v.ple_offload or not (ckpt / "config.json").is_file():
        return []
    found = ple.table_bytes(ckpt)
    if found is None:
        return [Check("PLE offload", "fail", f"a per-layer-embedding table (*{ple.TABLE}) in {ckpt}", "none",
                      "only Gemma 3n checkpoints have one: set PLE_OFFLOAD=0")]
    name, size = found
    free = psutil.virtual_memory().available
    return [Check("PLE offload", "pass" if size <= free else "fail",
                  f"{size / 2**30:.2f} GiB of RAM available for {name}", f"{free / 2**30:.2f} GiB",
                  "free memory on the host, or set PLE_OFFLOAD=0 to keep the table on the card")]


def series_checks(v: Serve, ckpt: Path) -> list[Check]:
    """The files the series' switches name, there before the engine loads (it checks their contents)."""
    out = ple_check(v, ckpt)
    file = abliteration_file(v)
    if file is None:
        return out
    ok = file.is_file()
    return out + [
        Check("abliteration", "pass" if ok else "fail",
              f"the direction set QWEN38_ABLITERATION={v.abliteration} at {file}", "present" if ok else "no such file",
              "put the direction set there (ABLITERATION_DIR is the folder), or set QWEN38_ABLITERATION= (empty) to "
              "serve without abliteration")]


def scales_path(s: Settings, p: Profile) -> Path | None:
    """The FP8 KV scales sidecar the engine gets: SCALES, else the checkpoint's (new name, then older ones)."""
    if s.scales:
        return s.scales
    return next((s.ckpt / n for n in p.scales if (s.ckpt / n).is_file()), None)


def start_checks(s: Settings, p: Profile, reader: Callable[[], Reading] | None = None,
                 gpu_wait: int = 0, v: Serve | None = None) -> tuple[Reading | None, list[Check]]:
    """What start needs of the box: the NVML reading (None without a driver, or for the CPU build) and every
    check of the profile's box (``gpu_wait``: see :func:`gpu_checks`) and of the series' files (``v``)."""
    series = series_checks(v, s.ckpt) if v is not None else []
    if s.device == "cpu":
        return None, host_checks(s, p) + series
    try:
        reading, why = (reader or read_nvml)(), ""
    except NoDriver as exc:
        reading, why = None, str(exc)
    return reading, gpu_checks(reading, s, p.box, why, gpu_wait) + host_checks(s, p) + series


def report(reading: Reading | None) -> list[str]:
    """The per-card facts a bug report wants: PCIe link, power limit, memory, P2P."""
    if reading is None:
        return []
    major, minor = divmod(reading.cuda_driver // 10, 100)
    lines = [f"driver {reading.driver}, CUDA {major}.{minor}, {len(reading.gpus)} card(s)"]
    for g in reading.gpus:
        lines.append(f"GPU {g.index} {g.name} [{g.pci_bus_id}] sm_{g.compute_capability[0]}{g.compute_capability[1]}"
                     f", {g.memory_total / 2**30:.1f} GiB ({g.memory_used / 2**30:.1f} used), PCIe gen "
                     f"{g.pcie_gen_cur}/{g.pcie_gen_max} x{g.pcie_width_cur}/{g.pcie_width_max}, power limit "
                     f"{g.power_limit_mw / 1000:.0f} W")
    for (a, b), st in sorted(reading.p2p.items()):
        if a < b:
            lines.append(f"P2P {a} <-> {b}: {st}")
    return lines


def doctor(s: Settings, p: Profile, v: Serve | None = None, more: Sequence[Check] = ()) -> list[str]:
    """Every check and fact as lines; a box with no driver says so in one line and reports the rest. ``more``:
    the checks of the layers above (a multi-node setting's, rig/nodes/client.py), counted with these."""
    out = [f"profile {p.name} ({p.path}): {p.description}; the {s.device} build"]
    reading = None
    if s.device != "cpu":
        try:
            reading = read_nvml()
            out += report(reading)
        except NoDriver as exc:
            out.append(f"no NVIDIA driver here: NVML could not be loaded ({exc}); the GPU checks are skipped")
    checks = (gpu_checks(reading, s, p.box) if reading is not None else []) + host_checks(s, p)
    checks += series_checks(v, s.ckpt) if v is not None else []
    checks += more
    out += [c.line() for c in checks]
    fails = sum(c.status == "fail" for c in checks)
    out.append(f"{len(checks)} checks: {fails} failed, {sum(c.status == 'warn' for c in checks)} warned")
    return out
