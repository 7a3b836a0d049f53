"""The packer against an exact brute-force solver and its stated invariants."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex.assembly.packer import _repair, pack
from ibex.assembly.structs import ScoredMemory
from tests.samples import scored

# fine_cells=0 forces the 16-token grain even for tiny budgets; the default may
# refine it, which the exactness test below relies on.
FINE = [0, 1 << 16]


def mem(i: int | str, score: float, tokens: int) -> ScoredMemory:
    return scored(i, score, tokens=tokens)


def order(ms: list[ScoredMemory]) -> list[ScoredMemory]:
    return sorted(ms, key=lambda m: (-m.composite_score, m.memory_id))


def optimum(ms: list[ScoredMemory], budget: int) -> float:
    """Exact 0/1 knapsack by enumerating every subset (n <= 12)."""
    n = len(ms)
    masks = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    cost = masks @ np.array([m.token_estimate for m in ms], dtype=np.int64)
    value = masks @ np.array([m.composite_score for m in ms], dtype=np.float64)
    return float(value[cost <= max(budget, 0)].max())


def greedy(ms: list[ScoredMemory], budget: int, skip_limit: int | None = None) -> list[str]:
    """Reference score-descending first fit, optionally with the skip stop rule."""
    out: list[str] = []
    left, skips = budget, 0
    for m in order(ms):
        if m.token_estimate <= left:
            out.append(m.memory_id)
            left -= m.token_estimate
            skips = 0
        else:
            skips += 1
            if skip_limit is not None and skips >= skip_limit:
                break
    return out


def score_of(ms: list[ScoredMemory], ids: list[str]) -> float:
    chosen = set(ids)
    return math.fsum(m.composite_score for m in ms if m.memory_id in chosen)


scores = st.one_of(st.floats(min_value=0.0, max_value=1.0), st.sampled_from([0.0, 0.25, 0.5, 1.0]))


@st.composite
def instances(draw: st.DrawFn, tokens: st.SearchStrategy[int]) -> list[ScoredMemory]:
    specs = draw(st.lists(st.tuples(scores, tokens), max_size=12))
    return [mem(i, s, t) for i, (s, t) in enumerate(specs)]


small_tokens = st.integers(min_value=1, max_value=300)


@pytest.mark.parametrize("fine_cells", FINE)
@settings(max_examples=150, deadline=None)
@given(ms=instances(small_tokens), budget=st.integers(min_value=-20, max_value=1200))
def test_feasible_bounded_by_optimum_and_never_below_greedy(
    ms: list[ScoredMemory], budget: int, fine_cells: int
) -> None:
    r = pack(ms, budget, fine_cells=fine_cells)
    assert r.path == "dp"
    assert r.total_tokens == sum(m.token_estimate for m in r.packed)
    assert r.total_tokens <= max(budget, 0)
    assert r.total_score == math.fsum(m.composite_score for m in r.packed)
    assert r.total_score >= score_of(ms, greedy(ms, budget))
    assert r.total_score <= optimum(ms, budget) + 1e-9
    assert {m.memory_id for m in r.packed} | {m.memory_id for m in r.excluded} == {
        m.memory_id for m in ms
    }
    assert len(r.packed) + len(r.excluded) == len(ms)
    assert r.candidates_evaluated == len(ms)
    assert r.excluded_for_budget == len(r.excluded)
    assert r.budget_reached == bool(r.excluded)


@pytest.mark.parametrize("fine_cells", FINE)
@settings(max_examples=150, deadline=None)
@given(
    ms=instances(st.integers(min_value=1, max_value=20).map(lambda k: 16 * k)),
    budget=st.integers(min_value=0, max_value=1200),
)
def test_exact_when_costs_are_bucket_multiples(
    ms: list[ScoredMemory], budget: int, fine_cells: int
) -> None:
    """Bound asserted: no rounding gap at all when every cost is a multiple of 16."""
    assert pack(ms, budget, fine_cells=fine_cells).total_score == pytest.approx(
        optimum(ms, budget), abs=1e-9
    )


@settings(max_examples=150, deadline=None)
@given(ms=instances(small_tokens), budget=st.integers(min_value=1, max_value=400))
def test_small_tables_are_solved_exactly(ms: list[ScoredMemory], budget: int) -> None:
    """n * (budget + 1) <= fine_cells means a 1-token grain: the DP is the exact optimum."""
    assert len(ms) * (budget + 1) <= 1 << 16
    assert pack(ms, budget).total_score == pytest.approx(optimum(ms, budget), abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    ms=instances(small_tokens),
    budget=st.integers(min_value=-5, max_value=1500),
    seed=st.integers(min_value=0, max_value=2**32),
    ceiling=st.sampled_from([0, 70 * 6251]),
)
def test_deterministic_under_shuffle_and_emitted_in_score_then_id_order(
    ms: list[ScoredMemory], budget: int, seed: int, ceiling: int
) -> None:
    shuffled = ms[:]
    random.Random(seed).shuffle(shuffled)
    a = pack(ms, budget, dp_cell_ceiling=ceiling, fine_cells=0)
    b = pack(shuffled, budget, dp_cell_ceiling=ceiling, fine_cells=0)
    assert a == b
    assert list(a.packed) == order(list(a.packed))
    assert list(a.excluded) == order(list(a.excluded))


def test_score_ties_break_by_memory_id() -> None:
    ms = [mem("c", 0.5, 10), mem("a", 0.5, 10), mem("b", 0.5, 10)]
    r = pack(ms, 20)
    assert [m.memory_id for m in r.packed] == ["a", "b"]
    assert [m.memory_id for m in r.excluded] == ["c"]


@pytest.mark.parametrize("budget", [0, -1, -10_000])
def test_non_positive_budget_packs_nothing_and_is_a_truncation(budget: int) -> None:
    ms = [mem(1, 0.9, 5), mem(2, 0.1, 1)]
    r = pack(ms, budget)
    assert r.packed == ()
    assert [m.memory_id for m in r.excluded] == ["m001", "m002"]
    assert (r.total_tokens, r.total_score, r.excluded_for_budget) == (0, 0.0, 2)
    assert r.budget_reached is True


@pytest.mark.parametrize("budget", [0, -3, 500])
def test_empty_candidates_are_not_a_truncation(budget: int) -> None:
    r = pack([], budget)
    assert (r.packed, r.excluded, r.candidates_evaluated) == ((), (), 0)
    assert (r.total_tokens, r.total_score, r.excluded_for_budget) == (0, 0.0, 0)
    assert r.budget_reached is False


def test_everything_fits_is_not_a_truncation() -> None:
    ms = [mem(i, 0.1 * i, 100) for i in range(10)]
    r = pack(ms, 1000)
    assert len(r.packed) == 10
    assert r.budget_reached is False
    assert r.total_tokens == 1000


def test_path_follows_the_cell_ceiling() -> None:
    ms = [mem(i, 0.5, 1000 + i) for i in range(70)]
    assert pack(ms, 100_000).path == "dp"  # 70 * 6251 cells: exactly the default ceiling
    assert pack(ms, 100_016).path == "greedy"
    assert pack(ms, 100_000, dp_cell_ceiling=70 * 6251 - 1).path == "greedy"


def test_greedy_stops_after_the_consecutive_skip_limit() -> None:
    ms = [mem(1, 0.9, 60), mem(2, 0.8, 50), mem(3, 0.7, 50), mem(4, 0.5, 10)]
    two = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=2)
    assert two.path == "greedy"
    assert [m.memory_id for m in two.packed] == ["m001"]  # m004 would fit; the scan stopped
    three = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=3)
    assert [m.memory_id for m in three.packed] == ["m001", "m004"]
    zero = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=0)
    assert [m.memory_id for m in zero.packed] == ["m001"]
    dp = pack(ms, 100, max_consecutive_skips=1)
    assert dp.path == "dp"
    assert [m.memory_id for m in dp.packed] == ["m002", "m003"]  # 1.5 > 0.9 + 0.5


@settings(max_examples=150, deadline=None)
@given(
    ms=instances(small_tokens),
    budget=st.integers(min_value=-5, max_value=1500),
    skips=st.integers(min_value=0, max_value=6),
)
def test_greedy_path_matches_reference(ms: list[ScoredMemory], budget: int, skips: int) -> None:
    r = pack(ms, budget, dp_cell_ceiling=0, max_consecutive_skips=skips)
    assert r.path == "greedy" or not ms
    expected = greedy(ms, budget, max(skips, 1)) if budget > 0 else []
    assert [m.memory_id for m in r.packed] == expected
    assert r.total_tokens <= max(budget, 0)


def test_repair_trims_a_rounding_overshoot() -> None:
    # 20 tokens round to one 16-token bucket; two of them "fit" 2 buckets but not 32 tokens.
    ms = [mem(1, 0.6, 20), mem(2, 0.5, 20)]
    r = pack(ms, 32, fine_cells=0)
    assert [m.memory_id for m in r.packed] == ["m001"]
    assert r.total_tokens == 20


def test_repair_drops_lowest_density_first() -> None:
    tokens = [100, 10, 50]
    scores = [0.9, 0.5, 0.1]  # densities 0.009, 0.05, 0.002
    assert _repair([0, 1, 2], tokens, scores, 110) == [0, 1]
    assert _repair([0, 1, 2], tokens, scores, 59) == [1]
    assert _repair([0, 1], tokens, scores, 500) == [0, 1]


def test_refill_uses_tokens_stranded_by_rounding() -> None:
    # 40 tokens round to 3 buckets and the budget holds 2: the DP cannot take it, refill can.
    r = pack([mem(1, 0.3, 40), mem(2, 0.2, 41)], 40, fine_cells=0)
    assert [m.memory_id for m in r.packed] == ["m001"]


def test_swap_replaces_a_dp_pick_with_a_better_exact_fit() -> None:
    # The DP sees only m002 (2 buckets); a 1-for-1 swap trades it for m001 in exact tokens.
    r = pack([mem(1, 0.3, 40), mem(2, 0.2, 30)], 40, fine_cells=0)
    assert [m.memory_id for m in r.packed] == ["m001"]
    assert r.total_tokens == 40


@pytest.mark.parametrize(
    "bad",
    [
        mem(1, math.nan, 10),
        mem(1, math.inf, 10),
        mem(1, -math.inf, 10),
        mem(1, -0.01, 10),
        mem(1, 1.01, 10),
        mem(1, 0.5, 0),
        mem(1, 0.5, -4),
    ],
)
def test_invalid_candidates_raise(bad: ScoredMemory) -> None:
    with pytest.raises(ValueError, match="m001"):
        pack([mem(0, 0.5, 10), bad], 1000)


def test_duplicate_memory_ids_raise() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        pack([mem("x", 0.5, 10), mem("x", 0.4, 12)], 1000)


@pytest.mark.parametrize(
    "kwargs",
    [{"bucket": 0}, {"dp_cell_ceiling": -1}, {"max_consecutive_skips": -1}, {"fine_cells": -1}],
)
def test_invalid_parameters_raise(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        pack([mem(0, 0.5, 10)], 100, **kwargs)
