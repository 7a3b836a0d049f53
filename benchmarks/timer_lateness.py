"""How late Trio's timers fire, with and without `ibex.patches.trio_epoll`.

Every request wall and branch timeout is a Trio deadline; epoll's whole-millisecond
timeout rounds each wait up, so the loop wakes up to 1 ms after the deadline.
This sleeps for durations with a fractional millisecond part (the usual case for
a wall counted from a call's arrival) in alternating blocks, plain and with
precise wakeups, and reports the lateness (wake time minus deadline) of each.

Run: ``python -m benchmarks.timer_lateness [--sleeps N] [--blocks N]``
(JSON in ``benchmarks/results/timer_lateness.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import trio

from ibex.patches.trio_epoll import precise_wakeups

RESULTS = Path(__file__).resolve().parent / "results" / "timer_lateness.json"


async def _block(n: int) -> list[float]:
    late = []
    for i in range(n):
        d = 0.0021 + (i % 9) * 0.000_113  # 2.1-3.0 ms, never a whole millisecond
        t0 = time.perf_counter()
        await trio.sleep(d)
        late.append((time.perf_counter() - t0 - d) * 1e6)
    return late


def _summary(late: list[float]) -> dict[str, float]:
    q = statistics.quantiles(late, n=100)
    return {"median_us": statistics.median(late), "p90_us": q[89], "p99_us": q[98]}


async def run(sleeps: int, blocks: int) -> dict[str, dict[str, float]]:
    plain: list[float] = []
    precise: list[float] = []
    for _ in range(blocks):
        plain += await _block(sleeps)
        with precise_wakeups() as on:
            assert on, "precise wakeups unavailable on this platform"
            precise += await _block(sleeps)
    return {"epoll_rounding": _summary(plain), "precise_wakeups": _summary(precise)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleeps", type=int, default=200, help="sleeps per block")
    parser.add_argument("--blocks", type=int, default=5, help="alternating blocks per variant")
    args = parser.parse_args(argv)
    result = trio.run(run, args.sleeps, args.blocks)
    print(f"{'variant':<18} {'median us':>10} {'p90 us':>10} {'p99 us':>10}")
    for name, row in result.items():
        print(f"{name:<18} {row['median_us']:>10.0f} {row['p90_us']:>10.0f} {row['p99_us']:>10.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
