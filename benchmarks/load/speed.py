"""How fast the machine is right now: the CPU time of a fixed pure-Python workload.

On the shared 2-core VMs these benchmarks run on, the same work costs a
different amount of CPU from one minute to the next (a neighbour on the host,
a busy hyperthread sibling): on an otherwise idle machine this reference
workload took 41-90 ms of CPU, 44-64 ms between its 10th and 90th percentiles,
in one minute (2026-12-01). Every CPU-per-answer figure moves with it, so the
load benchmarks time this workload in the driver between their rows (while
the daemon idles) and report it next to each row: a row measured while the
reference took 60 ms is not comparable with one measured at 45 ms.

`reference_cpu_ms()` is process CPU time (`time.process_time`), never wall
time, so a preempted probe still measures the CPU speed it got.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

_ROUNDS = 5


def _work() -> int:
    """Dicts, integer arithmetic and small strings: what an interpreter spends its time on."""
    acc = 0
    seen: dict[int, str] = {}
    for i in range(20_000):
        seen[i % 97] = str(acc & 0xFFFF)
        acc += i * 3 % 7 + len(seen[i % 97])
    return acc


def reference_cpu_ms() -> float:
    """CPU milliseconds for `_ROUNDS` rounds of the reference workload (about 20 ms)."""
    t0 = time.process_time()
    for _ in range(_ROUNDS):
        _work()
    return (time.process_time() - t0) * 1000.0


def spread(samples: list[float]) -> dict[str, Any]:
    """min / median / max of the probe over a run, and max/min: how far the speed moved."""
    if not samples:
        return {"samples": 0}
    lo, hi = min(samples), max(samples)
    return {
        "samples": len(samples),
        "min_ms": round(lo, 1),
        "median_ms": round(statistics.median(samples), 1),
        "max_ms": round(hi, 1),
        "max_over_min": round(hi / lo, 2) if lo > 0 else None,
    }
