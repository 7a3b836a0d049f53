"""Where the time after the wall goes: a call whose cold branch hangs, step by step.

The daemon runs with the cold endpoint 100 ms slower than usual and 1 s caller
deadlines, so every call is cut by its retrieval wall (40 ms from arrival) and
answers L1. `wall_probe/sitecustomize.py` (put on the daemon's PYTHONPATH) times
each step from the wall instant: the loop's first wake after it, the cold
branch's cancellation, retrieval's return, the pipeline, the crossing back to
asyncio, the send. Medians and p90 per step, in milliseconds; the steps are
cumulative up to "retrieval returns", then each its own.

`ibex_answer_seconds` (`/metrics`) shows the total in production; this shows
its parts. `--root` runs another checkout's daemon (e.g. a worktree of an
older commit) with this benchmark's driver, for before/after figures.

Run: ``python -m benchmarks.load.after_wall [--rate 100] [--seconds 8] [--root DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.load.deadlines import warmed_run
from benchmarks.load.driver import fixed_rate
from benchmarks.load.stack import ROOT, Stack

PROBE = Path(__file__).resolve().parent / "wall_probe"


def summary(steps: dict[str, list[float]]) -> list[tuple[str, int, float, float]]:
    """(step, calls, median, p90) per step, in step order."""
    rows = []
    for name in sorted(steps):
        values = sorted(steps[name])
        if values:
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            rows.append((name, len(values), statistics.median(values), p90))
    return rows


async def measure(root: Path, rate: float, seconds: float) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="ibex-wall-")) / "steps.json"
    env = {"PYTHONPATH": f"{PROBE}:{root}", "IBEX_WALL_PROBE_OUT": str(out)}
    with Stack() as stack:
        with stack.daemon(1, root, **env) as daemon:
            async with warmed_run(stack, daemon) as run:
                stack.memory.set_latency("cold", stack.cold_ms + 100.0)
                row, _ = await run.open(f"cold +100 ms @{rate:.0f}", fixed_rate((rate, seconds)))
        steps = json.loads(out.read_text()) if out.exists() else {}
    return {"client": row, "steps": summary(steps)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose daemon runs")
    args = p.parse_args(argv)
    res = asyncio.run(measure(args.root.resolve(), args.rate, args.seconds))
    client = res["client"]
    print(
        f"cold +100 ms, 1 s deadlines, {args.rate:.0f} rps, daemon from {args.root}: "
        f"client p50 {client['p50_ms']} ms, p99 {client['p99_ms']} ms"
    )
    print(f"{'step (ms from the wall)':40s} {'calls':>6s} {'p50':>7s} {'p90':>7s}")
    for name, n, p50, p90 in res["steps"]:
        print(f"{name:40s} {n:6d} {p50:7.3f} {p90:7.3f}")


if __name__ == "__main__":
    main()
