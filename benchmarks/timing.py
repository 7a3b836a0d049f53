"""Per-call timing shared by the benchmarks: one helper, so every table reads alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], reps: int, *, warmup: int = 0) -> dict[str, float]:
    """Median, p99 and mean of `reps` individually timed calls of `fn`, in µs.

    `warmup` untimed calls run first (caches, branch predictors); callers whose `fn`
    consumes a prepared batch of exactly `reps` inputs warm up on their own and pass 0.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1000,
        "p99_us": samples[int(0.99 * (len(samples) - 1))] / 1000,
        "mean_us": statistics.fmean(samples) / 1000,
    }
