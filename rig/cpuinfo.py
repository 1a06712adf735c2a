"""The CPU's flags, read once from /proc/cpuinfo: the build's AVX2 check, the box check and the serve plan share it.

vLLM's CPU kernels need AVX2; its FP8 KV cache on the CPU needs AVX-512 or AMX (``_get_attn_isa`` in
``v1/attention/backends/cpu_attn.py`` refuses it otherwise).
"""

from __future__ import annotations

from pathlib import Path

#: Where the CPU's flags are read (a test points it at a recorded one).
CPUINFO = Path("/proc/cpuinfo")
#: Any of these lets vLLM's CPU attention keep an FP8 KV cache.
FP8_KV_FLAGS = ("avx512f", "amx_tile")


def flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's flags, from ``cpuinfo`` text (default: this machine's)."""
    if cpuinfo is None:
        cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    return next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])


def fp8_kv(found: list[str] | None = None) -> bool:
    """Whether vLLM's CPU engine can keep an FP8 KV cache on this CPU (or one with ``found`` flags)."""
    return any(f in (flags() if found is None else found) for f in FP8_KV_FLAGS)
