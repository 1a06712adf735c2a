"""The free-GPU gate: before the engine starts, wait until its cards are free.

vLLM sizes its KV cache from the memory free on each card when it starts. A restart onto cards whose last
engine is still letting go (a killed EngineCore, a systemd restart, ``./start.sh`` ending an earlier
engine's leftovers) silently gets a smaller cache. So start waits, up to ``GPU_WAIT`` seconds with a line
every 5 s, until every chosen card lists no compute process and its used memory is back to what an idle card
shows; past that it fails (exit 1) naming what holds the cards. The logic takes the NVML reader, the clock and
the sleep as arguments, so the tests drive it with recorded readings and a fake clock. Which cards it waits
for is the plan's (rig/plan/serve.py, :func:`rig.plan.box.positions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import psutil

from rig.base.console import say
from rig.base.errors import WorkFailed, problem
from rig.plan import box

# Used memory an idle card may show with no compute process on it: the driver's own reservation (615 MiB on
# the recorded H200 with driver 580, about 300 MiB on an RTX 3090) plus a desktop's display server. An engine
# still releasing holds tens of GiB (its weights and KV cache), far above this; the KV cache loses at most this.
IDLE_USED = 2 << 30
POLL = 1.0  # seconds between NVML reads while waiting
EVERY = 5.0  # seconds between progress lines
GIB = 2**30


def process(pid: int) -> str:
    """``pid N name``; NVML reports pids of the host, so one in another container is not visible here."""
    try:
        return f"pid {pid} {psutil.Process(pid).name()}"
    except psutil.NoSuchProcess:
        return f"pid {pid}, not in this PID namespace"
    except psutil.Error:  # AccessDenied: the name of another user's process is usually readable, not always
        return f"pid {pid}"


def busy(g: box.Gpu) -> bool:
    """A card is busy while it lists a compute process or shows more memory used than an idle card."""
    return bool(g.compute_processes) or g.memory_used > IDLE_USED


def describe(g: box.Gpu) -> str:
    """One card's state: ``1 compute process (pid 4242 python3, 20.3 GiB), 20.5 GiB used of 140.4 GiB``."""
    used = f"{g.memory_used / GIB:.1f} GiB used of {g.memory_total / GIB:.1f} GiB"
    if not g.compute_processes:
        return f"no compute process, {used}"
    procs = "; ".join(process(pid) + (f", {g.process_memory[pid] / GIB:.1f} GiB" if pid in g.process_memory else "")
                      for pid in g.compute_processes)
    n = len(g.compute_processes)
    return f"{n} compute process{'es' if n > 1 else ''} ({procs}), {used}"


def _cards(reading: box.Reading, cards: Sequence[int]) -> list[tuple[int, box.Gpu]]:
    return [(i, reading.gpus[i]) for i in cards if 0 <= i < len(reading.gpus)]


def _state(held: list[tuple[int, box.Gpu]]) -> str:
    return "; ".join(f"card {i}: {describe(g)}" for i, g in held) if len(held) > 1 else describe(held[0][1])


def _names(held: list[tuple[int, box.Gpu]]) -> str:
    return f"card{'s' if len(held) > 1 else ''} {', '.join(str(i) for i, _ in held)}"


def summary(reading: box.Reading, cards: Sequence[int], timeout: float) -> str:
    """The dry run's one line: the chosen cards' state and what a real start would do."""
    chosen = _cards(reading, cards)
    held = [(i, g) for i, g in chosen if busy(g)]
    if not held:
        return f"GPU gate: {_names(chosen)} free" if chosen else "GPU gate: none of the chosen cards is in the reading"
    return f"GPU gate: {_names(held)} busy ({_state(held)}); a real start waits up to GPU_WAIT={timeout:g} s"


def wait_free(read: Callable[[], box.Reading], cards: Sequence[int], timeout: float, *,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              poll: float = POLL, every: float = EVERY) -> float:
    """Wait until every card of ``cards`` (positions in the reading) is free; return the seconds waited.

    Free cards cost one read and one short line. Cards that are not in the reading are the box check's
    business, not the gate's. Still busy after ``timeout`` seconds (0: no wait): :class:`WorkFailed` naming
    the processes and the memory.
    """
    t0 = clock()
    chosen = _cards(read(), cards)
    held = [(i, g) for i, g in chosen if busy(g)]
    if not held:
        if chosen:
            say(f"GPUs: {_names(chosen)} free ({max(g.memory_used for _, g in chosen) / GIB:.1f} GiB used at most)")
        return 0.0
    say(f"waiting up to GPU_WAIT={timeout:g} s for {_names(held)} to be free: {_state(held)}")
    waited, last = _names(held), t0
    while (elapsed := clock() - t0) < timeout:
        sleep(min(poll, timeout - elapsed))
        held = [(i, g) for i, g in _cards(read(), cards) if busy(g)]
        now = clock()
        if not held:
            say(f"GPUs: {waited} free after {now - t0:.1f} s")
            return now - t0
        if now - last >= every:
            say(f"still waiting ({now - t0:.0f} s of {timeout:g}) for {_names(held)}: {_state(held)}")
            last = now
    lag = any(not g.compute_processes for _, g in held)
    raise WorkFailed(problem(
        _names(held), f"free within GPU_WAIT={timeout:g} s (no compute process, at most {IDLE_USED / GIB:.0f} GiB "
        "used), so that vLLM sizes its KV cache on the whole card", _state(held)
        + (" (memory without a listed process: still being released, or held by a process NVML does not show "
           "here)" if lag else ""),
        "stop what holds the card (nox -s stop if it is an earlier engine of this rig), raise GPU_WAIT if it is "
        "still letting go, choose other cards with CUDA_VISIBLE_DEVICES, or GPU_WAIT=0 to start anyway "
        "(vLLM then sizes its KV cache from the memory left)"))
