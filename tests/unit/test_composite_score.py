"""The memory service's composite score (contract section 2): on the wire, and which score ranks.

Every candidate with a valid `composite_score` -> ranked by it, schema
`memory_composite_v1`; one without -> `interim_v1` for all of them; explicit
weights -> `weighted_v1` whatever the wire carries. The composites below rank
the memories in the *opposite* order of the interim score, so the packed
order tells which score ranked.
"""

from __future__ import annotations

import json

import pytest

from ibex.assembly.candidates import SearchFilter, rank_search
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.pipeline import AssemblyInputs, assemble_pure
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    MemoryHit,
)
from ibex.assembly.tokens import Tokenizers
from ibex.sources.base import SourceError
from ibex.sources.memory_schema import decode_hits
from ibex.testing.samples import AGENT, ORG

NOW = 1_760_000_000.0
OK = (
    BranchOutcome("directive", "success", 1.0),
    BranchOutcome("hot", "success", 1.0),
    BranchOutcome("cold", "success", 1.0),
)


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    tk = Tokenizers(None, 4096)
    tk.preload(["o200k_base"])
    return tk


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def _hit(mid: str, similarity: float, composite: float | None) -> MemoryHit:
    return MemoryHit(
        memory_id=mid,
        org_id=ORG,
        agent_id=AGENT,
        content=f"Fact {mid}: the billing service deploys from main.",
        category="factual",
        confidence=0.5,
        similarity=similarity,
        rank=1,
        composite_score=composite,
    )


# Interim order: m1 > m2 > m3 > m4 (similarity); composite order: m4 > m3 > m2 > m1.
SIMS = {"m1": 0.9, "m2": 0.7, "m3": 0.5, "m4": 0.3}
COMPOSITES = {"m1": 0.1, "m2": 0.4, "m3": 0.6, "m4": 0.95}


def _assemble(
    tokenizers: Tokenizers,
    catalog: Catalog,
    hits: list[MemoryHit],
    options: AssemblyOptions | None = None,
    available_tokens: int = 0,
) -> AssemblyResult:
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="deploy",
        model="gpt-4o",
        options=options or AssemblyOptions(),
        available_tokens=available_tokens,
    )
    inputs = AssemblyInputs(
        request=request,
        directive=None,
        hot=tuple(hits[:2]),
        cold=tuple(hits[2:]),
        branches=OK,
        nonce="1" * 39,
        now=NOW,
    )
    return assemble_pure(inputs, catalog=catalog, tokenizers=tokenizers)


def _order(result: AssemblyResult) -> list[str]:
    return [m.memory_id for m in result.memories_used]


def test_every_candidate_with_a_composite_ranks_by_it(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    hits = [_hit(m, SIMS[m], COMPOSITES[m]) for m in SIMS]
    result = _assemble(tokenizers, catalog, hits)
    assert result.score_schema == "memory_composite_v1"
    assert _order(result) == ["m4", "m3", "m2", "m1"]
    assert [m.composite_score for m in result.memories_used] == pytest.approx([0.95, 0.6, 0.4, 0.1])


def test_the_composite_decides_what_fits(tokenizers: Tokenizers, catalog: Catalog) -> None:
    """With room for about one memory, the composite's best is packed, not the interim's."""
    hits = [_hit(m, SIMS[m], COMPOSITES[m]) for m in SIMS]
    full = _assemble(tokenizers, catalog, hits)
    one = full.memories_used[0].token_estimate
    overhead = full.tokens_used - full.memory_tokens
    # gpt-4o reserves output and a margin: find the smallest window that still packs one.
    for window in range(overhead + one, overhead + one + 20000, 16):
        small = _assemble(tokenizers, catalog, hits, available_tokens=window)
        if small.memories_used:
            break
    assert _order(small) == ["m4"]


def test_one_candidate_without_a_composite_puts_all_on_the_interim_score(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    hits = [_hit(m, SIMS[m], None if m == "m2" else COMPOSITES[m]) for m in SIMS]
    result = _assemble(tokenizers, catalog, hits)
    assert result.score_schema == "interim_v1"
    assert _order(result) == ["m1", "m2", "m3", "m4"]
    for m in result.memories_used:
        assert m.composite_score == pytest.approx(0.85 * SIMS[m.memory_id] + 0.15 * 0.5)


def test_explicit_weights_take_precedence_over_the_composite(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    hits = [_hit(m, SIMS[m], COMPOSITES[m]) for m in SIMS]
    result = _assemble(tokenizers, catalog, hits, AssemblyOptions(relevance_weight=1.0))
    assert result.score_schema == "weighted_v1"
    assert _order(result) == ["m1", "m2", "m3", "m4"]


def test_no_candidates_is_interim(tokenizers: Tokenizers, catalog: Catalog) -> None:
    assert _assemble(tokenizers, catalog, []).score_schema == "interim_v1"


def test_another_tenants_hit_does_not_decide_the_schema(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    """A dropped hit is not a candidate: its missing composite changes nothing."""
    hits = [_hit(m, SIMS[m], COMPOSITES[m]) for m in SIMS]
    foreign = MemoryHit(
        memory_id="x",
        org_id="00000000-0000-4000-8000-000000000002",
        agent_id=AGENT,
        content="other tenant",
        category="factual",
        confidence=0.5,
        similarity=0.99,
        rank=1,
    )
    result = _assemble(tokenizers, catalog, [*hits[:2], foreign, *hits[2:]])
    assert result.score_schema == "memory_composite_v1"
    assert result.pack.tenant_filtered == 1


# --------------------------------------------------------------------------- wire


def _body(**extra: object) -> bytes:
    result = {
        "memory": {
            "id": "00000000-0000-4000-8000-00000000c001",
            "org_id": ORG,
            "agent_id": AGENT,
            "content": "text",
            "category": "factual",
            "confidence": 0.5,
        },
        "similarity": 0.5,
        "rank": 1,
        "source": "cold",
        **extra,
    }
    return json.dumps({"data": {"results": [result]}}).encode()


def test_composite_on_the_wire_reaches_the_hit() -> None:
    (hit,) = decode_hits(_body(composite_score=0.25), "cold")
    assert hit.composite_score == 0.25
    (hit,) = decode_hits(_body(), "cold")
    assert hit.composite_score is None


@pytest.mark.parametrize("bad", [1.5, -0.01, "0.5", True])
def test_a_composite_out_of_range_fails_the_branch(bad: object) -> None:
    with pytest.raises(SourceError, match="composite_score"):
        decode_hits(_body(composite_score=bad), "cold")


def test_a_non_finite_composite_fails_the_branch() -> None:
    body = _body(composite_score=0.5).replace(b'"composite_score": 0.5', b'"composite_score": NaN')
    with pytest.raises(SourceError):
        decode_hits(body, "cold")


# --------------------------------------------------------------------------- SearchMemories


def test_search_ranks_by_the_composite_only_when_every_hit_has_one() -> None:
    flt = SearchFilter(org_id=ORG, agent_id=AGENT, limit=10)
    hits = [_hit(m, SIMS[m], COMPOSITES[m]) for m in SIMS]
    res = rank_search(hits, flt, NOW)
    assert [h.hit.memory_id for h in res.hits] == ["m4", "m3", "m2", "m1"]
    assert [h.score for h in res.hits] == pytest.approx([0.95, 0.6, 0.4, 0.1])
    hits[1] = _hit("m2", SIMS["m2"], None)
    res = rank_search(hits, flt, NOW)
    assert [h.hit.memory_id for h in res.hits] == ["m1", "m2", "m3", "m4"]
