"""Packer speed on the shapes the daemon sees, and its gap to the exact optimum.

Candidates look like real memories: 50-800 characters (about 15-250 tokens)
plus a ~20-token wrapper, scored with the interim formula. The exact optimum
comes from a DP over unrounded token weights (benchmark only; too slow for the
request path). Instances keep budgets below the total cost so the packer must
choose. "Below greedy" counts results worse than score-descending first fit.

Run: ``.venv/bin/python -m benchmarks.packer`` (prints a table, writes
``benchmarks/results/packer.json``).
"""

from __future__ import annotations

import functools
import json
import math
import platform
import random
import statistics
import sys
from pathlib import Path

import numpy as np

from benchmarks.timing import timed
from ibex.assembly.packer import pack
from ibex.assembly.structs import ScoredMemory

RESULTS = Path(__file__).parent / "results" / "packer.json"
WRAPPER_TOKENS = 20


def memory(rng: random.Random, i: int, tokens: int | None = None) -> ScoredMemory:
    similarity, confidence = rng.random(), rng.random()
    if tokens is None:
        tokens = math.ceil(rng.randint(50, 800) / 3.2) + WRAPPER_TOKENS
    return ScoredMemory(
        memory_id=f"{rng.getrandbits(128):032x}",
        category="factual",
        content="",
        composite_score=0.85 * similarity + 0.15 * confidence,
        similarity=similarity,
        confidence=confidence,
        rank=i + 1,
        token_estimate=tokens,
    )


def speed() -> list[dict[str, object]]:
    rng = random.Random(20261021)
    cases: list[tuple[str, list[ScoredMemory], int]] = [
        ("n=30, 8k budget", [memory(rng, i) for i in range(30)], 8_000),
        ("n=30, 2k budget (must choose)", [memory(rng, i) for i in range(30)], 2_000),
        ("n=70, 100k budget", [memory(rng, i) for i in range(70)], 100_000),
        (
            "n=70, 100k, 1k-4.8k-token items (full DP)",
            [memory(rng, i, rng.randint(1_000, 4_800)) for i in range(70)],
            100_000,
        ),
        ("n=300, 100k budget (greedy path)", [memory(rng, i) for i in range(300)], 100_000),
        (
            "n=300, 100k, 300-1.2k-token items (greedy)",
            [memory(rng, i, rng.randint(300, 1_200)) for i in range(300)],
            100_000,
        ),
    ]
    rows: list[dict[str, object]] = []
    for name, cands, budget in cases:
        result = pack(cands, budget)
        stats = timed(functools.partial(pack, cands, budget), reps=3_000, warmup=50)
        rows.append(
            {
                "case": name,
                "n": len(cands),
                "budget": budget,
                "path": result.path,
                "packed": len(result.packed),
                "candidate_tokens": sum(m.token_estimate for m in cands),
                **stats,
            }
        )
    return rows


def exact_optimum(cands: list[ScoredMemory], budget: int) -> float:
    best = np.zeros(budget + 1, dtype=np.float64)
    for m in cands:
        t = m.token_estimate
        if t <= budget:
            np.maximum(best[t:], best[: budget + 1 - t] + m.composite_score, out=best[t:])
    return float(best[budget])


def greedy_score(cands: list[ScoredMemory], budget: int) -> float:
    left, chosen = budget, []
    for m in sorted(cands, key=lambda m: (-m.composite_score, m.memory_id)):
        if m.token_estimate <= left:
            chosen.append(m.composite_score)
            left -= m.token_estimate
    return math.fsum(chosen)


def gap(instances: int = 1_200) -> dict[str, dict[str, float]]:
    """Gap to the exact optimum with the default grain refinement and without it."""
    rng = random.Random(7)
    variants: dict[str, dict[str, int]] = {
        "default": {},
        "16-token grain only (fine_cells=0)": {"fine_cells": 0},
    }
    gaps: dict[str, list[float]] = {v: [] for v in variants}
    below: dict[str, int] = dict.fromkeys(variants, 0)
    for _ in range(instances):
        cands = [memory(rng, i) for i in range(rng.randint(5, 70))]
        total = sum(m.token_estimate for m in cands)
        budget = rng.randint(max(1, total // 10), total - 1)
        best = exact_optimum(cands, budget)
        floor = greedy_score(cands, budget)
        for name, kwargs in variants.items():
            result = pack(cands, budget, **kwargs)
            assert result.total_tokens <= budget
            gaps[name].append(100.0 * (best - result.total_score) / best if best else 0.0)
            below[name] += result.total_score < floor
    return {
        name: {
            "instances": instances,
            "mean_gap_pct": statistics.fmean(g),
            "p99_gap_pct": float(np.percentile(g, 99)),
            "max_gap_pct": max(g),
            "exact_pct": 100.0 * sum(x <= 1e-9 for x in g) / len(g),
            "below_greedy": below[name],
        }
        for name, g in gaps.items()
    }


def main() -> None:
    rows = speed()
    gaps = gap()
    print(f"{'case':<46} {'path':<7} {'packed':>6} {'median µs':>10} {'p99 µs':>9}")
    for r in rows:
        print(
            f"{r['case']:<46} {r['path']:<7} {r['packed']:>6} "
            f"{r['median_us']:>10.1f} {r['p99_us']:>9.1f}"
        )
    print()
    head = f"{'optimality (n=5-70, budget 10-100%)':<38} {'mean %':>7} {'p99 %':>7}"
    print(f"{head} {'max %':>7} {'exact %':>8} {'<greedy':>8}")
    for name, g in gaps.items():
        print(
            f"{name:<38} {g['mean_gap_pct']:>7.3f} {g['p99_gap_pct']:>7.3f} "
            f"{g['max_gap_pct']:>7.3f} {g['exact_pct']:>8.1f} {g['below_greedy']:>8}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {
                    "python": sys.version.split()[0],
                    "numpy": np.__version__,
                    "platform": platform.platform(),
                },
                "speed": rows,
                "optimality": gaps,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
