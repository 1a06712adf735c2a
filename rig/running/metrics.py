"""The rig's own facts for Prometheus: a file in the node exporter's textfile format under the rig's state,
``RIG_STATE/metrics/vllm-rig.prom``.

vLLM's ``/metrics`` has what the engine knows (tokens, latencies, the KV cache); this file has what only the rig
knows: the build that serves, each engine's end by its cause (the restarts systemd makes follow the error ones),
the last start's seconds to healthy, the GPU gate's waits. ``prometheus-node-exporter
--collector.textfile.directory=RIG_STATE/metrics`` serves it (monitoring/ has the whole setup).

The counters are kept in ``counts.json`` beside it, read and added to under a lock, so they count across
supervisors as Prometheus counters must; the ``.prom`` file is written from them atomically after each event, so
the exporter never reads half a file. A write that fails is said and the engine carries on: metrics are never a
reason to stop serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from rig.base import atomic
from rig.base.console import warn

FOLDER = "metrics"
FILE = "vllm-rig.prom"
COUNTS = "counts.json"
#: name -> (type, help): every metric the file may hold, in the order it is written.
METRICS: dict[str, tuple[str, str]] = {
    "rig_build_info": ("gauge", "The build the rig serves from: vLLM version, patched tree, kernels key, device, "
                                "torch (value 1)."),
    "rig_engine_starts_total": ("counter", "Engines the rig started that answered the health check."),
    "rig_engine_start_seconds": ("gauge", "Seconds from the last start to healthy."),
    "rig_engine_ends_total": ("counter", "Supervised engines that ended, by cause (failed, shutdown, killed, "
                                         "leader and hung are restarted by systemd; stopped and signal are asked)."),
    "rig_gpu_gate_waits_total": ("counter", "Starts that waited for a card still held by another process."),
    "rig_gpu_gate_wait_seconds_total": ("counter", "Seconds starts waited for busy cards."),
}


def folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def _key(labels: Mapping[str, str]) -> str:
    return json.dumps(dict(sorted(labels.items())))


@contextlib.contextmanager
def _counts(state_dir: Path) -> Iterator[dict]:
    """The stored values, locked for a read-modify-write; written back (and the .prom file made) on exit."""
    d = folder(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads((d / COUNTS).read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except FileNotFoundError:
            data = {}
        except ValueError as exc:  # a damaged store starts again: counters may reset, Prometheus' rate() knows
            warn(f"metrics: {d / COUNTS} unreadable ({exc}); counting again from 0")
            data = {}
        yield data
        atomic.write_text(d / COUNTS, json.dumps(data, indent=1, sort_keys=True) + "\n")
        atomic.write_text(d / FILE, render(data))


def _record(state_dir: Path, name: str, value: float, labels: Mapping[str, str], add: bool, only: bool = False) -> None:
    if name not in METRICS:
        raise KeyError(f"{name} is not in metrics.METRICS")
    try:
        with _counts(state_dir) as data:
            series = {} if only else data.get(name, {})
            key = _key(labels)
            series[key] = (float(series.get(key, 0.0)) if add else 0.0) + float(value)
            data[name] = series
    except OSError as exc:
        warn(f"metrics: {folder(state_dir)} not written ({exc}); serving goes on")


def add(state_dir: Path, name: str, value: float = 1.0, **labels: str) -> None:
    """Count ``value`` more of the counter ``name``."""
    _record(state_dir, name, value, labels, add=True)


def put(state_dir: Path, name: str, value: float, *, only: bool = False, **labels: str) -> None:
    """Set the gauge ``name``; ``only``: its other label sets dropped (an info metric has one)."""
    _record(state_dir, name, value, labels, add=False, only=only)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(data: Mapping[str, Mapping[str, float]]) -> str:
    """The text exposition format: HELP and TYPE for each metric with a value, then its samples."""
    out = []
    for name, (kind, text) in METRICS.items():
        series = data.get(name) or {}
        if not series:
            continue
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for key, value in sorted(series.items()):
            labels = json.loads(key)
            inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            out.append(f"{name}{{{inner}}} {_number(value)}" if inner else f"{name} {_number(value)}")
    return "\n".join(out) + "\n" if out else ""
