"""Scoring: interim_v1, weighted_v1, and inputs that must never be scored."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from ibex.assembly.scoring import INTERIM, WEIGHTED, recency, score_hit, score_schema
from ibex.assembly.structs import AssemblyOptions, MemoryHit

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
