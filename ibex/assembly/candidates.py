"""Candidate selection: the tenant filter, scoring, dedupe and caps, shared by both RPCs.

The tenant rule lives here once. Another org's or agent's hit is dropped
before scoring, so it can never displace a legitimate duplicate or leak
through degradation; AssembleContext and SearchMemories both go through
`own_hits`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from ibex.assembly.scoring import COMPOSITE, INTERIM, as_composite, score_hit, score_schema
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    Exclusion,
    MemoryHit,
    MemoryUsed,
    ScoredMemory,
)

MAX_MEMORIES_HARD_CAP = 100


def is_own(hit: MemoryHit, org_id: str, agent_id: str) -> bool:
    """Whether a hit belongs to the caller's org and agent (ids are canonical lower case)."""
    return hit.org_id.lower() == org_id and hit.agent_id.lower() == agent_id


def memory_used(m: ScoredMemory, exclusion: Exclusion, *, unpriced: bool = False) -> MemoryUsed:
    """The report of a scored candidate: `included`, or why it was left out.

    `unpriced`: report no token_estimate (a candidate cut before pricing would reach it).
    """
    # Keywords rather than a copy by field name (attrgetter over MemoryUsed's fields):
    # this runs for every candidate of every answer, and msgspec builds a struct
    # fastest from keywords. test_candidates_rules checks that every field is copied.
    return MemoryUsed(
        memory_id=m.memory_id,
        composite_score=m.composite_score,
        relevance_score=m.relevance_score,
        recency_score=m.recency_score,
        usefulness_score=m.usefulness_score,
        rank=m.rank,
        category=m.category,
        exclusion=exclusion,
        similarity=m.similarity,
        confidence=m.confidence,
        token_estimate=0 if unpriced else m.token_estimate,
    )


def excluded_hit(hit: MemoryHit, exclusion: Exclusion) -> MemoryUsed:
    """The report of a hit left out before it was scored; non-finite numbers read 0."""
    finite = [
        v if v == v and abs(v) != float("inf") else 0.0 for v in (hit.similarity, hit.confidence)
    ]
    return MemoryUsed(
        memory_id=hit.memory_id,
        rank=hit.rank,
        category=hit.category,
        exclusion=exclusion,
        similarity=finite[0],
        confidence=finite[1],
    )


def _sort_key(m: ScoredMemory) -> tuple[float, str]:
    return (-m.composite_score, m.memory_id)


class Selection(msgspec.Struct, frozen=True, gc=False):
    """ScoredHit candidates (best first), exclusions so far, and the other tenants' hit count.

    `priced`: the candidates carry their token_estimate already (both branches
    were priced as they landed, see ibex.assembly.prepare).
    """

    candidates: list[ScoredMemory]
    excluded: list[MemoryUsed]
    tenant_filtered: int
    score_schema: str = INTERIM
    priced: bool = False


class ScoredHit(msgspec.Struct, frozen=True, gc=False):
    """One own, wanted hit scored by every schema the whole assembly may choose.

    `fallback` is the options' own score (weighted_v1 or interim_v1) and
    `composite` memory_composite_v1's (only when the hit carries a composite and
    the options carry no weights); None means unusable under that schema
    (exclusion `failed`). Both carry their token_estimate when the branch is priced.
    """

    hit: MemoryHit
    fallback: ScoredMemory | None
    composite: ScoredMemory | None


class BranchCandidates(msgspec.Struct, frozen=True, gc=False):
    """One branch's hits after the work that does not depend on the other branch.

    Entries keep the hits' order: an exclusion decided by the hit alone (`filter`,
    `failed` for oversized content) or a `ScoredHit`. `wanted` counts the ScoredHit
    entries and `all_composite` says whether every one carries a composite: the
    merge chooses the schema from both branches' (see `select`).
    """

    hits: tuple[MemoryHit, ...]
    now: float
    entries: list[MemoryUsed | ScoredHit]
    tenant_filtered: int
    wanted: int
    all_composite: bool
    priced: bool = False


def branch_candidates(
    request: AssemblyRequest,
    hits: Sequence[MemoryHit],
    now: float,
    skip: bool,
    price: Callable[[ScoredMemory], ScoredMemory] | None = None,
) -> BranchCandidates:
    """The per-hit work of `select` for one branch: tenant filter, skip, oversize, scores.

    Another tenant's hit is only counted. Each wanted hit is scored under both
    schemas it can be ranked by, so the choice between them waits for the merge.
    `price`, when given, returns a scored variant with its token_estimate.
    """
    opts = request.options
    org_id, agent_id = request.org_id, request.agent_id
    fallback_schema = score_schema(opts, False)
    composite_possible = fallback_schema == INTERIM
    entries: list[MemoryUsed | ScoredHit] = []
    tenant_filtered = wanted = 0
    all_composite = True
    for hit in hits:
        if not is_own(hit, org_id, agent_id):
            tenant_filtered += 1
            continue
        if skip:
            entries.append(excluded_hit(hit, "filter"))
            continue
        if hit.oversized:  # content over the source's cap, dropped: never counted
            entries.append(excluded_hit(hit, "failed"))
            continue
        wanted += 1
        fallback = score_hit(hit, opts, now, fallback_schema)
        if hit.composite_score is None:
            all_composite = False
            composite = None
        else:
            composite = as_composite(fallback, hit) if composite_possible else None
        if price is not None and fallback is not None:
            fallback = price(fallback)
            if composite is not None:
                composite = price(composite)
        entries.append(ScoredHit(hit, fallback, composite))
    priced = price is not None or not wanted
    return BranchCandidates(
        tuple(hits), now, entries, tenant_filtered, wanted, all_composite, priced
    )


