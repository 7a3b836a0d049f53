"""The cold-endpoint rows with 45 ms caller deadlines, for this checkout and another, alternating.

The cold endpoint answers 100 ms late, so every call is cut at its retrieval
wall and must still reach its caller, L1 with its hot memories, within 45 ms.
These rows move with the machine by more than most code changes move them,
so a before/after figure needs both daemons in one run: each round starts a
daemon of each checkout (`--root`: e.g. a worktree of an older commit) in turn,
warms it, and runs `deadlines.cold_slow` at 100 and 200 rps.

Run: ``python -m benchmarks.load.cold_versus --root DIR [--rounds 2] [--step 8]``
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import aio
from benchmarks.load.deadlines import PROXY, cold_slow, warmed_run
from benchmarks.load.stack import ROOT, Stack

RATES = (100, 200)


def ok_share(statuses: dict[str, int]) -> float:
    """Percent of calls answered OK."""
    total = sum(statuses.values())
    return 100.0 * statuses.get("OK", 0) / total if total else 0.0


async def measure_all(
    roots: Sequence[Path], rounds: int, step: float
) -> list[tuple[Path, int, dict[str, Any]]]:
    out = []
    with Stack() as stack:
        for i in range(rounds):
            for root in roots if i % 2 == 0 else list(reversed(roots)):
                with stack.daemon(1, root) as daemon:
                    async with warmed_run(stack, daemon, 1.5) as run:
                        measured = await cold_slow(run, RATES, step, PROXY)
                for rate, (row, _) in zip(RATES, measured, strict=True):
                    out.append((root, rate, row))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True, help="the other checkout")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step", type=float, default=8.0, help="seconds per row")
    args = p.parse_args(argv)
    for root, rate, row in aio.run(
        measure_all([ROOT, args.root.resolve()], args.rounds, args.step)
    ):
        statuses = row["statuses"]
        print(
            f"{root} @{rate}: {ok_share(statuses):.2f} % OK {statuses}, "
            f"{row['l1_with_hot']} OK at L1 with hot memories, p99 {row['p99_ms']} ms"
        )


if __name__ == "__main__":
    main()
