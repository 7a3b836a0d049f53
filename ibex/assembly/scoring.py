"""Packer scores for memory hits, one schema per assembly.

Which score ranks, in order of precedence:

1. `weighted_v1` when the request carries weights: a normalised weighted sum
   over relevance (similarity), confidence, recency and usefulness, over the
   components a hit actually has. The caller asked for it explicitly.
2. `memory_composite_v1` when *every* candidate carries the memory service's
   own `composite_score` (relevance, recency, usefulness, confidence, access
   frequency, weighted by the service): it knows usefulness feedback and
   access counts the daemon does not.
3. `interim_v1` (0.85 x similarity + 0.15 x confidence) otherwise, for all of
   them: one candidate without a composite puts the whole assembly on the
   interim score, because the two scales are not comparable and a mixed
   ranking would order memories by which score they happened to get.

A hit whose inputs are non-finite or out of [0, 1] is never scored.
"""

from __future__ import annotations

import math
from datetime import datetime

import msgspec

from ibex.assembly.structs import AssemblyOptions, MemoryHit, ScoredMemory

INTERIM = "interim_v1"
WEIGHTED = "weighted_v1"
COMPOSITE = "memory_composite_v1"

#: Recency half-lives in days: how fast each kind of memory goes stale.
HALF_LIFE_DAYS = {
    "procedural": 90.0,
    "factual": 180.0,
    "preference": 60.0,
    "behavioral": 30.0,
    "episodic": 7.0,
}
DEFAULT_HALF_LIFE_DAYS = 30.0


def _unit(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and 0.0 <= x <= 1.0


def uses_weights(options: AssemblyOptions) -> bool:
    # Plain `or`, not any() over a generator: this runs once per hit.
    return (
        options.relevance_weight > 0
        or options.confidence_weight > 0
        or options.recency_weight > 0
        or options.usefulness_weight > 0
    )


def score_schema(options: AssemblyOptions, all_composite: bool = False) -> str:
    """The schema that ranks: weights first, then the service's composite, else interim.

    `all_composite`: every candidate of the assembly carries a composite_score.
    """
    if uses_weights(options):
        return WEIGHTED
    return COMPOSITE if all_composite else INTERIM


#: Timestamps already parsed (None: unparseable). The same memories come back call after
#: call, and a dict lookup is under half of `fromisoformat` plus `timestamp`. Bounded:
#: cleared when full, and only strings up to RFC 3339's longest form are kept.
_TIMESTAMPS: dict[str, float | None] = {}
_TIMESTAMPS_MAX = 8192
_TIMESTAMP_MAX_CHARS = 64


def _timestamp(created_at: str) -> float | None:
    try:
        return _TIMESTAMPS[created_at]
    except KeyError:
        pass
    try:
        ts: float | None = datetime.fromisoformat(created_at).timestamp()
    except (ValueError, OverflowError, OSError):
        ts = None
    if len(created_at) <= _TIMESTAMP_MAX_CHARS:
        if len(_TIMESTAMPS) >= _TIMESTAMPS_MAX:
            _TIMESTAMPS.clear()
        _TIMESTAMPS[created_at] = ts
    return ts


def recency(created_at: str | None, category: str, now: float) -> float | None:
    """Exponential decay by category half-life; None when the age is unknown."""
    if not created_at:
        return None
    ts = _timestamp(created_at)
    if ts is None:
        return None
    age_days = max(0.0, now - ts) / 86400.0
    half_life = HALF_LIFE_DAYS.get(category, DEFAULT_HALF_LIFE_DAYS)
    return float(0.5 ** (age_days / half_life))


def as_composite(scored: ScoredMemory | None, hit: MemoryHit) -> ScoredMemory | None:
    """`score_hit(hit, options, now, COMPOSITE)` from the same hit's interim score.

    `scored` is `score_hit(hit, options, now, INTERIM)` for options without
    weights: only the packer score differs, so the hit is not scored twice.
    """
    if scored is None or not _unit(hit.composite_score):
        return None
    assert hit.composite_score is not None
    return msgspec.structs.replace(scored, composite_score=min(1.0, max(0.0, hit.composite_score)))


def score_hit(
    hit: MemoryHit, options: AssemblyOptions, now: float, schema: str | None = None
) -> ScoredMemory | None:
    """The scored candidate, or None when the hit's inputs are unusable (exclusion `failed`).

    `schema` is the assembly's (`score_schema`); None means weighted or interim
    by the options. COMPOSITE needs the hit's composite_score.
    """
    if not (_unit(hit.similarity) and _unit(hit.confidence)):
        return None
    if hit.usefulness is not None and not _unit(hit.usefulness):
        return None
    rec = recency(hit.created_at, hit.category, now)
    useful = hit.usefulness
    if schema == COMPOSITE and hit.composite_score is not None and not uses_weights(options):
        if not _unit(hit.composite_score):
            return None
        score = hit.composite_score
    elif uses_weights(options):
        parts = [
            (options.relevance_weight, hit.similarity),
            (options.confidence_weight, hit.confidence),
            (options.recency_weight, rec),
            (options.usefulness_weight, useful),
        ]
        present = [(w, v) for w, v in parts if w > 0 and v is not None]
        total = sum(w for w, _ in present)
        score = sum(w * v for w, v in present) / total if total > 0 else 0.0
    else:
        score = 0.85 * hit.similarity + 0.15 * hit.confidence
    score = min(1.0, max(0.0, score))
    return ScoredMemory(
        memory_id=hit.memory_id,
        category=hit.category,
        content=hit.content,
        composite_score=score,
        similarity=hit.similarity,
        confidence=hit.confidence,
        rank=hit.rank,
        relevance_score=hit.similarity,
        recency_score=rec if rec is not None else 0.0,
        usefulness_score=useful if useful is not None else 0.0,
        branch=hit.branch,
    )
