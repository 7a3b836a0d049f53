"""Work done while retrieval waits (ibex.assembly.prepare) never changes the answer.

`assemble_pure` with any subset of the early work (the fixed sections, either
memory stream, in any order) must equal `assemble_pure` without it: same text,
same counts, same candidates and exclusions, same refusal. Only the stage
timings may differ, so they are left out of the comparison.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.history import Uncached
from ibex.assembly.pipeline import AssemblyInputs, assemble_pure
from ibex.assembly.prepare import EarlyAssembly
from ibex.assembly.scoring import COMPOSITE, INTERIM, as_composite, score_hit
from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    Directive,
    MemoryHit,
    Message,
)
from ibex.assembly.tokens import TokenCounter, Tokenizers
from ibex.assembly.xml_format import XML_TAGS, new_nonce
from ibex.errors import TooLargeError
from ibex.testing.samples import AGENT, ORG

OTHER_ORG = "00000000-0000-4000-8000-000000000002"
NOW = 1_760_000_000.0
NONCE = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
BRANCHES = (
    BranchOutcome("directive", "success", 1.0),
    BranchOutcome("hot", "success", 2.0),
    BranchOutcome("cold", "timeout", 40.0),
)
TEXTS = (
    "The billing service deploys from main after CI is green.",
    "数据库迁移必须向后兼容一个版本：先添加新列，再回填数据。",
    "def rotate(key):\n    publish_jwks(key)  # never before the JWKS entry 🚀",
    "Prefers short answers </memory> with the runbook step cited.",
    "x" * 300,
)
IDS = tuple(f"00000000-0000-4000-8000-0000000000{i:02x}" for i in range(12))


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    tk = Tokenizers(None, 65536)
    tk.preload(["o200k_base", "cl100k_base"])
    return tk


def without_timings(r: AssemblyResult) -> AssemblyResult:
    metrics = AssemblyMetrics(candidates_evaluated=r.metrics.candidates_evaluated)
    return msgspec.structs.replace(r, metrics=metrics)


def run(
    inputs: AssemblyInputs,
    catalog: Catalog,
    tokenizers: Tokenizers,
    prepared: EarlyAssembly | None = None,
) -> AssemblyResult | str:
    """The result without timings, or the refusal's message."""
    try:
        result = assemble_pure(inputs, catalog=catalog, tokenizers=tokenizers, early=prepared)
    except TooLargeError as exc:
        return f"refused: {exc}"
    return without_timings(result)


@st.composite
def hits(draw: st.DrawFn, branch: str) -> tuple[MemoryHit, ...]:
    out = []
    for rank in range(draw(st.integers(0, 8))):
        composite = draw(st.sampled_from([None, 0.3, 0.9, 1.5]))
        out.append(
            MemoryHit(
                memory_id=draw(st.sampled_from(IDS)),  # duplicates within and across streams
                org_id=draw(st.sampled_from([ORG, ORG, ORG, OTHER_ORG])),
                agent_id=AGENT,
                content=draw(st.sampled_from(TEXTS)),
                category=draw(st.sampled_from(["factual", "episodic", "runbook"])),
                confidence=draw(st.sampled_from([0.2, 0.7, 1.0])),
                similarity=draw(st.sampled_from([0.1, 0.6, 0.95, float("nan")])),
                rank=rank + 1,
                branch=branch,  # type: ignore[arg-type]
                created_at=draw(st.sampled_from([None, "2025-03-01T08:30:00Z", "garbage"])),
                usefulness=draw(st.sampled_from([None, 0.4])),
                oversized=rank == 2 and draw(st.booleans()),
                composite_score=composite,
            )
        )
    return tuple(out)


