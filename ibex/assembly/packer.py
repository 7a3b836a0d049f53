"""Choose which scored memories fill the usable token budget: a 0/1 knapsack.

The packer is a pure function: same candidates (in any order) and budget, same
answer. It runs a bucketed dynamic program when ``n * (budget // bucket + 1)``
cells fit under the ceiling and falls back to a bounded greedy scan otherwise.

Rounding. Ceiling item weights with a floor budget would make every DP set fit
in exact tokens, but each item then over-counts by up to ``bucket - 1`` tokens
and the DP strands budget it cannot see ("floor-bucket stranding"), which widens
the gap to the exact optimum severalfold. So item weights are rounded to the
*nearest* bucket (at least one) and the budget down: the per-item error
averages out, the DP picks sets close to the exact optimum, and the few that
overshoot in exact tokens are trimmed by repair. Refill and 1-for-1 swaps then
spend what repair or rounding left unused, in exact tokens. When every cost is
a multiple of the bucket the DP is exact.

Grain. Rounding error matters most when the budget is only a few memories
wide, and those tables are tiny, so the DP uses the finest divisor of
``bucket`` whose table stays within ``fine_cells`` (and the ceiling). The
``bucket``-sized table alone decides between DP and greedy, as configured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ibex.assembly.pipeline_config import DEFAULT_DP_CELL_CEILING, DEFAULT_MAX_CONSECUTIVE_SKIPS
from ibex.assembly.structs import PackPath, PackResult, ScoredMemory

__all__ = [
    "DEFAULT_BUCKET",
    "DEFAULT_DP_CELL_CEILING",
    "DEFAULT_FINE_CELLS",
    "DEFAULT_MAX_CONSECUTIVE_SKIPS",
    "pack",
]

DEFAULT_BUCKET = 16
DEFAULT_FINE_CELLS = 1 << 16

_FloatArray = npt.NDArray[np.float64]
_BoolArray = npt.NDArray[np.bool_]


def pack(
    candidates: Sequence[ScoredMemory],
    budget: int,
    *,
    dp_cell_ceiling: int = DEFAULT_DP_CELL_CEILING,
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    bucket: int = DEFAULT_BUCKET,
    fine_cells: int = DEFAULT_FINE_CELLS,
) -> PackResult:
    """Pack the best-scoring subset whose exact token estimates fit in ``budget``.

    ``composite_score`` must be finite in [0, 1] and ``token_estimate`` the exact
    cost (>= 1) of the memory's formatted block; memory ids must be unique.
    Anything else is a caller bug and raises ValueError. The DP path is never
    worse than an unbounded score-descending greedy on the same candidates.
    ``max_consecutive_skips`` applies to the greedy fallback only; 0 stops it at
    the first candidate that does not fit, like 1. ``fine_cells`` bounds the
    finer-grained table used for small budgets (0 keeps ``bucket`` always).
    """
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    if dp_cell_ceiling < 0:
        raise ValueError(f"dp_cell_ceiling must be >= 0, got {dp_cell_ceiling}")
    if fine_cells < 0:
        raise ValueError(f"fine_cells must be >= 0, got {fine_cells}")
    if max_consecutive_skips < 0:
        raise ValueError(f"max_consecutive_skips must be >= 0, got {max_consecutive_skips}")
    ordered = _validated_order(candidates)
    n = len(ordered)
    capacity = max(budget, 0)
    buckets = capacity // bucket
    path: PackPath = "dp" if n * (buckets + 1) <= dp_cell_ceiling else "greedy"
    tokens = [m.token_estimate for m in ordered]
    scores = [m.composite_score for m in ordered]

    if n == 0 or capacity == 0:
        chosen: list[int] = []
    elif path == "greedy":
        chosen = _greedy(tokens, capacity, max(max_consecutive_skips, 1))
    elif sum(tokens) <= capacity:
        chosen = list(range(n))
    else:
        grain = _grain(n, capacity, bucket, min(fine_cells, dp_cell_ceiling))
        weights = [max(1, (2 * t + grain) // (2 * grain)) for t in tokens]
        chosen = _dp(weights, scores, capacity // grain)
        chosen = _repair(chosen, tokens, scores, capacity)
        chosen = _improve(chosen, tokens, scores, capacity)
        fallback = _greedy(tokens, capacity, n)
        if _score(fallback, scores) > _score(chosen, scores):
            chosen = fallback

    taken = set(chosen)
    packed = tuple([m for i, m in enumerate(ordered) if i in taken])
    excluded = tuple([m for i, m in enumerate(ordered) if i not in taken])
    return PackResult(
        packed=packed,
        excluded=excluded,
        path=path,
        candidates_evaluated=n,
        excluded_for_budget=len(excluded),
        budget_reached=bool(excluded),
        total_tokens=sum([m.token_estimate for m in packed]),
        total_score=math.fsum([m.composite_score for m in packed]),
    )


def _validated_order(candidates: Sequence[ScoredMemory]) -> list[ScoredMemory]:
    """Reject what must never reach the packer, then sort by score desc, id asc."""
    for m in candidates:
        # One chained comparison rejects NaN and both infinities as well.
        if not 0.0 <= m.composite_score <= 1.0:
            raise ValueError(f"memory {m.memory_id!r}: composite_score must be finite in [0, 1]")
        if not (isinstance(m.token_estimate, int) and m.token_estimate >= 1):
            raise ValueError(f"memory {m.memory_id!r}: token_estimate must be an int >= 1")
    if len({m.memory_id for m in candidates}) != len(candidates):
        seen: set[str] = set()
        for m in candidates:
            if m.memory_id in seen:
                raise ValueError(f"duplicate memory_id {m.memory_id!r}; dedupe before packing")
            seen.add(m.memory_id)
    return sorted(candidates, key=lambda m: (-m.composite_score, m.memory_id))


def _grain(n: int, capacity: int, bucket: int, fine_cells: int) -> int:
    """The finest divisor of ``bucket`` whose DP table stays within ``fine_cells``.

    Divisors keep the DP exact whenever costs are multiples of ``bucket``.
    """
    for grain in range(1, bucket):
        if bucket % grain == 0 and n * (capacity // grain + 1) <= fine_cells:
            return grain
    return bucket


def _score(chosen: Sequence[int], scores: Sequence[float]) -> float:
    # fsum is order-independent, so equal sets always compare equal.
    return math.fsum(scores[i] for i in chosen)


def _greedy(tokens: Sequence[int], capacity: int, skip_limit: int) -> list[int]:
    """Score-descending first fit; stops after ``skip_limit`` misfits in a row."""
    chosen: list[int] = []
    left = capacity
    skips = 0
    for i, t in enumerate(tokens):
        if t <= left:
            chosen.append(i)
            left -= t
            skips = 0
        else:
            skips += 1
            if skips >= skip_limit:
                break
    return chosen


def _dp(weights: Sequence[int], scores: Sequence[float], buckets: int) -> list[int]:
    """Optimal 0/1 knapsack over bucketed weights; returns sorted item indices.

    ``best[j]`` is the best score within ``j`` buckets. Two classic cuts keep the
    table small: after item i, cells above the running weight total equal the
    cell at that total (filled lazily), and cells below ``buckets`` minus the
    weight still to come can never be on the answer's path (never computed).
    Each item costs one add, one compare (the take bits) and one max over a
    contiguous slice; the take bits are stored per item, ragged, for backtracking.
    """
    items = [i for i, w in enumerate(weights) if w <= buckets]
    total = sum(weights[i] for i in items)
    if total <= buckets:
        return items

    spans: list[tuple[int, int, int]] = []  # (lo, hi, offset into take)
    prefix = 0
    size = 0
    for i in items:
        prefix += weights[i]
        lo = max(weights[i], buckets - (total - prefix))
        hi = min(buckets, prefix)
        spans.append((lo, hi, size))
        size += hi - lo + 1

    best: _FloatArray = np.zeros(buckets + 1, dtype=np.float64)
    scratch: _FloatArray = np.empty(buckets + 1, dtype=np.float64)
    take: _BoolArray = np.empty(size, dtype=np.bool_)
    filled = 0  # cells above this logically equal best[filled]
    for i, (lo, hi, off) in zip(items, spans, strict=True):
        if hi > filled:
            best[filled + 1 : hi + 1] = best[filled]
            filled = hi
        w = weights[i]
        width = hi - lo + 1
        cand = scratch[:width]
        row = best[lo : hi + 1]
        bits = take[off : off + width]
        np.add(best[lo - w : hi - w + 1], scores[i], out=cand)
        np.greater(cand, row, out=bits)
        np.maximum(row, cand, out=row)

    chosen: list[int] = []
    j = buckets
    for i, (lo, hi, off) in zip(reversed(items), reversed(spans), strict=True):
        j = min(j, hi)
        if j >= lo and take[off + j - lo]:
            chosen.append(i)
            j -= weights[i]
    chosen.reverse()
    return chosen


def _repair(
    chosen: list[int], tokens: Sequence[int], scores: Sequence[float], capacity: int
) -> list[int]:
    """Drop the lowest score-per-token items until the exact tokens fit.

    Nearest-bucket rounding lets the DP overshoot by a few tokens; dropping by
    density gives up the least score per token freed.
    """
    used = sum(tokens[i] for i in chosen)
    if used <= capacity:
        return chosen
    by_density = sorted(chosen, key=lambda i: (scores[i] / tokens[i], -i))
    dropped: set[int] = set()
    for i in by_density:
        if used <= capacity:
            break
        dropped.add(i)
        used -= tokens[i]
    return [i for i in chosen if i not in dropped]


def _improve(
    chosen: list[int], tokens: Sequence[int], scores: Sequence[float], capacity: int
) -> list[int]:
    """Spend stranded tokens: refill by score, then best 1-for-1 swaps, repeat.

    Every swap strictly raises the total score, so the loop terminates; the
    ``len(tokens)`` cap only bounds the worst case.
    """
    n = len(tokens)
    inside = np.zeros(n, dtype=np.bool_)
    inside[chosen] = True
    tok = np.asarray(tokens, dtype=np.int64)
    val = np.asarray(scores, dtype=np.float64)
    left = capacity - int(tok[inside].sum())
    for _ in range(n + 1):
        for i in np.flatnonzero(~inside & (tok <= left)).tolist():  # refill by score
            if tokens[i] <= left:
                inside[i] = True
                left -= tokens[i]
        ins = np.flatnonzero(inside)
        outs = np.flatnonzero(~inside)
        if ins.size == 0 or outs.size == 0:
            break
        gain = val[outs][None, :] - val[ins][:, None]
        fits = tok[outs][None, :] - tok[ins][:, None] <= left
        gain = np.where(fits, gain, 0.0)
        k = int(np.argmax(gain))
        if gain.flat[k] <= 0.0:
            break
        a, b = divmod(k, outs.size)
        drop, add = int(ins[a]), int(outs[b])
        inside[drop] = False
        inside[add] = True
        left += tokens[drop] - tokens[add]
    return [int(i) for i in np.flatnonzero(inside)]
