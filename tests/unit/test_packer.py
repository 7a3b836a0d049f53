"""The packer against an exact brute-force solver and its stated invariants."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex.assembly import packer
from ibex.assembly.packer import _dp, _grain, _greedy, _improve, _repair, pack
from ibex.assembly.structs import ScoredMemory
from ibex.testing.samples import scored

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


# ---------------------------------------------------------------------------
# The packer's stages tested directly, on instances greedy cannot solve.
#
# `pack()` keeps the better of its DP answer and a plain greedy one, so a test
# that greedy solves cannot tell whether refill, swaps, repair or the fine grain
# exist. These tests call `_improve`, `_repair`, `_grain`, `_dp` and `_greedy`
# themselves, and check `pack()` only on instances where greedy, and the
# 16-token grain, fall short of the optimum. Indices are positions in score
# order (the packer sorts candidates before its stages see them).


def optimum_of(tokens: list[int], scores: list[float], capacity: int) -> float:
    best = 0.0
    for r in range(len(tokens) + 1):
        for combo in itertools.combinations(range(len(tokens)), r):
            if sum(tokens[i] for i in combo) <= capacity:
                best = max(best, math.fsum(scores[i] for i in combo))
    return best


def greedy_score(ms: list[ScoredMemory], budget: int) -> float:
    left, total = budget, 0.0
    for m in sorted(ms, key=lambda m: (-m.composite_score, m.memory_id)):
        if m.token_estimate <= left:
            left -= m.token_estimate
            total += m.composite_score
    return total


def test_defaults() -> None:
    assert packer.DEFAULT_BUCKET == 16
    assert packer.DEFAULT_DP_CELL_CEILING == 70 * 6251
    assert packer.DEFAULT_MAX_CONSECUTIVE_SKIPS == 5
    assert packer.DEFAULT_FINE_CELLS == 1 << 16


# --------------------------------------------------------------------------- _improve: refill


def test_refill_fills_an_empty_choice_in_score_order() -> None:
    assert _improve([], [5, 5, 5], [0.9, 0.8, 0.7], 10) == [0, 1]


def test_refill_with_a_single_candidate() -> None:
    assert _improve([], [5], [0.5], 5) == [0]
    assert _improve([], [6], [0.5], 5) == []


def test_refill_rechecks_what_is_left_after_each_add() -> None:
    # All three fit the 10 tokens left at the start; only two fit together.
    out = _improve([], [4, 4, 4], [0.3, 0.2, 0.1], 10)
    assert out == [0, 1]


def test_refill_takes_the_best_that_fits_not_the_first_that_fits() -> None:
    # Score order: index 0 (6 tokens) first, then 1 and 2 (5 tokens each).
    assert _improve([], [6, 5, 5], [0.9, 0.5, 0.4], 10) == [0]


def test_refill_adds_to_an_existing_choice() -> None:
    assert _improve([2], [7, 3, 5], [0.9, 0.5, 0.1], 8) == [1, 2]


def test_nothing_to_do_when_everything_is_chosen() -> None:
    assert _improve([0, 1], [3, 4], [0.5, 0.4], 7) == [0, 1]
    assert _improve([0, 1], [3, 4], [0.5, 0.4], 100) == [0, 1]


def test_nothing_fits() -> None:
    assert _improve([], [20, 30], [0.5, 0.4], 10) == []


def test_zero_capacity() -> None:
    assert _improve([], [1, 2], [0.5, 0.4], 0) == []


# --------------------------------------------------------------------------- _improve: swaps


def test_swap_when_the_extra_tokens_exactly_fit() -> None:
    # Holding index 1 (10 tokens) with 2 left: index 0 costs 2 more, exactly what is left.
    assert _improve([1], [12, 10], [0.9, 0.5], 12) == [0]


def test_no_swap_when_the_extra_tokens_do_not_fit() -> None:
    assert _improve([1], [12, 10], [0.9, 0.5], 11) == [1]


def test_swap_to_a_cheaper_better_item() -> None:
    # out - in is negative: always fits, and frees tokens for a refill afterwards.
    assert _improve([1], [6, 10, 4], [0.9, 0.5, 0.3], 10) == [0, 2]


def test_swap_never_lowers_or_keeps_the_score() -> None:
    # Equal scores: a swap would gain nothing, so the choice stays as it is.
    assert _improve([1], [5, 5], [0.5, 0.5], 5) == [1]
    assert _improve([0], [5, 5], [0.5, 0.5], 5) == [0]
    # A worse outside item is never swapped in, even if it is cheaper.
    assert _improve([0], [5, 1], [0.5, 0.4], 5) == [0]


def test_swap_picks_the_largest_gain() -> None:
    # Holding index 3; indices 0, 1, 2 each fit in its place, 0 gains the most.
    assert _improve([3], [9, 9, 9, 9], [0.9, 0.8, 0.7, 0.1], 9) == [0]
    # The best item does not fit; the best that fits does.
    assert _improve([3], [12, 9, 9, 9], [0.9, 0.8, 0.7, 0.1], 10) == [1]


def test_swap_drops_the_member_whose_loss_is_smallest() -> None:
    # Holding 1 and 2 (8 + 8 of 16); index 0 (8 tokens) replaces the worse one.
    assert _improve([1, 2], [8, 8, 8], [0.9, 0.5, 0.2], 16) == [0, 1]


def test_repeated_swaps_and_refills() -> None:
    # Start from the worst pair; two swaps reach the best pair.
    tokens = [5, 5, 5, 5]
    scores = [0.9, 0.8, 0.2, 0.1]
    assert _improve([2, 3], tokens, scores, 10) == [0, 1]


def test_improve_against_the_optimum_on_small_instances() -> None:
    # Local search is not exact, but it must never exceed the capacity, never
    # lower the score it started from, and reach a 1-swap local optimum.
    rng = random.Random(20261130)
    for _ in range(300):
        n = rng.randint(1, 7)
        tokens = [rng.randint(1, 30) for _ in range(n)]
        scores = sorted(
            (rng.choice([0.1, 0.2, 0.3, 0.5, 0.7, 0.9]) for _ in range(n)), reverse=True
        )
        capacity = rng.randint(0, 80)
        start = [i for i in range(n) if rng.random() < 0.4]
        while sum(tokens[i] for i in start) > capacity:
            start.pop()
        out = _improve(start, tokens, scores, capacity)
        assert out == sorted(set(out))
        used = sum(tokens[i] for i in out)
        assert used <= capacity
        before = math.fsum(scores[i] for i in start)
        after = math.fsum(scores[i] for i in out)
        assert after >= before - 1e-12
        left = capacity - used
        outside = [j for j in range(n) if j not in out]
        assert all(tokens[j] > left for j in outside)  # nothing more fits
        for i in out:
            for j in outside:  # no improving 1-for-1 swap remains
                assert not (tokens[j] - tokens[i] <= left and scores[j] > scores[i] + 1e-12)
        assert after <= optimum_of(tokens, scores, capacity) + 1e-12


# --------------------------------------------------------------------------- _repair


def test_repair_keeps_a_fitting_choice_untouched() -> None:
    chosen = [0, 2]
    assert _repair(chosen, [5, 5, 5], [0.5, 0.4, 0.3], 10) is chosen


def test_repair_stops_as_soon_as_it_fits() -> None:
    # Densities: 0.01, 0.02, 0.03: drop index 0 only (frees 50 of 10 over).
    assert _repair([0, 1, 2], [50, 20, 10], [0.5, 0.4, 0.3], 70) == [1, 2]


def test_repair_exactly_at_capacity() -> None:
    assert _repair([0, 1], [6, 4], [0.5, 0.4], 10) == [0, 1]
    assert _repair([0, 1], [6, 5], [0.5, 0.4], 10) == [0]  # 0.4/5 < 0.5/6


def test_repair_density_ties_drop_the_later_index_first() -> None:
    # Equal density: the later (lower-ranked) index goes first.
    assert _repair([0, 1, 2], [10, 10, 10], [0.5, 0.5, 0.5], 20) == [0, 1]


def test_repair_can_drop_everything() -> None:
    assert _repair([0, 1], [10, 10], [0.5, 0.4], 0) == []


# --------------------------------------------------------------------------- _grain


@pytest.mark.parametrize(
    ("n", "capacity", "bucket", "fine_cells", "grain"),
    [
        (3, 100, 16, 1 << 16, 1),
        (3, 100, 16, 0, 16),  # 0: never finer than the bucket
        (1, 99, 16, 100, 1),  # 1 x (99 + 1) cells: exactly the limit
        (1, 99, 16, 99, 2),  # one cell short: the next divisor
        (1, 100, 16, 40, 4),  # 3 would fit (34 cells) but does not divide 16
        (1, 100, 16, 51, 2),
        (1, 100, 16, 7, 16),  # even 8 needs 13 cells
        (2, 100, 16, 26, 8),  # 2 x 13
        (2, 100, 16, 25, 16),
        (4, 1000, 10, 4004, 1),
        (4, 1000, 10, 4003, 2),
        (4, 1000, 10, 1000, 5),  # 4 x 201 = 804; 3, 4 do not divide 10
        (5, 10, 1, 1 << 16, 1),  # bucket 1: the grain is 1
    ],
)
def test_grain_is_the_finest_divisor_within_the_cells(
    n: int, capacity: int, bucket: int, fine_cells: int, grain: int
) -> None:
    assert _grain(n, capacity, bucket, fine_cells) == grain


# --------------------------------------------------------------------------- _dp


def test_dp_small_exact_cases() -> None:
    assert _dp([3, 4, 5], [0.4, 0.5, 0.6], 7) == [0, 1]
    assert _dp([3, 4, 5], [0.4, 0.5, 0.6], 9) == [1, 2]
    assert _dp([3, 4, 5], [0.4, 0.5, 0.6], 12) == [0, 1, 2]
    assert _dp([3, 4, 5], [0.4, 0.5, 0.6], 2) == []
    assert _dp([8, 1], [0.9, 0.1], 4) == [1]  # an item heavier than the table is skipped
    assert _dp([1, 1, 1], [0.3, 0.3, 0.3], 2) == [0, 1]  # ties: the earlier items
    assert _dp([2, 2], [0.5, 0.5], 2) == [0]
    # Everything fits exactly: everything is taken, a zero score included.
    assert _dp([1, 1], [0.5, 0.0], 2) == [0, 1]
    assert _dp([1, 1], [0.5, 0.0], 3) == [0, 1]


def test_dp_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 8)
        weights = [rng.randint(1, 12) for _ in range(n)]
        scores = [rng.choice([0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0]) for _ in range(n)]
        buckets = rng.randint(0, 40)
        chosen = _dp(weights, scores, buckets)
        assert chosen == sorted(set(chosen))
        assert sum(weights[i] for i in chosen) <= buckets
        assert math.fsum(scores[i] for i in chosen) == pytest.approx(
            optimum_of(weights, scores, buckets), abs=1e-9
        )


# --------------------------------------------------------------------------- _greedy


def test_greedy_first_fit_and_skip_limit() -> None:
    tokens = [6, 5, 5, 1, 1]
    assert _greedy(tokens, 10, 5) == [0, 3, 4]
    assert _greedy(tokens, 10, 2) == [0]  # two misfits in a row stop it
    assert _greedy(tokens, 10, 3) == [0, 3, 4]
    assert _greedy([6, 5, 1, 5, 1], 10, 2) == [0, 2, 4]  # a fit resets the count
    assert _greedy([5, 5], 10, 1) == [0, 1]
    assert _greedy([11, 1], 10, 1) == []
    assert _greedy([10], 10, 1) == [0]
    assert _greedy([11, 5, 5], 10, 2) == [1, 2]  # one misfit before any fit is not two


# --------------------------------------------------------------------------- pack()

# Greedy reaches 1.5 (0.8 + 0.7), the 16-token grain the same; the optimum 2.0
# (0.8 + 0.6 + 0.6 in 72 of 75 tokens) needs the 1-token grain.
HARD = [mem(1, 0.6, 27), mem(2, 0.8, 24), mem(3, 0.6, 21), mem(4, 0.7, 31)]
HARD_BUDGET = 75


def test_fine_grain_solves_what_greedy_and_coarse_grain_cannot() -> None:
    assert greedy_score(HARD, HARD_BUDGET) == pytest.approx(1.5)
    coarse = pack(HARD, HARD_BUDGET, fine_cells=0)
    assert coarse.total_score == pytest.approx(1.5)
    fine = pack(HARD, HARD_BUDGET)  # the default fine_cells
    assert fine.path == "dp"
    assert fine.total_score == pytest.approx(2.0)
    assert [m.memory_id for m in fine.packed] == ["m002", "m001", "m003"]
    assert fine.total_tokens == 72


def test_the_cell_ceiling_also_bounds_the_fine_table() -> None:
    # 4 x (4 + 1) = 20 cells: DP path, but no finer table fits under 20 cells.
    r = pack(HARD, HARD_BUDGET, dp_cell_ceiling=20)
    assert r.path == "dp"
    assert r.total_score == pytest.approx(pack(HARD, HARD_BUDGET, fine_cells=0).total_score)
    assert r.total_score < 2.0


def test_small_tables_are_exact_with_the_default_grain() -> None:
    rng = random.Random(42)
    for _ in range(150):
        n = rng.randint(1, 6)
        ms = [
            mem(i, rng.choice([0.1, 0.3, 0.5, 0.6, 0.8, 0.9]), rng.randint(1, 60)) for i in range(n)
        ]
        budget = rng.randint(1, 150)
        r = pack(ms, budget)
        tokens = [m.token_estimate for m in ms]
        scores = [m.composite_score for m in ms]
        assert r.total_score == pytest.approx(optimum_of(tokens, scores, budget), abs=1e-9)
        assert r.total_tokens <= budget


def test_budget_is_never_exceeded_on_every_path() -> None:
    rng = random.Random(99)
    for _ in range(150):
        n = rng.randint(0, 12)
        ms = [mem(i, rng.random(), rng.randint(1, 400)) for i in range(n)]
        budget = rng.randint(-5, 2000)
        for kwargs in ({}, {"fine_cells": 0}, {"dp_cell_ceiling": 0}, {"bucket": 7}):
            r = pack(ms, budget, **kwargs)  # type: ignore[arg-type]
            assert r.total_tokens == sum(m.token_estimate for m in r.packed)
            assert r.total_tokens <= max(budget, 0)
            assert r.total_score == pytest.approx(math.fsum(m.composite_score for m in r.packed))
            assert len(r.packed) + len(r.excluded) == n
            assert r.excluded_for_budget == len(r.excluded)
            assert r.budget_reached == bool(r.excluded)
            assert r.candidates_evaluated == n


@pytest.mark.parametrize("ceiling", [0, 1 << 20])
def test_tie_order_by_memory_id_on_both_paths(ceiling: int) -> None:
    # Equal scores and costs, room for two of three: the two smallest ids, in id order.
    ms = [mem("b", 0.5, 10), mem("c", 0.5, 10), mem("a", 0.5, 10)]
    for perm in itertools.permutations(ms):
        r = pack(list(perm), 25, dp_cell_ceiling=ceiling)
        assert [m.memory_id for m in r.packed] == ["a", "b"]
        assert [m.memory_id for m in r.excluded] == ["c"]


def test_packed_and_excluded_are_in_score_then_id_order() -> None:
    ms = [mem("z", 0.9, 50), mem("y", 0.5, 5), mem("x", 0.5, 5), mem("w", 0.1, 5), mem("v", 0.9, 5)]
    r = pack(ms, 16)
    assert [m.memory_id for m in r.packed] == ["v", "x", "y"]
    assert [m.memory_id for m in r.excluded] == ["z", "w"]


def test_deterministic_across_permutations() -> None:
    ms = [*HARD, mem(5, 0.6, 9), mem(6, 0.2, 3)]
    first = pack(ms, HARD_BUDGET)
    rng = random.Random(3)
    for _ in range(30):
        shuffled = ms[:]
        rng.shuffle(shuffled)
        assert pack(shuffled, HARD_BUDGET) == first


@pytest.mark.parametrize(
    ("n", "budget", "ceiling", "path"),
    [
        (2, 32, 6, "dp"),  # 2 x (2 + 1) = 6 cells: exactly the ceiling
        (2, 32, 5, "greedy"),
        (2, 47, 6, "dp"),  # 47 // 16 = 2 buckets
        (2, 48, 6, "greedy"),
        (1, 0, 1, "dp"),
        (3, 100, 0, "greedy"),  # a ceiling of 0: always greedy
        (1, 1, 0, "greedy"),
    ],
)
def test_path_by_cell_ceiling(n: int, budget: int, ceiling: int, path: str) -> None:
    ms = [mem(i, 0.5, 1) for i in range(n)]
    assert pack(ms, budget, dp_cell_ceiling=ceiling).path == path


def test_everything_fits_on_the_dp_path_takes_everything() -> None:
    ms = [mem(i, 0.1 + 0.1 * i, 10) for i in range(5)]
    r = pack(ms, 50)
    assert (len(r.packed), r.total_tokens, r.budget_reached) == (5, 50, False)
    r = pack(ms, 49)
    assert (len(r.packed), r.total_tokens, r.budget_reached) == (4, 40, True)
    assert [m.memory_id for m in r.excluded] == ["m000"]


def test_greedy_path_honours_the_skip_limit_but_the_dp_fallback_does_not() -> None:
    # Score order: 60, 50, 50, 10 tokens; after the 60 two misfits stop the greedy path.
    ms = [mem(1, 0.9, 60), mem(2, 0.8, 50), mem(3, 0.7, 50), mem(4, 0.1, 10)]
    greedy_path = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=2)
    assert [m.memory_id for m in greedy_path.packed] == ["m001"]
    one = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=1)
    assert [m.memory_id for m in one.packed] == ["m001"]
    zero = pack(ms, 100, dp_cell_ceiling=0, max_consecutive_skips=0)
    assert [m.memory_id for m in zero.packed] == ["m001"]  # 0 behaves like 1
    default = pack(ms, 100, dp_cell_ceiling=0)  # 5 skips allowed
    assert [m.memory_id for m in default.packed] == ["m001", "m004"]


def test_pack_keeps_greedy_when_the_dp_answer_is_worse() -> None:
    # 16-token grain: the DP takes 50 + 18 (4 buckets), repair drops the 50
    # (68 > 66 tokens), refill adds the 20 and no 1-for-1 swap fits: 0.5.
    # Greedy's 0.7 (the 50 alone) is better and must win.
    tokens, scores, budget = [50, 18, 20], [0.7, 0.3, 0.2], 66
    staged = _improve(
        _repair(_dp([3, 1, 1], scores, 4), tokens, scores, budget), tokens, scores, budget
    )
    assert staged == [1, 2]
    ms = [mem(1, 0.7, 50), mem(2, 0.3, 18), mem(3, 0.2, 20)]
    r = pack(ms, budget, fine_cells=0)
    assert r.path == "dp"
    assert [m.memory_id for m in r.packed] == ["m001"]
    assert r.total_score == pytest.approx(0.7)


@pytest.mark.parametrize("bucket", [1, 3, 16])
def test_any_bucket_gives_a_feasible_answer_at_least_greedy(bucket: int) -> None:
    rng = random.Random(bucket)
    for _ in range(60):
        ms = [mem(i, rng.random(), rng.randint(1, 90)) for i in range(rng.randint(1, 8))]
        budget = rng.randint(1, 300)
        r = pack(ms, budget, bucket=bucket, fine_cells=0)
        assert r.total_tokens <= budget
        assert r.total_score >= greedy_score(ms, budget) - 1e-9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket": 0}, "bucket must be >= 1, got 0"),
        ({"dp_cell_ceiling": -1}, "dp_cell_ceiling must be >= 0, got -1"),
        ({"fine_cells": -2}, "fine_cells must be >= 0, got -2"),
        ({"max_consecutive_skips": -3}, "max_consecutive_skips must be >= 0, got -3"),
    ],
)
def test_parameter_errors_say_which(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as info:
        pack([mem(0, 0.5, 10)], 100, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs", [{"bucket": 1}, {"dp_cell_ceiling": 0}, {"fine_cells": 0}])
def test_parameter_lower_bounds_are_accepted(kwargs: dict[str, int]) -> None:
    assert [m.memory_id for m in pack([mem(0, 0.5, 10)], 100, **kwargs).packed] == ["m000"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (mem("b", 1.5, 10), "memory 'b': composite_score must be finite in [0, 1]"),
        (mem("b", -0.5, 10), "memory 'b': composite_score must be finite in [0, 1]"),
        (mem("b", 0.5, 0), "memory 'b': token_estimate must be an int >= 1"),
        (mem("a", 0.4, 10), "duplicate memory_id 'a'; dedupe before packing"),
    ],
)
def test_candidate_errors_say_which(bad: ScoredMemory, message: str) -> None:
    with pytest.raises(ValueError) as info:
        pack([mem("a", 0.5, 10), bad], 100)
    assert str(info.value) == message


def test_the_duplicate_named_is_the_repeated_one() -> None:
    with pytest.raises(ValueError) as info:
        pack([mem("b", 0.5, 10), mem("a", 0.5, 10), mem("c", 0.5, 10), mem("a", 0.4, 10)], 100)
    assert str(info.value) == "duplicate memory_id 'a'; dedupe before packing"


def test_non_int_token_estimate_is_refused() -> None:
    with pytest.raises(ValueError, match="token_estimate"):
        pack([mem("a", 0.5, 1.5)], 100)  # type: ignore[arg-type]


def test_bounds_of_valid_candidates_are_accepted() -> None:
    r = pack([mem("a", 0.0, 1), mem("b", 1.0, 1)], 2)
    assert [m.memory_id for m in r.packed] == ["b", "a"]


def test_a_one_token_budget_holds_a_one_token_memory() -> None:
    r = pack([mem(0, 0.5, 1), mem(1, 0.4, 2)], 1)
    assert [m.memory_id for m in r.packed] == ["m000"]
    assert r.path == "dp"


def test_one_token_memories_weigh_one_cell_in_the_fine_table() -> None:
    # Optimum 1.8 = 0.7 + 0.6 + 0.5 in 3 + 2 + 1 tokens; greedy stops at 1.3.
    ms = [
        mem(i, s, t)
        for i, (s, t) in enumerate([(0.7, 4), (0.7, 3), (0.6, 2), (0.5, 3), (0.5, 1), (0.4, 3)])
    ]
    assert greedy_score(ms, 6) == pytest.approx(1.3)
    r = pack(ms, 6)
    assert r.total_score == pytest.approx(1.8)
    assert [m.memory_id for m in r.packed] == ["m001", "m002", "m004"]


def test_a_tie_with_greedy_keeps_the_dp_answer() -> None:
    # DP: 0.6 + 0.5 + 0.3 in 3 tokens; greedy: 0.8 + 0.6, the same 1.4. Greedy
    # replaces the DP's answer only when strictly better.
    specs = [(0.8, 2), (0.6, 1), (0.5, 1), (0.4, 2), (0.3, 3), (0.3, 1), (0.2, 1)]
    ms = [mem(i, s, t) for i, (s, t) in enumerate(specs)]
    r = pack(ms, 3)
    assert math.fsum(m.composite_score for m in r.packed) == math.fsum([0.8, 0.6])
    assert [m.memory_id for m in r.packed] == ["m001", "m002", "m005"]