def merge(request: AssemblyRequest, hot: BranchCandidates, cold: BranchCandidates) -> Selection:
    """Schema, dedupe and caps over both branches (hot first): `select`'s second half.

    The score schema is chosen once for all candidates (see ibex.assembly.scoring):
    the service's composite only when every candidate carries one. When both
    branches were priced, the selection carries the candidates' prices.
    """
    opts = request.options
    wanted = hot.wanted + cold.wanted
    schema = score_schema(opts, wanted > 0 and hot.all_composite and cold.all_composite)
    composite = schema == COMPOSITE
    priced = hot.priced and cold.priced
    excluded: list[MemoryUsed] = []
    best: dict[str, ScoredMemory] = {}
    for side in (hot, cold):
        for entry in side.entries:
            if not isinstance(entry, ScoredHit):
                excluded.append(entry)
                continue
            scored = entry.composite if composite else entry.fallback
            if scored is None:
                excluded.append(excluded_hit(entry.hit, "failed"))
                continue
            prev = best.get(scored.memory_id)
            if prev is None or _sort_key(scored) < _sort_key(prev):
                best[scored.memory_id] = scored
    ranked = sorted(best.values(), key=_sort_key)
    cap = MAX_MEMORIES_HARD_CAP
    if opts.max_memories > 0:
        cap = min(cap, opts.max_memories)
    if excluded:
        seen = set(best)
        once = []
        for m in excluded:
            if m.memory_id not in seen:
                seen.add(m.memory_id)
                once.append(m)
        excluded = once
    # A truncated candidate is reported unpriced, as when pricing followed the caps.
    excluded += (memory_used(m, "truncated", unpriced=True) for m in ranked[cap:])
    return Selection(
        ranked[:cap],
        excluded,
        hot.tenant_filtered + cold.tenant_filtered,
        schema,
        priced,
    )


def select(
    request: AssemblyRequest, hot: Sequence[MemoryHit], cold: Sequence[MemoryHit], now: float
) -> Selection:
    """Tenant filter, skip options, scoring, dedupe and caps.

    Another tenant's hit is dropped before anything else: it must never be
    able to displace a legitimate duplicate or leak through degradation, and
    it is only counted (`tenant_filtered`), never named in `excluded`. A
    memory id appears in `excluded` at most once, and never when it was ranked.
    The work splits into each branch's own (`branch_candidates`, which can run
    as soon as that branch lands) and the `merge`.
    """
    opts = request.options
    return merge(
        request,
        branch_candidates(request, hot, now, opts.skip_hot_memories),
        branch_candidates(request, cold, now, opts.skip_cold_memories),
    )


def select_candidates(
    request: AssemblyRequest, hot: Sequence[MemoryHit], cold: Sequence[MemoryHit], now: float
) -> tuple[list[ScoredMemory], list[MemoryUsed]]:
    """`select` without the tenant count: the scored candidates and the exclusions so far."""
    selection = select(request, hot, cold, now)
    return selection.candidates, selection.excluded


class SearchFilter(msgspec.Struct, frozen=True):
    """A validated SearchMemories request (`validate_search`: ids canonical, limit capped)."""

    org_id: str
    agent_id: str
    limit: int
    min_similarity: float = 0.0
    categories: frozenset[str] = frozenset()
    tags: frozenset[str] = frozenset()
    query: str = ""

    @property
    def narrows(self) -> bool:
        """Filters applied after the fetch: ask the source for the cap, not `limit`."""
        return bool(self.categories or self.tags or self.min_similarity > 0)


class SearchHit(msgspec.Struct, frozen=True):
    hit: MemoryHit
    score: float


class SearchResult(msgspec.Struct, frozen=True):
    hits: tuple[SearchHit, ...]
    own_candidates: int  # the caller's own hits before filters (never another tenant's)
    tenant_filtered: int


def rank_search(hits: Sequence[MemoryHit], flt: SearchFilter, now: float) -> SearchResult:
    """The tenant filter, SearchMemories' filters and the default score, best first.

    The default score is the memory service's composite when every own hit
    carries one, else interim_v1 for all (as in `select`). A hit without tags
    never matches a tag filter.
    """
    options = AssemblyOptions()
    own_hits = [h for h in hits if not h.oversized and is_own(h, flt.org_id, flt.agent_id)]
    schema = score_schema(
        options, bool(own_hits) and all(h.composite_score is not None for h in own_hits)
    )
    out: list[SearchHit] = []
    own = filtered = 0
    for hit in hits:
        if not is_own(hit, flt.org_id, flt.agent_id):
            filtered += 1
            continue
        own += 1
        if hit.oversized:  # its content was dropped by the source: nothing to return
            continue
        if hit.similarity < flt.min_similarity:
            continue
        if flt.categories and hit.category not in flt.categories:
            continue
        if flt.tags and flt.tags.isdisjoint(hit.tags):
            continue
        scored = score_hit(hit, options, now, schema)
        if scored is not None:
            out.append(SearchHit(hit, scored.composite_score))
    out.sort(key=lambda h: (-h.score, h.hit.memory_id))
    return SearchResult(tuple(out[: flt.limit]), own, filtered)
