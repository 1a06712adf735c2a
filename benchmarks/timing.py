"""Timing helpers shared by the benchmark scripts (each script puts its own folder on sys.path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """The median of ``repeat`` timed calls of ``fn``."""
    return statistics.median(timed(fn) for _ in range(repeat))
