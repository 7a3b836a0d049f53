"""The pure pipeline's paths with a stub counter: every number is arithmetic.

The stub counts one token per character, so each piece's count is its length,
the budget formula can be checked term by term, and `tokens_used` must equal
the length of the text. A second stub makes the whole text cost more than its
pieces, to reach the "drop the lowest-value memory and format again" loop
that a merge at a join would trigger with a real tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from ibex.assembly import formatter as fmt
from ibex.assembly import pipeline
from ibex.assembly.catalog import Catalog, FamilyPolicy, ModelCapability
from ibex.assembly.pipeline import (
    DEFAULT_CONFIG,
    DEFAULT_NONCE_BYTES,
    AssemblyInputs,
    PipelineConfig,
    assemble_pure,
    degradation_level,
)
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    BranchStatus,
    Directive,
    MemoryHit,
    Message,
    ScoredMemory,
)
from ibex.testing.samples import AGENT, ORG

NONCE = "1234567890"
NOW = 1_760_000_000.0
MODEL = "stub-model"
OK3 = (
    BranchOutcome("directive", "success", 1.4),
    BranchOutcome("hot", "success", 2.6),
    BranchOutcome("cold", "success", 7.5),
)


class CharCounter:
    """One token per character, cached or not alike."""

    estimate_kind = "chars"
    max_token_bytes = 4  # one character, up to 4 UTF-8 bytes

    def __init__(self, whole_text_extra: int = 0) -> None:
        self.extra = whole_text_extra
        self.uncached: list[str] = []

    def count(self, text: str) -> int:
        return len(text)

    def count_uncached(self, text: str) -> int:
        self.uncached.append(text)
        # A whole block costs `extra` more per memory element than its pieces,
        # as if every memory's joins merged into longer tokens.
        return len(text) + self.extra * text.count(fmt.MEMORY_CLOSE)

    def peek(self, text: str) -> int | None:
        return None  # nothing cached: every count goes through count_uncached

    def remember(self, items: Sequence[tuple[str, int]]) -> None:
        pass

    def additive_cut(self, text: str) -> int:
        return len(text)  # a character count is additive at every cut


class Source:
    def __init__(self, counter: CharCounter) -> None:
        self.c = counter
        self.asked: list[tuple[str, str | None]] = []

    def counter(self, family: str, encoding: str | None) -> CharCounter:
        self.asked.append((family, encoding))
        return self.c


def catalog(window: int = 100_000, max_out: int = 8_000, safety: float = 0.0) -> Catalog:
    # The stub counter is exact (a token per character), so the family names an exact
    # encoding: the catalog refuses estimate families below the measured undercount.
    return Catalog(
        {"unknown": FamilyPolicy(0.05), "chars": FamilyPolicy(safety, encoding="cl100k_base")},
        {MODEL: ModelCapability("stub", window, max_out, "chars")},
    )


def hit(
    mid: str,
    content: str = "note",
    *,
    similarity: float = 0.5,
    confidence: float = 0.5,
    category: str = "factual",
    branch: str = "cold",
    rank: int = 1,
    created_at: str | None = None,
) -> MemoryHit:
    return MemoryHit(
        memory_id=mid,
        org_id=ORG,
        agent_id=AGENT,
        content=content,
        category=category,
        confidence=confidence,
        similarity=similarity,
        rank=rank,
        branch=branch,  # type: ignore[arg-type]
        created_at=created_at,
    )


def request(
    *,
    available_tokens: int = 0,
    messages: Sequence[Message] = (),
    tools: Sequence[str] = (),
    options: AssemblyOptions | None = None,
    model: str = MODEL,
) -> AssemblyRequest:
    return AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="q",
        model=model,
        available_tokens=available_tokens,
        recent_messages=tuple(messages),
        tool_schemas=tuple(tools),
        options=options or AssemblyOptions(),
        request_id="req-1",
        trace_id="trace-1",
        span_id="span-1",
    )


def run(
    req: AssemblyRequest,
    *,
    hot: Sequence[MemoryHit] = (),
    cold: Sequence[MemoryHit] = (),
    directive: Directive | None = None,
    cat: Catalog | None = None,
    counter: CharCounter | None = None,
    config: PipelineConfig = DEFAULT_CONFIG,
    branches: tuple[BranchOutcome, ...] = OK3,
    nonce: str = NONCE,
    retrieval_ms: float = 0.0,
) -> AssemblyResult:
    inputs = AssemblyInputs(
        request=req,
        directive=directive,
        hot=tuple(hot),
        cold=tuple(cold),
        branches=branches,
        nonce=nonce,
        now=NOW,
        retrieval_ms=retrieval_ms,
    )
    return assemble_pure(
        inputs,
        catalog=cat or catalog(),
        tokenizers=Source(counter or CharCounter()),
        config=config,
    )


def block_len(m: MemoryHit, nonce: str = NONCE) -> int:
    """Characters of one memory's formatted element (its token_estimate here)."""
    sm = ScoredMemory(m.memory_id, m.category, m.content, 0.0, 0.0, 0.0, 1)
    return len("".join(fmt.memory_block(sm)))


