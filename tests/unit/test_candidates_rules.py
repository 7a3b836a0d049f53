"""Candidate selection and SearchMemories ranking (ibex/assembly/candidates.py).

README: candidates are filtered by tenant, scored (``failed`` when unusable),
deduplicated by memory id (the better score wins), capped by ``max_memories``
and the hard cap of 100 (``truncated``). SearchMemories applies the tenant
rule first, then ``min_similarity``, categories and tags, scores with the
default formula and returns the best ``limit``, ties by id.
"""

from __future__ import annotations

import datetime
import math

import msgspec
import pytest

from ibex.assembly.candidates import (
    MAX_MEMORIES_HARD_CAP,
    SearchFilter,
    branch_candidates,
    excluded_hit,
    is_own,
    memory_used,
    merge,
    rank_search,
    select,
    select_candidates,
)
from ibex.assembly.scoring import COMPOSITE
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    MemoryHit,
    MemoryUsed,
    ScoredMemory,
)

ORG = "0000000a-000b-4000-8000-00000000000c"
AGENT = "00000000-0000-4000-8000-0000000000a1"
OTHER = "00000000-0000-4000-8000-000000000002"
NOW = 1_760_000_000.0


def hit(mid: str, similarity: float = 0.5, **kw: object) -> MemoryHit:
    base: dict[str, object] = {
        "memory_id": mid,
        "org_id": ORG,
        "agent_id": AGENT,
        "content": f"content of {mid}",
        "category": "factual",
        "confidence": 0.5,
        "similarity": similarity,
        "rank": 1,
    }
    base.update(kw)
    return MemoryHit(**base)  # type: ignore[arg-type]


def req(**opts: object) -> AssemblyRequest:
    return AssemblyRequest(agent_id=AGENT, org_id=ORG, options=AssemblyOptions(**opts))  # type: ignore[arg-type]


def test_hard_cap_is_one_hundred() -> None:
    assert MAX_MEMORIES_HARD_CAP == 100


def test_is_own_compares_canonical_lower_case() -> None:
    assert is_own(hit("a"), ORG, AGENT)
    assert is_own(hit("a", org_id=ORG.upper(), agent_id=AGENT.upper()), ORG, AGENT)
    assert not is_own(hit("a", org_id=OTHER), ORG, AGENT)
    assert not is_own(hit("a", agent_id=OTHER), ORG, AGENT)


def test_upper_case_hit_ids_are_still_the_callers_own() -> None:
    ranked, excluded = select_candidates(
        req(), [], [hit("a", org_id=ORG.upper(), agent_id=AGENT.upper())], NOW
    )
    assert [m.memory_id for m in ranked] == ["a"]
    assert excluded == []


def test_ranked_best_first_ties_by_id() -> None:
    cold = [hit("c", 0.5), hit("a", 0.9), hit("b", 0.5), hit("d", 0.1)]
    ranked, _ = select_candidates(req(), [], cold, NOW)
    assert [m.memory_id for m in ranked] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("skip_hot", "skip_cold", "kept", "filtered"),
    [
        (False, False, ["h", "c"], []),
        (True, False, ["c"], ["h"]),
        (False, True, ["h"], ["c"]),
        (True, True, [], ["h", "c"]),
    ],
)
def test_skip_options(
    skip_hot: bool, skip_cold: bool, kept: list[str], filtered: list[str]
) -> None:
    ranked, excluded = select_candidates(
        req(skip_hot_memories=skip_hot, skip_cold_memories=skip_cold),
        [hit("h", 0.9, branch="hot")],
        [hit("c", 0.8)],
        NOW,
    )
    assert [m.memory_id for m in ranked] == kept
    assert [(m.memory_id, m.exclusion) for m in excluded] == [(f, "filter") for f in filtered]