@st.composite
def cases(draw: st.DrawFn) -> tuple[AssemblyInputs, Directive | None]:
    weights = draw(st.booleans())
    options = AssemblyOptions(
        skip_hot_memories=draw(st.booleans().map(lambda b: b and draw(st.booleans()))),
        skip_cold_memories=draw(st.booleans().map(lambda b: b and draw(st.booleans()))),
        recency_weight=0.3 if weights else 0.0,
        relevance_weight=0.7 if weights else 0.0,
        max_memories=draw(st.sampled_from([0, 2, 5])),
        reject_history_overflow=draw(st.booleans()),
    )
    history = tuple(
        Message(draw(st.sampled_from(["user", "assistant"])), draw(st.sampled_from(TEXTS)) * n)
        for n in draw(st.lists(st.integers(1, 40), max_size=5))
    )
    directive = draw(
        st.sampled_from(
            [None, Directive("Answer briefly.", "system_first", None), Directive("Be exact. " * 50)]
        )
    )
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="deploy?",
        model=draw(st.sampled_from(["gpt-4o", "gpt-4-turbo", "claude-sonnet-4-5"])),
        # Small windows: history trimmed, memories left out for budget, refusals.
        available_tokens=draw(st.sampled_from([0, 700, 1200, 2500])),
        recent_messages=history,
        tool_schemas=draw(st.sampled_from([(), ('{"name": "lookup"}',)])),
        options=options,
    )
    nonce = draw(st.sampled_from([NONCE, new_nonce(16)]))
    inputs = AssemblyInputs(
        request, directive, draw(hits("hot")), draw(hits("cold")), BRANCHES, nonce, NOW
    )
    return inputs, directive


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), parts=st.sets(st.sampled_from(["fixed", "hot", "cold"])), data=st.data())
def test_any_early_work_gives_the_same_answer(
    catalog: Catalog,
    tokenizers: Tokenizers,
    case: tuple[AssemblyInputs, Directive | None],
    parts: set[str],
    data: st.DataObject,
) -> None:
    inputs, directive = case
    plain = run(inputs, catalog, tokenizers)
    prepared = EarlyAssembly(
        inputs.request, inputs.nonce, inputs.now, catalog=catalog, tokenizers=tokenizers
    )
    for part in data.draw(st.permutations(sorted(parts))):
        if part == "fixed":
            prepared.directive(directive)
        else:
            prepared.hits(part, inputs.hot if part == "hot" else inputs.cold)  # type: ignore[arg-type]
    assert run(inputs, catalog, tokenizers, prepared) == plain
    # And again, now that every count is cached.
    assert run(inputs, catalog, tokenizers) == plain


def hot_and_cold() -> tuple[tuple[MemoryHit, ...], tuple[MemoryHit, ...]]:
    def h(i: int, branch: str, composite: float | None, similarity: float) -> MemoryHit:
        return MemoryHit(
            memory_id=IDS[i],
            org_id=ORG,
            agent_id=AGENT,
            content=TEXTS[i % len(TEXTS)],
            category="factual",
            confidence=0.8,
            similarity=similarity,
            rank=i + 1,
            branch=branch,  # type: ignore[arg-type]
            composite_score=composite,
        )

    hot = (h(0, "hot", 0.9, 0.2), h(1, "hot", 0.1, 0.9), h(2, "hot", 0.5, 0.5))
    cold = (h(2, "cold", None, 0.99), h(3, "cold", None, 0.4))
    return hot, cold


@pytest.mark.parametrize("with_cold", [False, True])
def test_a_composite_on_one_side_only_is_decided_at_the_merge(
    catalog: Catalog, tokenizers: Tokenizers, with_cold: bool
) -> None:
    """Hot alone ranks by the service's composite; a cold hit without one turns all
    of them to interim_v1. The hot stream prepared before cold landed serves both."""
    hot, cold = hot_and_cold()
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    inputs = AssemblyInputs(request, None, hot, cold if with_cold else (), BRANCHES, NONCE, NOW)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.directive(None)
    prepared.hits("hot", hot)
    early = run(inputs, catalog, tokenizers, prepared)
    assert early == run(inputs, catalog, tokenizers)
    assert isinstance(early, AssemblyResult)
    assert early.score_schema == (INTERIM if with_cold else COMPOSITE)
    ids = [m.memory_id for m in early.memories_used]
    assert ids.count(IDS[2]) == 1  # the duplicate kept once


def test_parts_made_from_other_inputs_are_not_used(
    catalog: Catalog, tokenizers: Tokenizers
) -> None:
    hot, cold = hot_and_cold()
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    directive = Directive("Answer briefly.")
    inputs = AssemblyInputs(request, directive, hot, cold, BRANCHES, NONCE, NOW)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.directive(Directive("Another directive, longer than the one answered."))
    prepared.hits("hot", cold)
    prepared.hits("cold", hot)
    assert run(inputs, catalog, tokenizers, prepared) == run(inputs, catalog, tokenizers)
    later = msgspec.structs.replace(inputs, now=NOW + 86400.0 * 30)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.hits("hot", hot)
    assert run(later, catalog, tokenizers, prepared) == run(later, catalog, tokenizers)
    other_nonce = msgspec.structs.replace(inputs, nonce="1" * 39)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.directive(directive)
    assert run(other_nonce, catalog, tokenizers, prepared) == run(other_nonce, catalog, tokenizers)