def memory_overhead(nonce: str = NONCE) -> int:
    """Safety sentence and the memories wrapper: paid once when any memory is emitted."""
    return len(fmt.safety_piece(nonce)) + len(fmt.memories_open(nonce)) + len(fmt.MEMORIES_CLOSE)


def ids(result: AssemblyResult) -> list[str]:
    return [m.memory_id for m in result.memories_used]


def reasons(result: AssemblyResult) -> dict[str, str]:
    return {m.memory_id: m.exclusion for m in result.excluded}


# --------------------------------------------------------------------------- constants


def test_defaults() -> None:
    assert DEFAULT_NONCE_BYTES == 16
    assert (
        PipelineConfig(dp_cell_ceiling=70 * 6251, max_consecutive_skips=5, nonce_bytes=16)
        == DEFAULT_CONFIG
    )


# --------------------------------------------------------------------------- budget and counts


def test_counts_add_up_to_the_text_and_every_term_is_reported() -> None:
    directive = Directive("Be brief.", "system_append", "00000000-0000-4000-8000-00000000d1d1")
    messages = [Message("user", "hello"), Message("assistant", "hi there")]
    tools = ['{"name": "t"}']
    cold = [hit("m1", "alpha", similarity=0.9), hit("m2", "beta", similarity=0.3)]
    r = run(request(messages=messages, tools=tools), cold=cold, directive=directive)
    text = r.assembled_context
    assert r.tokens_used == len(text)
    directive_len = len("".join(fmt.directive_section(directive, NONCE)))
    history_len = len("".join(fmt.history_section(messages, NONCE)))
    tools_len = len("".join(fmt.tools_section(tools, NONCE)))
    safety_len = len(fmt.safety_piece(NONCE))
    wrapper_len = len(fmt.memories_open(NONCE)) + len(fmt.MEMORIES_CLOSE)
    mem_len = block_len(cold[0]) + block_len(cold[1])
    assert r.directive_tokens == directive_len + safety_len
    assert r.history_tokens == history_len
    assert r.tool_tokens == tools_len
    assert r.formatter_tokens == wrapper_len
    assert r.memory_tokens == mem_len
    assert r.tokens_used == directive_len + safety_len + history_len + tools_len + (
        wrapper_len + mem_len
    )
    b = r.budget
    assert (b.context_window, b.response_reserve, b.safety_buffer) == (100_000, 4_096, 0)
    assert b.directive_tokens == directive_len + safety_len  # the safety sentence is reserved
    assert b.messages_tokens == history_len
    assert b.tool_schema_tokens == tools_len
    assert b.formatter_overhead_tokens == wrapper_len
    assert b.usable_budget == 100_000 - 4_096 - (
        directive_len + safety_len + history_len + tools_len + wrapper_len
    )
    assert b.estimate_kind == "chars"
    assert b.tokenizer_family == "chars"
    assert not b.constrained
    assert [m.token_estimate for m in r.memories_used] == [block_len(c) for c in cold]
    assert r.directive_version_id == "00000000-0000-4000-8000-00000000d1d1"
    assert (r.request_id, r.trace_id, r.span_id) == ("req-1", "trace-1", "span-1")
    assert r.score_schema == "interim_v1"