def test_unusable_hits_fail_with_finite_reported_values() -> None:
    cold = [hit("nan", math.nan), hit("inf", 0.5, confidence=math.inf), hit("ok", 0.5)]
    ranked, excluded = select_candidates(req(), [], cold, NOW)
    assert [m.memory_id for m in ranked] == ["ok"]
    assert [(m.memory_id, m.exclusion) for m in excluded] == [("nan", "failed"), ("inf", "failed")]
    assert (excluded[0].similarity, excluded[0].confidence) == (0.0, 0.5)
    assert (excluded[1].similarity, excluded[1].confidence) == (0.5, 0.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_excluded_hit_never_reports_a_non_finite_number(bad: float) -> None:
    u = excluded_hit(hit("x", bad, confidence=bad, rank=7, category="episodic"), "failed")
    assert (u.similarity, u.confidence) == (0.0, 0.0)
    assert (u.memory_id, u.rank, u.category, u.exclusion) == ("x", 7, "episodic", "failed")
    ok = excluded_hit(hit("y", 0.25, confidence=0.75), "filter")
    assert (ok.similarity, ok.confidence, ok.exclusion) == (0.25, 0.75, "filter")


def test_used_copies_every_reported_field() -> None:
    m = ScoredMemory(
        memory_id="m",
        category="episodic",
        content="secret text",
        composite_score=0.7,
        similarity=0.6,
        confidence=0.4,
        rank=3,
        relevance_score=0.6,
        recency_score=0.2,
        usefulness_score=0.1,
        token_estimate=42,
    )
    u = memory_used(m, "budget")
    assert (u.memory_id, u.category, u.rank, u.exclusion, u.token_estimate) == (
        "m",
        "episodic",
        3,
        "budget",
        42,
    )
    assert (u.composite_score, u.similarity, u.confidence) == (0.7, 0.6, 0.4)
    assert (u.relevance_score, u.recency_score, u.usefulness_score) == (0.6, 0.2, 0.1)
    # Every reported field but the exclusion is the candidate's own, by name.
    copied = set(MemoryUsed.__struct_fields__) - {"exclusion"}
    assert copied <= set(ScoredMemory.__struct_fields__)
    assert {n: getattr(u, n) for n in copied} == {n: getattr(m, n) for n in copied}


@pytest.mark.parametrize(("cap", "kept"), [(0, 5), (1, 1), (4, 4), (5, 5), (6, 5)])
def test_max_memories_cap(cap: int, kept: int) -> None:
    cold = [hit(f"m{i}", 0.1 * i) for i in range(5)]
    ranked, excluded = select_candidates(req(max_memories=cap), [], cold, NOW)
    assert len(ranked) == kept
    assert [m.memory_id for m in ranked] == [f"m{i}" for i in range(4, 4 - kept, -1)]
    assert [(m.memory_id, m.exclusion) for m in excluded] == [
        (f"m{i}", "truncated") for i in range(4 - kept, -1, -1)
    ]
    assert all(m.token_estimate == 0 for m in excluded)  # truncated before any pricing


def test_a_truncated_candidate_is_reported_unpriced_even_when_priced_early() -> None:
    """A price counted while retrieval waited is not reported for a candidate the caps
    cut: as when pricing follows the caps (candidates.merge)."""
    cold = [hit(f"m{i}", 0.1 * i) for i in range(3)]
    request = req(max_memories=1)
    stream = branch_candidates(
        request, cold, NOW, False, lambda m: msgspec.structs.replace(m, token_estimate=7)
    )
    empty = branch_candidates(request, (), NOW, False, lambda m: m)
    selection = merge(request, empty, stream)
    assert [m.token_estimate for m in selection.candidates] == [7]
    assert [(m.exclusion, m.token_estimate) for m in selection.excluded] == [("truncated", 0)] * 2


@pytest.mark.parametrize("branch", ["hot", "cold"])
def test_one_candidate_with_the_services_composite_is_ranked_by_it(branch: str) -> None:
    """The service's composite is used when every candidate carries one; one is every."""
    request = req()
    one = [hit("a", 0.9, branch=branch, composite_score=0.2)]
    hot, cold = (one, []) if branch == "hot" else ([], one)
    selection = select(request, hot, cold, NOW)
    assert selection.score_schema == COMPOSITE
    assert [m.composite_score for m in selection.candidates] == [0.2]


@pytest.mark.parametrize(("cap", "kept"), [(0, 100), (100, 100), (101, 100), (150, 100), (99, 99)])
def test_hard_cap_applies_whatever_max_memories_says(cap: int, kept: int) -> None:
    cold = [hit(f"m{i:03d}", 0.5) for i in range(120)]
    ranked, excluded = select_candidates(req(max_memories=cap), [], cold, NOW)
    assert len(ranked) == kept
    assert len(excluded) == 120 - kept
    assert {m.exclusion for m in excluded} <= {"truncated"}


def test_dedupe_counts_a_memory_once() -> None:
    hot = [hit("a", 0.3, branch="hot"), hit("b", 0.9, branch="hot")]
    cold = [hit("a", 0.6), hit("a", 0.1)]
    ranked, excluded = select_candidates(req(), hot, cold, NOW)
    assert [(m.memory_id, m.similarity) for m in ranked] == [("b", 0.9), ("a", 0.6)]
    assert excluded == []


# --------------------------------------------------------------------------- SearchMemories


def flt(**kw: object) -> SearchFilter:
    base: dict[str, object] = {"org_id": ORG, "agent_id": AGENT, "limit": 10}
    base.update(kw)
    return SearchFilter(**base)  # type: ignore[arg-type]


def test_narrows() -> None:
    assert not flt().narrows
    assert flt(min_similarity=0.1).narrows
    assert flt(categories=frozenset({"factual"})).narrows
    assert flt(tags=frozenset({"t"})).narrows
    assert not flt(min_similarity=0.0).narrows


def test_rank_search_tenant_rule_and_counts() -> None:
    hits = [hit("a", 0.9), hit("x", 0.99, org_id=OTHER), hit("y", 0.99, agent_id=OTHER), hit("b")]
    res = rank_search(hits, flt(), NOW)
    assert [h.hit.memory_id for h in res.hits] == ["a", "b"]
    assert (res.own_candidates, res.tenant_filtered) == (2, 2)


def test_rank_search_scores_with_the_interim_formula_best_first() -> None:
    hits = [
        hit("b", 0.5, confidence=1.0),
        hit("a", 0.5, confidence=1.0),
        hit("c", 0.8, confidence=0.0),
    ]
    res = rank_search(hits, flt(), NOW)
    assert [h.hit.memory_id for h in res.hits] == ["c", "a", "b"]
    assert [h.score for h in res.hits] == pytest.approx([0.68, 0.575, 0.575])


def test_rank_search_min_similarity_is_inclusive() -> None:
    hits = [hit("lo", 0.49), hit("eq", 0.5), hit("hi", 0.51)]
    res = rank_search(hits, flt(min_similarity=0.5), NOW)
    assert [h.hit.memory_id for h in res.hits] == ["hi", "eq"]
    assert res.own_candidates == 3


def test_rank_search_categories_and_tags() -> None:
    hits = [
        hit("f", category="factual", tags=("deploy",)),
        hit("e", category="episodic", tags=("deploy", "ci")),
        hit("n", category="factual"),
    ]
    by_cat = rank_search(hits, flt(categories=frozenset({"factual"})), NOW)
    assert sorted(h.hit.memory_id for h in by_cat.hits) == ["f", "n"]
    by_tag = rank_search(hits, flt(tags=frozenset({"ci", "other"})), NOW)
    assert [h.hit.memory_id for h in by_tag.hits] == ["e"]  # a hit without tags never matches
    both = rank_search(
        hits, flt(categories=frozenset({"factual"}), tags=frozenset({"deploy"})), NOW
    )
    assert [h.hit.memory_id for h in both.hits] == ["f"]


def test_rank_search_drops_unscorable_hits_and_applies_the_limit() -> None:
    hits = [hit("bad", math.nan), *(hit(f"m{i}", 0.1 * i) for i in range(6))]
    res = rank_search(hits, flt(limit=3), NOW)
    assert [h.hit.memory_id for h in res.hits] == ["m5", "m4", "m3"]
    assert res.own_candidates == 7
    assert rank_search(hits, flt(limit=0), NOW).hits == ()


def test_rank_search_accepts_hits_with_a_creation_date() -> None:
    hits = [hit("dated", 0.9, created_at="2025-01-01T00:00:00+00:00"), hit("undated", 0.8)]
    res = rank_search(hits, flt(), NOW)
    assert [h.hit.memory_id for h in res.hits] == ["dated", "undated"]
    assert res.hits[0].score == pytest.approx(0.85 * 0.9 + 0.15 * 0.5)


def test_rank_search_uses_the_composite_when_every_own_hit_has_one_whatever_others_carry() -> None:
    """Only the caller's own hits decide the score schema: another tenant's hit without a
    composite (filtered out anyway) or an own hit whose content was dropped does not switch
    the caller's ranking to interim_v1."""
    hits = [
        hit("a", 0.5, composite_score=0.9),
        hit("b", 0.9, composite_score=0.3),
        hit("x", 0.9, org_id=OTHER),  # no composite
        hit("big", 0.9, oversized=True),  # no composite, and dropped: it does not count
    ]
    res = rank_search(hits, flt(), NOW)
    assert [(h.hit.memory_id, h.score) for h in res.hits] == [("a", 0.9), ("b", 0.3)]


def test_select_candidates_scores_recency_at_the_time_it_is_given() -> None:
    """Recency decays from `now`: a day-old memory outranks a 400-day-old one when recency
    is asked for."""

    def created(days_before: float) -> str:
        at = datetime.datetime.fromtimestamp(NOW - days_before * 86400, datetime.UTC)
        return at.isoformat().replace("+00:00", "Z")

    cold = [hit("old", 0.5, created_at=created(400)), hit("new", 0.5, created_at=created(1))]
    ranked, _ = select_candidates(req(recency_weight=1.0), [], cold, NOW)
    assert [m.memory_id for m in ranked] == ["new", "old"]
    assert ranked[0].composite_score > 0.99 > 0.25 > ranked[1].composite_score


def test_an_oversized_hit_is_failed_and_the_hits_after_it_are_still_candidates() -> None:
    cold = [hit("a", 0.9), hit("big", 0.8, oversized=True), hit("c", 0.7)]
    ranked, excluded = select_candidates(req(), [], cold, NOW)
    assert [m.memory_id for m in ranked] == ["a", "c"]
    assert [(m.memory_id, m.exclusion) for m in excluded] == [("big", "failed")]


def test_every_hit_of_a_skipped_stream_is_reported_filtered() -> None:
    hot = [hit(f"h{i}", 0.9, branch="hot") for i in range(3)]
    ranked, excluded = select_candidates(req(skip_hot_memories=True), hot, [], NOW)
    assert ranked == []
    assert [(m.memory_id, m.exclusion) for m in excluded] == [
        ("h0", "filter"),
        ("h1", "filter"),
        ("h2", "filter"),
    ]