def test_a_refusal_found_early_is_raised_by_the_pipeline_and_caches_nothing(
    catalog: Catalog,
) -> None:
    """The history cannot fit: the early count keeps the refusal, the pipeline raises the
    same error, and neither the history's nor the memories' counts were cached."""
    tokenizers = Tokenizers(None, 65536)
    hot, _ = hot_and_cold()
    unique = "Ein völlig neuer Satz, der nur in diesem Test vorkommt. "
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="q",
        model="gpt-4o",
        available_tokens=600,
        recent_messages=(Message("user", unique * 200),),
    )
    inputs = AssemblyInputs(request, None, hot, (), BRANCHES, NONCE, NOW)
    counter = tokenizers.counter("o200k_base", "o200k_base")
    before = counter.cache_info()
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.hits("hot", hot)  # landed first: priced, staged
    prepared.directive(None)
    assert prepared.refused
    with pytest.raises(TooLargeError) as early:
        assemble_pure(inputs, catalog=catalog, tokenizers=tokenizers, early=prepared)
    info = counter.cache_info()
    assert (info.size, info.bytes) == (before.size, before.bytes)
    with pytest.raises(TooLargeError) as late:
        assemble_pure(inputs, catalog=catalog, tokenizers=tokenizers)
    assert str(early.value) == str(late.value)
    assert early.value.field == late.value.field


def test_prepared_memory_prices_are_cached_once_the_request_fits(catalog: Catalog) -> None:
    tokenizers = Tokenizers(None, 65536)
    hot, _ = hot_and_cold()
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    counter = tokenizers.counter("o200k_base", "o200k_base")
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.hits("hot", hot)
    staged = counter.cache_info().size
    assemble_pure(
        AssemblyInputs(request, None, hot, (), BRANCHES, NONCE, NOW),
        catalog=catalog,
        tokenizers=tokenizers,
        early=prepared,
    )
    assert counter.cache_info().size > staged


@pytest.mark.parametrize("composite", [None, 0.0, 0.4, 1.0, 1.2, float("nan")])
@pytest.mark.parametrize("similarity", [0.3, 2.0])
def test_as_composite_is_score_hit_under_the_composite_schema(
    composite: float | None, similarity: float
) -> None:
    h = MemoryHit(
        memory_id=IDS[0],
        org_id=ORG,
        agent_id=AGENT,
        content="c",
        category="episodic",
        confidence=0.5,
        similarity=similarity,
        rank=1,
        created_at="2025-06-01T00:00:00Z",
        usefulness=0.3,
        composite_score=composite,
    )
    options = AssemblyOptions()
    expected = score_hit(h, options, NOW, COMPOSITE) if composite is not None else None
    assert as_composite(score_hit(h, options, NOW, INTERIM), h) == expected


class _RecordingCounter(Uncached):
    """A counter without a cache that records every text it is asked to count."""

    def __init__(self, real: TokenCounter) -> None:
        self.real = real
        self.estimate_kind = real.estimate_kind
        self.max_token_bytes = real.max_token_bytes
        self.texts: list[str] = []

    def count(self, text: str) -> int:
        self.texts.append(text)
        return self.real.count_uncached(text)

    count_uncached = count

    def additive_cut(self, text: str) -> int:
        return self.real.additive_cut(text)


class _Recording:
    """One recording counter per family, handed out again on every call (as Tokenizers does)."""

    def __init__(self, tokenizers: Tokenizers) -> None:
        self.tokenizers = tokenizers
        self.counters: dict[str, _RecordingCounter] = {}

    def counter(self, family: str, encoding: str | None) -> _RecordingCounter:
        if family not in self.counters:
            self.counters[family] = _RecordingCounter(self.tokenizers.counter(family, encoding))
        return self.counters[family]


def test_work_done_early_is_not_done_again(catalog: Catalog, tokenizers: Tokenizers) -> None:
    """With the fixed sections and both streams prepared, only merge, pack and render
    remain (the module's docstring): nothing is counted again at the wall, and the
    answer is the one computed from scratch."""
    hot, cold = hot_and_cold()
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="q",
        model="gpt-4o",
        recent_messages=(Message("user", TEXTS[0]), Message("assistant", TEXTS[1])),
        tool_schemas=('{"name": "lookup"}',),
    )
    directive = Directive("Answer briefly.")
    inputs = AssemblyInputs(request, directive, hot, cold, BRANCHES, NONCE, NOW)
    source = _Recording(tokenizers)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=source)
    prepared.directive(directive)
    prepared.hits("hot", hot)
    prepared.hits("cold", cold)
    counter = source.counter("o200k_base", "o200k_base")
    assert counter.texts  # the early work counted the directive, history, tools and prices
    counter.texts.clear()
    early = assemble_pure(inputs, catalog=catalog, tokenizers=source, early=prepared)
    assert counter.texts == []
    plain = assemble_pure(inputs, catalog=catalog, tokenizers=source)
    assert counter.texts  # from scratch, the same answer costs counting (so the check can fail)
    assert without_timings(early) == without_timings(plain)
    assert early.memories_used and early.history_tokens > 0 and early.tool_tokens > 0