def test_without_memories_no_safety_sentence_or_wrapper_is_counted() -> None:
    directive = Directive("Be brief.")
    r = run(request(messages=[Message("user", "hello")]), directive=directive)
    assert r.memories_used == ()
    assert r.tokens_used == len(r.assembled_context)
    assert r.directive_tokens == len("".join(fmt.directive_section(directive, NONCE)))
    assert r.formatter_tokens == 0
    assert r.memory_tokens == 0
    assert fmt.safety_piece(NONCE) not in r.assembled_context
    assert r.directive_version_id == ""
    # The budget still reserved the safety sentence and wrapper, in case memories came.
    assert r.budget.directive_tokens == r.directive_tokens + len(fmt.safety_piece(NONCE))
    assert r.budget.formatter_overhead_tokens == memory_overhead() - len(fmt.safety_piece(NONCE))


def test_directive_without_version_reports_empty_version() -> None:
    r = run(request(), directive=Directive("x", version_id=None))
    assert r.directive_version_id == ""
    assert run(request(), directive=None).directive_version_id == ""


def test_the_counter_is_asked_for_the_models_family() -> None:
    counter = CharCounter()
    src = Source(counter)
    inputs = AssemblyInputs(request(), None, (), (), OK3, NONCE, NOW)
    assemble_pure(inputs, catalog=catalog(), tokenizers=src)
    assert src.asked == [("chars", "cl100k_base")]


def test_nonce_bearing_pieces_are_counted_by_their_zeros_shaped_twin() -> None:
    """A decimal nonce costs what zeros of its width cost, so the pieces that carry it
    are counted once in that shape (and then cached), never with the nonce itself."""
    counter = CharCounter()
    run(request(), cold=[hit("m1")], counter=counter)
    twin = "0" * len(NONCE)
    assert fmt.safety_piece(twin) in counter.uncached
    assert fmt.memories_open(twin) in counter.uncached
    assert not any(NONCE in text for text in counter.uncached)


def test_available_tokens_cap_the_window_in_the_pipeline() -> None:
    r = run(request(available_tokens=5_000))
    assert r.budget.context_window == 5_000
    assert r.budget.response_reserve == 750


def test_unknown_model_uses_available_tokens_and_the_unknown_family() -> None:
    cat = catalog()
    r = run(request(model="not-in-catalog", available_tokens=6_000), cat=cat)
    assert r.budget.context_window == 6_000
    assert r.budget.tokenizer_family == "unknown"
    assert r.budget.safety_buffer == 300  # the unknown family's 5 %
    assert r.budget.response_reserve == 900


# --------------------------------------------------------------------------- pack path


def _many(n: int, size: int = 40) -> list[MemoryHit]:
    return [
        hit(f"m{i:02d}", "x" * size, similarity=(i % 10) / 10, confidence=0.5) for i in range(n)
    ]


def test_pack_path_dp_by_default_and_its_score() -> None:
    cold = _many(12)
    per = block_len(cold[0])
    window = 500 + 0 + memory_overhead() + 5 * per + 3  # five fit, with 3 spare
    r = run(request(), cold=cold, cat=catalog(window=window, max_out=500))
    assert r.budget.usable_budget == 5 * per + 3
    assert r.pack.path == "dp"
    assert len(r.memories_used) == 5
    assert r.pack.total_score == pytest.approx(sum(m.composite_score for m in r.memories_used))
    # The five best: similarity 0.9 down to 0.5 (confidence 0.5 each).
    assert r.pack.total_score == pytest.approx(
        sum(0.85 * s + 0.15 * 0.5 for s in (0.9, 0.8, 0.7, 0.6, 0.5))
    )
    assert r.pack.candidates_evaluated == 12
    assert r.metrics.candidates_evaluated == 12
    assert r.pack.excluded_for_budget == 7
    assert r.pack.budget_reached
    assert sorted(reasons(r).values()) == ["budget"] * 7


