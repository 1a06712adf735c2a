"""The CPU's flags, read once from /proc/cpuinfo: the build's AVX2 check, the box check and the serve plan share it.

vLLM's CPU kernels need AVX2; its FP8 KV cache on the CPU needs AVX-512 or AMX (``_get_attn_isa`` in
``v1/attention/backends/cpu_attn.py`` refuses it otherwise); its int4 MoE kernel needs AMX. What the CPU build of
v0.30.0 cannot run at all is :func:`engine_gaps`'s.
"""

from __future__ import annotations

from pathlib import Path

#: Where the CPU's flags are read (a test points it at a recorded one).
CPUINFO = Path("/proc/cpuinfo")
#: Any of these lets vLLM's CPU attention keep an FP8 KV cache.
FP8_KV_FLAGS = ("avx512f", "amx_tile")
#: vLLM's CPU int4 (WNA16) MoE kernel needs AMX: ``CPUExpertsInt4`` in
#: ``model_executor/layers/fused_moe/cpu_moe.py``, else "WNA16 MoE backend 'CPU' does not support the deployment
#: configuration since kernel does not support current device cpu".
INT4_MOE_FLAG = "amx_tile"
#: Speculative decoding on vLLM v0.30.0's CPU build: its model runner swaps the Triton kernels of
#: ``v1/spec_decode/utils.py`` and ``v1/sample/rejection_sampler.py`` for its own by module attribute, while the
#: dispatchers keep the Triton ones, so the first draft fails ("TypeError: Cannot inspect kernel parameters for
#: function"; with the hybrid models' prefix caching, ``mamba_utils.py``'s fused pre-copy kernel fails first).
SPEC_DECODE = ("speculative decoding", "vLLM v0.30.0's CPU model runner cannot run the spec-decode Triton "
               "kernels (v1/spec_decode/utils.py, v1/sample/rejection_sampler.py: TypeError: Cannot inspect kernel "
               "parameters for function)")


def flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's flags, from ``cpuinfo`` text (default: this machine's)."""
    if cpuinfo is None:
        cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    return next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])


def fp8_kv(found: list[str] | None = None) -> bool:
    """Whether vLLM's CPU engine can keep an FP8 KV cache on this CPU (or one with ``found`` flags)."""
    return any(f in (flags() if found is None else found) for f in FP8_KV_FLAGS)


def engine_gaps(config: dict, speculative: dict, found: list[str] | None = None) -> list[tuple[str, str]]:
    """What vLLM v0.30.0's CPU build cannot run of a model (its ``config.json``) served with ``speculative`` (the
    profile's table), on this CPU (or one with ``found`` flags): (what, why) for each."""
    out = []
    if speculative:
        what, why = SPEC_DECODE
        out.append((f"{what} ([speculative] method {speculative.get('method', '?')!r})", why))
    quant = config.get("quantization_config") or {}
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if experts and quant.get("quant_method") == "compressed-tensors" and \
            INT4_MOE_FLAG not in (flags() if found is None else found):
        out.append((f"the int4 MoE ({experts} experts, compressed-tensors weights)", "vLLM's CPU int4 MoE kernel "
                    "needs AMX (fused_moe/cpu_moe.py CPUExpertsInt4), and this CPU has no amx_tile"))
    return out