def test_a_hits_body_is_counted_once_for_both_of_its_schemas(
    catalog: Catalog, tokenizers: Tokenizers
) -> None:
    """Each hot hit carries a composite, so it is priced under both schemas it may be
    ranked by; its escaped body is the same text in both, and is counted once."""
    hot, _ = hot_and_cold()
    assert all(h.composite_score is not None for h in hot)
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    source = _Recording(tokenizers)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=source)
    counter = source.counter("o200k_base", "o200k_base")
    counter.texts.clear()
    prepared.hits("hot", hot)
    bodies = [XML_TAGS.body_piece(h.content) for h in hot]
    assert [counter.texts.count(b) for b in bodies] == [1, 1, 1]


def test_streams_not_prepared_are_scored_at_the_inputs_now(
    catalog: Catalog, tokenizers: Tokenizers
) -> None:
    """Only the fixed sections prepared: the pipeline scores both branches itself, recency
    against the inputs' `now`, so the answer is the one computed without early work."""
    hot, cold = hot_and_cold()
    dated = "2025-03-01T08:30:00Z"
    hot = tuple(msgspec.structs.replace(h, created_at=dated) for h in hot)
    cold = tuple(msgspec.structs.replace(h, created_at=dated) for h in cold)
    options = AssemblyOptions(recency_weight=0.5, relevance_weight=0.5)
    request = AssemblyRequest(
        agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o", options=options
    )
    directive = Directive("Answer briefly.")
    inputs = AssemblyInputs(request, directive, hot, cold, BRANCHES, NONCE, NOW)
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.directive(directive)
    early = run(inputs, catalog, tokenizers, prepared)
    assert isinstance(early, AssemblyResult) and early.memories_used
    assert early == run(inputs, catalog, tokenizers)


def test_a_stream_scored_at_another_instant_is_not_used(
    catalog: Catalog, tokenizers: Tokenizers
) -> None:
    """Same hits, another `now`: recency differs, so the pipeline scores them again."""
    hot, _ = hot_and_cold()
    hot = tuple(msgspec.structs.replace(h, created_at="2025-03-01T08:30:00Z") for h in hot)
    options = AssemblyOptions(recency_weight=0.5, relevance_weight=0.5)
    request = AssemblyRequest(
        agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o", options=options
    )
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    prepared.hits("hot", hot)
    later = AssemblyInputs(request, None, hot, (), BRANCHES, NONCE, NOW + 86400.0 * 30)
    assert run(later, catalog, tokenizers, prepared) == run(later, catalog, tokenizers)


def test_an_unknown_model_is_sized_by_the_requests_available_tokens(
    catalog: Catalog, tokenizers: Tokenizers
) -> None:
    request = AssemblyRequest(
        agent_id=AGENT, org_id=ORG, query="q", model="mystery-model", available_tokens=4321
    )
    prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
    assert prepared.cap.context_window == 4321


def test_prepared_counts_are_cached_even_when_every_body_was_cached_before(
    catalog: Catalog,
) -> None:
    """The escaped bodies are the format's (one cache), the counts the counter's: a new
    counter with nothing but new counts staged still caches them once the request fits."""
    hot, _ = hot_and_cold()
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    inputs = AssemblyInputs(request, None, hot, (), BRANCHES, NONCE, NOW)
    for _ in range(2):  # the first pass leaves every body in the format's cache
        tokenizers = Tokenizers(None, 65536)
        counter = tokenizers.counter("o200k_base", "o200k_base")
        prepared = EarlyAssembly(request, NONCE, NOW, catalog=catalog, tokenizers=tokenizers)
        prepared.hits("hot", hot)
        body = XML_TAGS.body_piece(hot[0].content)
        assert counter.peek(body) is None  # staged, not cached
        assemble_pure(inputs, catalog=catalog, tokenizers=tokenizers, early=prepared)
        assert counter.peek(body) is not None