def test_a_cell_ceiling_of_zero_means_greedy() -> None:
    cold = _many(12)
    r = run(request(), cold=cold, config=PipelineConfig(dp_cell_ceiling=0))
    assert r.pack.path == "greedy"
    assert len(r.memories_used) == 12  # everything fits the default window


def test_the_cell_ceiling_decides_dp_or_greedy() -> None:
    cold = _many(3)
    r = run(request(), cold=cold)
    usable = r.budget.usable_budget
    cells = 3 * (usable // 16 + 1)
    at = run(request(), cold=cold, config=PipelineConfig(dp_cell_ceiling=cells))
    assert at.pack.path == "dp"
    below = run(request(), cold=cold, config=PipelineConfig(dp_cell_ceiling=cells - 1))
    assert below.pack.path == "greedy"


def test_greedy_skip_limit_comes_from_the_config() -> None:
    # Score order: a big one that fits, two that then do not, a small one that would.
    cold = [
        hit("a", "x" * 300, similarity=0.9),
        hit("b", "x" * 300, similarity=0.8),
        hit("c", "x" * 300, similarity=0.7),
        hit("d", "x", similarity=0.1),
    ]
    big = block_len(cold[0])
    small = block_len(cold[3])
    window = 500 + memory_overhead() + big + small + 10  # a + d fit, nothing else
    cat = catalog(window=window, max_out=500)
    two = run(request(), cold=cold, cat=cat, config=PipelineConfig(0, max_consecutive_skips=2))
    assert ids(two) == ["a"]
    three = run(request(), cold=cold, cat=cat, config=PipelineConfig(0, max_consecutive_skips=3))
    assert ids(three) == ["a", "d"]


def test_an_empty_candidate_set_is_not_a_truncation() -> None:
    r = run(request())
    assert r.pack.budget_reached is False
    assert r.pack.excluded_for_budget == 0
    assert r.pack.total_score == 0.0


# --------------------------------------------------------------------------- drop and re-format


class RecountingXml(fmt.XmlTagFormat):
    """The default pieces with a join rule that never vouches for the sum."""

    def counts_add_up(self, pieces: Sequence[str]) -> bool:
        return False


RECOUNT = PipelineConfig(format=RecountingXml())


def test_a_bad_join_drops_the_lowest_value_memory_and_formats_again() -> None:
    # Three memories fit by their pieces with 30 tokens spare; the whole text
    # costs 40 more per memory element. Three cost 120 over the pieces (too
    # many), two cost 80, within the spare plus the dropped memory's own size.
    cold = [
        hit("hi", "x" * 90, similarity=0.9, category="episodic"),
        hit("mid", "x" * 90, similarity=0.6, category="factual"),
        hit("lo", "x" * 90, similarity=0.3, category="procedural"),  # emitted first
    ]
    per = block_len(cold[0])
    window = 500 + memory_overhead() + 3 * per + 30
    cat = catalog(window=window, max_out=500)
    r = run(request(), cold=cold, cat=cat, counter=CharCounter(whole_text_extra=40), config=RECOUNT)
    assert r.budget.usable_budget == 3 * per + 30
    assert ids(r) == ["mid", "hi"]  # category order: factual before episodic
    assert reasons(r) == {"lo": "budget"}
    text = r.assembled_context
    assert r.tokens_used == len(text) + 2 * 40  # the whole text was re-counted
    assert r.tokens_used <= r.budget.ceiling
    assert r.pack.excluded_for_budget == 1
    assert r.pack.budget_reached is True
    assert r.pack.total_score == pytest.approx((0.85 * 0.9 + 0.075) + (0.85 * 0.6 + 0.075))
    assert r.memory_tokens == 2 * per
    assert 'id="lo"' not in text


def test_the_loop_can_drop_every_memory() -> None:
    cold = [hit("a", similarity=0.9), hit("b", similarity=0.5)]
    window = 500 + memory_overhead() + 2 * block_len(cold[0])
    cat = catalog(window=window, max_out=500)
    r = run(
        request(), cold=cold, cat=cat, counter=CharCounter(whole_text_extra=10_000), config=RECOUNT
    )
    assert r.memories_used == ()
    assert reasons(r) == {"a": "budget", "b": "budget"}
    assert r.assembled_context == ""
    assert r.tokens_used == 0
    assert r.pack.excluded_for_budget == 2
    assert r.pack.budget_reached
    assert r.pack.total_score == 0.0
    assert r.formatter_tokens == 0


def test_clean_joins_are_summed_not_recounted() -> None:
    counter = CharCounter(whole_text_extra=1_000)
    cold = [hit("a", similarity=0.9), hit("b", similarity=0.5)]
    r = run(request(), cold=cold, counter=counter)
    assert ids(r) == ["a", "b"]
    assert r.tokens_used == len(r.assembled_context)  # the extra never applied
    assert r.assembled_context not in counter.uncached


def test_recounting_without_memories_uses_the_whole_text() -> None:
    counter = CharCounter()
    r = run(request(messages=[Message("user", "hello")]), counter=counter, config=RECOUNT)
    assert r.tokens_used == len(r.assembled_context)
    assert r.assembled_context in counter.uncached


# --------------------------------------------------------------------------- dedupe ties


def test_dedupe_tie_keeps_the_hot_copy() -> None:
    # Equal scores: the hot copy (read first) stays; only a strictly better one replaces it.
    hot = [hit("a", "hot copy", similarity=0.6, branch="hot", rank=1)]
    cold = [hit("a", "cold copy", similarity=0.6, branch="cold", rank=2)]
    r = run(request(), hot=hot, cold=cold)
    assert ids(r) == ["a"]
    assert r.memories_used[0].rank == 1
    assert "hot copy" in r.assembled_context
    assert "cold copy" not in r.assembled_context
    assert r.excluded == ()


def test_dedupe_the_better_score_wins_from_either_branch() -> None:
    hot = [hit("a", "hot copy", similarity=0.5, branch="hot")]
    cold = [hit("a", "cold copy", similarity=0.7, branch="cold")]
    r = run(request(), hot=hot, cold=cold)
    assert "cold copy" in r.assembled_context and "hot copy" not in r.assembled_context
    r = run(request(), hot=[hit("a", "hot copy", similarity=0.7, branch="hot")], cold=cold[:0])
    assert "hot copy" in r.assembled_context
    hot = [hit("a", "hot copy", similarity=0.8, branch="hot")]
    r = run(request(), hot=hot, cold=cold)
    assert "hot copy" in r.assembled_context and "cold copy" not in r.assembled_context


def test_dedupe_with_weights_uses_the_weighted_score() -> None:
    # Same similarity; with a recency weight the fresher copy scores higher.
    fresh = "2025-10-09T00:00:00+00:00"  # a few days before NOW
    stale = "2020-01-01T00:00:00+00:00"
    opts = AssemblyOptions(relevance_weight=1.0, recency_weight=1.0)
    hot = [hit("a", "stale hot", similarity=0.5, branch="hot", created_at=stale)]
    cold = [hit("a", "fresh cold", similarity=0.5, branch="cold", created_at=fresh)]
    r = run(request(options=opts), hot=hot, cold=cold)
    assert "fresh cold" in r.assembled_context
    assert r.score_schema == "weighted_v1"


# --------------------------------------------------------------------------- metrics


def test_branch_latencies_and_total_include_retrieval() -> None:
    r = run(request(), retrieval_ms=5_000.0)
    assert r.metrics.directive_load_ms == 1
    assert r.metrics.hot_memory_retrieval_ms == 3
    assert r.metrics.cold_memory_retrieval_ms == 8
    assert 5_000 <= r.metrics.total_ms < 5_000 + 600_000
    assert r.branches == OK3


def test_missing_branches_report_zero_latency() -> None:
    r = run(request(), branches=(BranchOutcome("cold", "timeout", 45.0),))
    assert (r.metrics.directive_load_ms, r.metrics.hot_memory_retrieval_ms) == (0, 0)
    assert r.metrics.cold_memory_retrieval_ms == 45
    assert r.degradation_level == "L1"
    assert r.metrics.total_ms < 600_000


@pytest.mark.parametrize(
    ("statuses", "level"),
    [
        ({"directive": "error", "hot": "success", "cold": "success"}, "L0"),
        ({"directive": "timeout", "hot": "skipped", "cold": "skipped"}, "L0"),
        ({"directive": "success", "hot": "timeout", "cold": "success"}, "L1"),
        ({"directive": "success", "hot": "success", "cold": "error"}, "L1"),
        ({"directive": "error", "hot": "error", "cold": "timeout"}, "L2"),
        ({"directive": "success", "hot": "skipped", "cold": "error"}, "L1"),
    ],
)
def test_degradation_counts_missing_memory_sources_only(
    statuses: dict[str, BranchStatus], level: str
) -> None:
    branches = [BranchOutcome(src, st) for src, st in statuses.items()]  # type: ignore[arg-type]
    assert degradation_level(branches) == level


# --------------------------------------------------------------------------- nonce


@pytest.mark.parametrize(
    ("nonce", "ok"),
    [
        ("ab", True),
        ("0" * 160, True),
        ("0123456789abcdef", True),
        ("a", False),
        ("", False),
        ("0" * 161, False),
        ("ABCD", False),
        ("12 34", False),
        ("12g4", False),
    ],
)
def test_nonce_shape(nonce: str, ok: bool) -> None:
    if ok:
        r = run(request(), cold=[hit("m")], nonce=nonce)
        assert f'<memories nonce="{nonce}">' in r.assembled_context
    else:
        with pytest.raises(
            ValueError, match=r"^nonce must be 2 to 160 lower-case hex or decimal digits$"
        ):
            run(request(), nonce=nonce)


def test_identical_inputs_give_identical_results_but_timings() -> None:
    cold = _many(8)
    a = run(request(), cold=cold)
    b = run(request(), cold=cold)
    assert msgspec.structs.replace(a, metrics=b.metrics) == b


def test_a_block_that_exactly_fills_the_ceiling_keeps_every_memory() -> None:
    cold = [hit("a", similarity=0.9), hit("b", similarity=0.5)]
    window = 500 + memory_overhead() + 2 * block_len(cold[0])
    r = run(request(), cold=cold, cat=catalog(window=window, max_out=500))
    assert r.budget.usable_budget == 2 * block_len(cold[0])
    assert ids(r) == ["a", "b"]
    assert r.tokens_used == r.budget.ceiling == len(r.assembled_context)
    assert r.pack.budget_reached is False


class _Clock:
    """A stand-in for the time module whose perf_counter advances one second per call."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_stage_timings_are_whole_milliseconds_and_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "time", _Clock())
    r = run(request(messages=[Message("user", "hi")]), cold=[hit("a")], retrieval_ms=250.0)
    m = r.metrics
    stages = (m.budget_calculation_ms, m.ranking_ms, m.packing_ms, m.formatting_ms)
    for ms in stages:
        assert type(ms) is int
        assert ms >= 1_000 and ms % 1_000 == 0  # one fake second per clock read
    assert m.total_ms == sum(stages) + 250
    assert type(m.total_ms) is int


def test_unknown_model_with_one_available_token() -> None:
    got = pipeline.resolve_model(catalog(), "not-in-catalog", 1)
    assert (got.context_window, got.tokenizer_family) == (1, "unknown")
