"""Scoring: interim_v1, weighted_v1, and inputs that must never be scored."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from ibex.assembly import scoring
from ibex.assembly.scoring import (
    DEFAULT_HALF_LIFE_DAYS,
    HALF_LIFE_DAYS,
    INTERIM,
    WEIGHTED,
    recency,
    score_hit,
    score_schema,
    uses_weights,
)
from ibex.assembly.structs import AssemblyOptions, MemoryHit, ScoredMemory

NOW = datetime(2026, 11, 30, tzinfo=UTC).timestamp()


def hit(**kw: object) -> MemoryHit:
    base: dict[str, object] = dict(
        memory_id="m",
        org_id="o",
        agent_id="a",
        content="c",
        category="factual",
        confidence=0.5,
        similarity=0.8,
        rank=1,
    )
    base.update(kw)
    return MemoryHit(**base)  # type: ignore[arg-type]


def test_interim_formula() -> None:
    s = score_hit(hit(similarity=0.8, confidence=0.4), AssemblyOptions(), NOW)
    assert s is not None and s.composite_score == pytest.approx(0.85 * 0.8 + 0.15 * 0.4)
    assert score_schema(AssemblyOptions()) == INTERIM


@pytest.mark.parametrize(
    "kw",
    [
        dict(similarity=math.nan),
        dict(similarity=1.2),
        dict(similarity=-0.1),
        dict(confidence=math.inf),
        dict(confidence=-1.0),
        dict(usefulness=2.0),
    ],
)
def test_unusable_inputs_are_not_scored(kw: dict[str, float]) -> None:
    assert score_hit(hit(**kw), AssemblyOptions(), NOW) is None


def test_weighted_over_present_components() -> None:
    opts = AssemblyOptions(relevance_weight=1.0, recency_weight=1.0, usefulness_weight=2.0)
    assert score_schema(opts) == WEIGHTED
    # No created_at and no usefulness: only relevance is present.
    s = score_hit(hit(similarity=0.6), opts, NOW)
    assert s is not None and s.composite_score == pytest.approx(0.6)
    created = (datetime.fromtimestamp(NOW, UTC) - timedelta(days=7)).isoformat()
    s = score_hit(
        hit(similarity=0.6, usefulness=0.9, created_at=created, category="episodic"), opts, NOW
    )
    assert s is not None
    assert s.recency_score == pytest.approx(0.5)
    assert s.composite_score == pytest.approx((0.6 + 0.5 + 2 * 0.9) / 4)


def test_recency_half_lives_and_bad_dates() -> None:
    created = (datetime.fromtimestamp(NOW, UTC) - timedelta(days=90)).isoformat()
    assert recency(created, "procedural", NOW) == pytest.approx(0.5)
    assert recency("2026-11-30T00:00:00Z", "factual", NOW) == pytest.approx(1.0)
    assert recency("2030-01-01T00:00:00Z", "factual", NOW) == pytest.approx(1.0)  # future: fresh
    assert recency("yesterday", "factual", NOW) is None
    assert recency(None, "factual", NOW) is None


def test_parsed_timestamps_are_remembered_within_a_bound() -> None:
    """Asked again, a timestamp gives the same recency (a bad one stays None), and the
    memo of parsed timestamps never holds more than its bound or an overlong string."""
    created = (datetime.fromtimestamp(NOW, UTC) - timedelta(days=60)).isoformat()
    for _ in range(2):
        assert recency(created, "preference", NOW) == pytest.approx(0.5)
        assert recency("yesterday", "factual", NOW) is None
    assert recency(created, "preference", NOW + 60 * DAY) == pytest.approx(0.25)
    for day in range(scoring._TIMESTAMPS_MAX + 10):
        recency(f"2020-01-01T00:00:00.{day:06d}Z", "factual", NOW)
        assert len(scoring._TIMESTAMPS) <= scoring._TIMESTAMPS_MAX
    long = "2020-01-01T00:00:00." + "0" * 80 + "Z"
    assert recency(long, "factual", NOW) is not None
    assert long not in scoring._TIMESTAMPS


# ---------------------------------------------------------------------------
# Scoring boundaries: the interim formula exactly, weighted scoring edge cases, recency.
#
# Seed: ``interim = 0.85 x similarity + 0.15 x confidence``; both inputs finite
# in [0, 1], else the hit is never scored. README: with weights the score is a
# normalised weighted sum over the components a hit actually has (relevance =
# similarity, confidence, recency by category half-life, usefulness).

DAY = 86_400.0


def whit(**kw: object) -> MemoryHit:
    base: dict[str, object] = {
        "memory_id": "m1",
        "org_id": "o",
        "agent_id": "a",
        "content": "body",
        "category": "factual",
        "confidence": 0.5,
        "similarity": 0.5,
        "rank": 3,
    }
    base.update(kw)
    return MemoryHit(**base)  # type: ignore[arg-type]


def ago(days: float) -> str:
    return datetime.fromtimestamp(NOW - days * DAY, UTC).isoformat()


def scored(h: MemoryHit, opts: AssemblyOptions | None = None) -> ScoredMemory:
    s = score_hit(h, opts or AssemblyOptions(), NOW)
    assert s is not None
    return s


def test_schema_names() -> None:
    assert (INTERIM, WEIGHTED) == ("interim_v1", "weighted_v1")


# --------------------------------------------------------------------------- interim


@pytest.mark.parametrize(
    ("similarity", "confidence", "expected"),
    [
        (1.0, 0.0, 0.85),
        (0.0, 1.0, 0.15),
        (0.0, 0.0, 0.0),
        (1.0, 1.0, 1.0),
        (0.2, 0.6, 0.26),
        (0.5, 0.5, 0.5),
    ],
)
def test_interim_is_exactly_85_15(similarity: float, confidence: float, expected: float) -> None:
    s = scored(whit(similarity=similarity, confidence=confidence))
    assert s.composite_score == pytest.approx(expected, abs=1e-12)
    assert s.composite_score == 0.85 * similarity + 0.15 * confidence


def test_interim_ignores_recency_and_usefulness() -> None:
    a = scored(whit(similarity=0.7, confidence=0.3))
    b = scored(whit(similarity=0.7, confidence=0.3, usefulness=1.0, created_at=ago(0)))
    assert a.composite_score == b.composite_score == pytest.approx(0.85 * 0.7 + 0.15 * 0.3)
    assert score_schema(AssemblyOptions()) == INTERIM
    assert not uses_weights(AssemblyOptions())


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "kw",
    [
        {"similarity": math.nan},
        {"similarity": math.inf},
        {"similarity": -math.inf},
        {"similarity": -1e-9},
        {"similarity": 1.0 + 1e-9},
        {"confidence": math.nan},
        {"confidence": math.inf},
        {"confidence": -1e-9},
        {"confidence": 1.0 + 1e-9},
        {"usefulness": math.nan},
        {"usefulness": -1e-9},
        {"usefulness": 1.0 + 1e-9},
        {"usefulness": math.inf},
    ],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_out_of_range_inputs_are_never_scored(kw: dict[str, float], weighted: bool) -> None:
    opts = AssemblyOptions(relevance_weight=1.0) if weighted else AssemblyOptions()
    assert score_hit(whit(**kw), opts, NOW) is None


@pytest.mark.parametrize("edge", [0.0, 1.0])
def test_inputs_on_the_bounds_are_scored(edge: float) -> None:
    s = scored(whit(similarity=edge, confidence=edge, usefulness=edge))
    assert s.similarity == s.confidence == s.usefulness_score == edge


def test_scored_memory_carries_the_hit_and_its_components() -> None:
    h = whit(
        memory_id="id-7",
        category="episodic",
        content="text",
        similarity=0.6,
        confidence=0.2,
        rank=9,
        branch="hot",
        usefulness=0.4,
        created_at=ago(7),
    )
    s = scored(h)
    assert (s.memory_id, s.category, s.content, s.rank, s.branch) == (
        "id-7",
        "episodic",
        "text",
        9,
        "hot",
    )
    assert (s.similarity, s.confidence, s.relevance_score) == (0.6, 0.2, 0.6)
    assert s.recency_score == pytest.approx(0.5)
    assert s.usefulness_score == 0.4
    assert s.token_estimate == 0


def test_missing_components_are_reported_as_zero() -> None:
    s = scored(whit())
    assert (s.recency_score, s.usefulness_score) == (0.0, 0.0)


# --------------------------------------------------------------------------- weighted


@pytest.mark.parametrize(
    "name", ["relevance_weight", "confidence_weight", "recency_weight", "usefulness_weight"]
)
@pytest.mark.parametrize("value", [1e-9, 0.5, 2.0])
def test_any_single_positive_weight_switches_to_weighted(name: str, value: float) -> None:
    opts = AssemblyOptions(**{name: value})  # type: ignore[arg-type]
    assert uses_weights(opts)
    assert score_schema(opts) == WEIGHTED


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("relevance_weight", 0.6),
        ("confidence_weight", 0.2),
        ("recency_weight", 0.5),
        ("usefulness_weight", 0.9),
    ],
)
def test_each_weight_alone_selects_its_component(name: str, expected: float) -> None:
    h = whit(similarity=0.6, confidence=0.2, usefulness=0.9, created_at=ago(7), category="episodic")
    s = scored(h, AssemblyOptions(**{name: 3.0}))  # type: ignore[arg-type]
    assert s.composite_score == pytest.approx(expected)


def test_weights_are_normalised_over_present_components() -> None:
    opts = AssemblyOptions(
        relevance_weight=1.0, confidence_weight=2.0, recency_weight=3.0, usefulness_weight=4.0
    )
    h = whit(similarity=0.6, confidence=0.2, usefulness=0.9, created_at=ago(7), category="episodic")
    s = scored(h, opts)
    assert s.composite_score == pytest.approx((0.6 + 2 * 0.2 + 3 * 0.5 + 4 * 0.9) / 10)
    # Without created_at and usefulness only relevance and confidence count.
    s = scored(whit(similarity=0.6, confidence=0.2), opts)
    assert s.composite_score == pytest.approx((0.6 + 2 * 0.2) / 3)


def test_one_small_weight_still_counts() -> None:
    # A tiny relevance weight next to nothing else: the score is the similarity,
    # not zero and not the interim formula.
    s = scored(whit(similarity=0.6, confidence=0.2), AssemblyOptions(relevance_weight=1e-6))
    assert s.composite_score == pytest.approx(0.6)
    # A tiny weight next to a large one moves the score by a tiny amount.
    opts = AssemblyOptions(relevance_weight=1e-3, confidence_weight=1.0)
    s = scored(whit(similarity=1.0, confidence=0.0), opts)
    assert s.composite_score == pytest.approx(1e-3 / 1.001)
    assert s.composite_score > 0.0


@pytest.mark.parametrize(
    "opts",
    [
        AssemblyOptions(recency_weight=1.0),  # no created_at
        AssemblyOptions(usefulness_weight=1.0),  # no usefulness
        AssemblyOptions(recency_weight=2.0, usefulness_weight=0.5),
    ],
)
def test_no_component_present_scores_zero(opts: AssemblyOptions) -> None:
    s = scored(whit(similarity=0.9, confidence=0.9), opts)
    assert s.composite_score == 0.0
    assert score_schema(opts) == WEIGHTED


def test_unparseable_created_at_leaves_recency_absent() -> None:
    opts = AssemblyOptions(relevance_weight=1.0, recency_weight=1.0)
    s = scored(whit(similarity=0.4, created_at="last tuesday"), opts)
    assert s.composite_score == pytest.approx(0.4)
    assert s.recency_score == 0.0


def test_weighted_score_stays_in_unit_range() -> None:
    opts = AssemblyOptions(relevance_weight=1e300, confidence_weight=1e300)
    s = scored(whit(similarity=1.0, confidence=1.0), opts)
    assert 0.0 <= s.composite_score <= 1.0


# --------------------------------------------------------------------------- recency


def test_half_life_table() -> None:
    assert HALF_LIFE_DAYS == {
        "procedural": 90.0,
        "factual": 180.0,
        "preference": 60.0,
        "behavioral": 30.0,
        "episodic": 7.0,
    }
    assert DEFAULT_HALF_LIFE_DAYS == 30.0


@pytest.mark.parametrize("category", [*sorted(HALF_LIFE_DAYS), "custom", "Episodic", ""])
def test_recency_is_one_half_after_the_category_half_life(category: str) -> None:
    half = HALF_LIFE_DAYS.get(category, DEFAULT_HALF_LIFE_DAYS)
    assert recency(ago(half), category, NOW) == pytest.approx(0.5)
    assert recency(ago(2 * half), category, NOW) == pytest.approx(0.25)
    assert recency(ago(0), category, NOW) == 1.0


def test_custom_category_uses_the_default_half_life_in_weighted_scores() -> None:
    opts = AssemblyOptions(recency_weight=1.0)
    s = scored(whit(category="runbook", created_at=ago(30)), opts)
    assert s.composite_score == pytest.approx(0.5)
    assert s.recency_score == pytest.approx(0.5)
    s = scored(whit(category="runbook", created_at=ago(15)), opts)
    assert s.composite_score == pytest.approx(0.5**0.5)


def test_recency_one_day_exactly() -> None:
    assert recency(ago(1), "episodic", NOW) == pytest.approx(0.5 ** (1 / 7))
    assert recency(ago(1), "factual", NOW) == pytest.approx(0.5 ** (1 / 180))


@pytest.mark.parametrize("created_at", [None, "", "yesterday", "2026-13-01T00:00:00Z", "0"])
def test_unknown_age_is_none(created_at: str | None) -> None:
    assert recency(created_at, "factual", NOW) is None


def test_future_dates_count_as_new() -> None:
    assert recency(ago(-30), "episodic", NOW) == 1.0


def test_timezones_are_honoured() -> None:
    # 12:00+02:00 is 10:00 UTC: exactly seven days before NOW + 10 h.
    now = datetime(2026, 11, 30, 10, tzinfo=UTC).timestamp()
    assert recency("2026-11-23T12:00:00+02:00", "episodic", now) == pytest.approx(0.5)
    assert recency("2026-11-23T10:00:00Z", "episodic", now) == pytest.approx(0.5)


def test_recency_returns_a_float() -> None:
    r = recency(ago(3), "episodic", NOW)
    assert type(r) is float
    assert r == pytest.approx(0.5 ** (3 / 7))


def test_module_exports_the_schemas() -> None:
    assert scoring.INTERIM == INTERIM
