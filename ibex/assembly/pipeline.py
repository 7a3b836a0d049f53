"""The pure assembly: retrieval results in, a verified context block out.

No I/O and no clock other than stage timings: everything the pipeline needs
(directive, hits, branch outcomes, nonce, "now") comes in an `AssemblyInputs`.
Every candidate ends either included or excluded with a reason. `tokens_used`
is the sum of the final text's piece counts, which is the text's exact count
when every join is a pre-tokeniser split (checked on the final pieces, see
the format's `counts_add_up`, see ibex.assembly.output_format); otherwise the whole
text is re-counted. Every piece is priced and rendered by the one `Format` in
the `PipelineConfig`.

`assemble_pure` runs named stages, as in the README's diagram: count the fixed
sections (directive, tools, the history that fits, markup: the budget), select
(tenant filter, score, dedupe, caps), price (each candidate's exact cost),
pack, render within the ceiling, build the result. A `StageTimer` records each.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from ibex.assembly.budget import compute_budget, context_ceiling
from ibex.assembly.candidates import (
    Selection,
    merge,
    select,
    select_candidates,
    stream_candidates,
    memory_used,
)
from ibex.assembly.catalog import (
    Catalog,
    FamilyPolicy,
    ModelCapability,
    resolve_model,
)
from ibex.assembly.history import Counter, DeferredCache, dropped_tokens, fit_history, without_empty
from ibex.assembly.output_format import Format, SectionOrder, safety_emitted
from ibex.assembly.packer import DEFAULT_DP_CELL_CEILING, DEFAULT_MAX_CONSECUTIVE_SKIPS, pack
from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    DegradationLevel,
    Directive,
    Lap,
    MemoryHit,
    Message,
    PackResult,
    PackSummary,
    ScoredMemory,
    Stage,
    TokenBudget,
)
from ibex.assembly.xml_format import XML_TAGS
from ibex.errors import TooLargeError

if TYPE_CHECKING:
    from ibex.assembly.prepare import EarlyAssembly

__all__ = [
    "AssemblyInputs",
    "Counter",
    "CounterSource",
    "PipelineConfig",
    "StageTimer",
    "assemble_pure",
    "build_result",
    "count_fixed_sections",
    "degradation_level",
    "price",
    "pricer",
    "render_within_ceiling",
    "resolve_model",
    "select",
    "select_candidates",
]

# Hex, or new_nonce's fixed-width decimal: 64 random bytes are 155 decimal digits.
_NONCE = re.compile(r"[0-9a-f]{2,160}")


class CounterSource(Protocol):
    def counter(self, family: str, encoding: str | None) -> Counter: ...


DEFAULT_NONCE_BYTES = 16


class PipelineConfig(msgspec.Struct, frozen=True):
    """The pure core's knobs; the defaults are the packer's and the formatter's own."""

    dp_cell_ceiling: int = DEFAULT_DP_CELL_CEILING
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    nonce_bytes: int = DEFAULT_NONCE_BYTES
    #: How the block is written and priced: both come from this one object.
    format: Format = XML_TAGS
    #: The order sections are written in (ibex.assembly.output_format.SectionOrder): `seed`, the
    #: design's fixed order, or `cache`, what changes least first for a provider's cache.
    section_order: SectionOrder = "seed"


DEFAULT_CONFIG = PipelineConfig()


class AssemblyInputs(msgspec.Struct, frozen=True):
    """Everything one assembly depends on; identical inputs give identical output."""

    request: AssemblyRequest
    directive: Directive | None
    hot: tuple[MemoryHit, ...]
    cold: tuple[MemoryHit, ...]
    branches: tuple[BranchOutcome, ...]
    nonce: str
    now: float
    retrieval_ms: float = 0.0


def degradation_level(branches: Iterable[BranchOutcome]) -> DegradationLevel:
    """L0 full, L1 one memory source missing, L2 none; skipped by request is not missing."""
    missing = sum(
        1 for b in branches if b.source in ("hot", "cold") and b.status in ("timeout", "error")
    )
    return "L0" if missing == 0 else "L1" if missing == 1 else "L2"


def _ms(seconds: float) -> int:
    return round(seconds * 1000.0)


class StageTimer:
    """Seconds spent in each named stage: one clock read per stage boundary."""

    __slots__ = ("_last", "seconds", "start")

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.seconds: dict[Lap, float] = {}

    def lap(self, lap: Lap) -> None:
        """Close `lap`: the time since the previous lap (or the start) is its own."""
        now = time.perf_counter()
        self.seconds[lap] = now - self._last
        self._last = now

    def restart(self) -> StageTimer:
        """Start again from now (a timer handed in before the work began)."""
        self.start = self._last = time.perf_counter()
        self.seconds.clear()
        return self

    def spans(self) -> list[tuple[Lap, float, float]]:
        """Each stage's (name, start, end) in perf_counter seconds: laps are back to back."""
        out, t = [], self.start
        for stage, seconds in self.seconds.items():
            out.append((stage, t, t + seconds))
            t += seconds
        return out

    def stage_ms(self, stage: Stage) -> int:
        """Whole milliseconds of a reported stage: the sum of its laps."""
        return _ms(sum(self.seconds.get(lap, 0.0) for lap in stage.laps))

    def total(self) -> float:
        return self._last - self.start


class FixedSections(msgspec.Struct, frozen=True, gc=False):
    """What every answer carries whatever memories fit, counted once, and the budget."""

    directive_tokens: int  # the directive section alone
    safety_tokens: int  # the safety sentence, emitted with memories (or `safety_fixed`)
    history_tokens: int
    tool_tokens: int
    overhead_tokens: int  # the memories section's open and close, emitted only with memories
    budget: TokenBudget
    messages: tuple[Message, ...]  # the history that fits: the newest messages
    # The safety sentence is written with or without memories (the `cache` order with
    # a directive, tools or history; see ibex.assembly.output_format.safety_emitted).
    safety_fixed: bool = False


class Rendered(msgspec.Struct, frozen=True, gc=False):
    """The final text, its verified count, the memories it holds and those dropped to fit."""

    text: str
    tokens_used: int
    ordered: list[ScoredMemory]
    dropped: list[ScoredMemory]


def count_fixed_sections(
    request: AssemblyRequest,
    directive: Directive | None,
    nonce: str,
    cap: ModelCapability,
    family: FamilyPolicy,
    counter: Counter,
    fmt: Format,
    order: SectionOrder = "seed",
) -> FixedSections:
    """Stage 1: count directive, tools, the history that fits and markup; the budget left.

    The oldest history messages are left out until the rest fits (counted
    newest first, never past the ceiling; see ibex.assembly.history). New
    counts and escaped bodies are cached only once the request is known to
    fit, so a refused request leaves every cache as it was. In the `cache`
    order a kept history brings the safety sentence with it, so the history
    fits in what is left after it too.
    """
    deferred = DeferredCache(counter, fmt)
    # Pieces carrying the nonce: a decimal nonce costs what zeros of its width
    # cost, so those counts are cached once; any other nonce is new every
    # request and counted uncached (see DeferredCache.with_nonce).
    safety_tokens = deferred.with_nonce(fmt.safety_piece, nonce)
    directive_tokens = 0
    if directive is not None:
        body = deferred.body(directive.content)
        if body:
            directive_tokens = (
                deferred.with_nonce(functools.partial(fmt.directive_open, directive), nonce)
                + deferred.count(body)
                + deferred.count(fmt.directive_close)
            )
    tool_tokens = 0
    if request.tool_schemas:
        per_tool = deferred.count(fmt.tool_open) + deferred.count(fmt.tool_close)
        tool_tokens = deferred.with_nonce(fmt.tools_open, nonce) + deferred.count(fmt.tools_close)
        for schema in request.tool_schemas:
            body = deferred.body(schema)
            tool_tokens += per_tool + (deferred.count(body) if body else 0)
    overhead = deferred.with_nonce(fmt.memories_open, nonce) + deferred.count(fmt.memories_close)
    ceiling = context_ceiling(cap, family, request.available_tokens)
    # What the history fits beside: the directive and tools, and in the `cache` order
    # the safety sentence, which any kept history brings (`safety_emitted`).
    beside = directive_tokens + tool_tokens
    after = f"directive ({directive_tokens}) and tools ({tool_tokens})"
    if order == "cache":
        beside += safety_tokens
        after = (
            f"directive ({directive_tokens}), tools ({tool_tokens}) "
            f"and safety sentence ({safety_tokens})"
        )
    room = ceiling - beside
    messages = without_empty(request.recent_messages)
    fit = fit_history(counter, messages, nonce, room, deferred)
    safety_fixed = safety_emitted(
        order, memories=False, others=bool(directive_tokens or tool_tokens or fit.kept)
    )
    fixed_tokens = directive_tokens + tool_tokens + fit.tokens
    if safety_fixed:
        fixed_tokens += safety_tokens
    model = cap.model_id or request.model
    dropped = len(messages) - len(fit.kept)
    if dropped and not fit.kept:
        raise TooLargeError(
            "recent_messages",
            f"the newest message alone needs at least {fit.overflow} tokens; the model "
            f"{model!r} leaves {max(0, room)} of its {ceiling}-token context ceiling after the "
            f"{after}",
        )
    if dropped and request.options.reject_history_overflow:
        raise TooLargeError(
            "recent_messages",
            f"the history needs at least {fit.tokens + fit.overflow} tokens; the model "
            f"{model!r} leaves {max(0, room)} of its {ceiling}-token context ceiling after the "
            f"{after}, and reject_history_overflow is set",
        )
    if fixed_tokens > ceiling:
        raise TooLargeError(
            "recent_messages",
            f"directive, history and tools{' with the safety sentence' if safety_fixed else ''} "
            f"take {fixed_tokens} tokens, more than the {ceiling} the model {model!r} leaves "
            "for context",
        )
    deferred.commit()
    budget = compute_budget(
        cap,
        family,
        estimate_kind=counter.estimate_kind,
        available_tokens=request.available_tokens,
        directive_tokens=directive_tokens + safety_tokens,
        messages_tokens=fit.tokens,
        tool_schema_tokens=tool_tokens,
        formatter_overhead_tokens=overhead,
        messages_dropped=dropped,
        messages_dropped_tokens=(
            dropped_tokens(counter, messages[:dropped], ceiling, fmt) if dropped else 0
        ),
    )
    return FixedSections(
        directive_tokens=directive_tokens,
        safety_tokens=safety_tokens,
        history_tokens=fit.tokens,
        tool_tokens=tool_tokens,
        overhead_tokens=overhead,
        budget=budget,
        messages=fit.kept,
        safety_fixed=safety_fixed,
    )


def pricer(
    count: Callable[[str], int], body: Callable[[str], str], fmt: Format
) -> Callable[[ScoredMemory], ScoredMemory]:
    """A candidate with its token_estimate: the cost of its block's pieces.

    The opening piece is priced as its two parts (see ibex.assembly.output_format);
    memory blocks carry no nonce, so every count is cacheable by text. `count`
    and `body` (the escaped body piece) are the counter's and the format's, or a
    `DeferredCache`'s, which keeps new entries out of the caches until committed.
    """
    fixed = count(fmt.memory_open_prefix) + count(fmt.memory_close)
    suffix = fmt.memory_open_suffix
    replace = msgspec.structs.replace
    # The previous candidate's content and its body's count: a hit's scored variants
    # (one per schema) share their content object, so its body is escaped and
    # counted once; a `DeferredCache` counts what is not cached yet every time it is asked.
    last_content: str | None = None
    last_tokens = 0

    def priced(m: ScoredMemory) -> ScoredMemory:
        nonlocal last_content, last_tokens
        if m.content is not last_content:
            last_content, last_tokens = m.content, count(body(m.content))
        return replace(m, token_estimate=fixed + count(suffix(m)) + last_tokens)

    return priced


def price(candidates: list[ScoredMemory], counter: Counter, fmt: Format) -> list[ScoredMemory]:
    """Stage 3: each candidate's token_estimate (`pricer`, straight to the caches)."""
    priced = pricer(counter.count, fmt.body_piece, fmt)
    return [priced(m) for m in candidates]


def render_within_ceiling(
    request: AssemblyRequest,
    directive: Directive | None,
    nonce: str,
    fixed: FixedSections,
    packed: Sequence[ScoredMemory],
    counter: Counter,
    model: str,
    fmt: Format,
    order: SectionOrder = "seed",
) -> Rendered:
    """Stage 5: format, verify the count, and drop the lowest-value memory while over."""
    ceiling = fixed.budget.ceiling
    kept = list(packed)
    dropped: list[ScoredMemory] = []
    base = fixed.directive_tokens + fixed.history_tokens + fixed.tool_tokens
    with_memories = fixed.overhead_tokens
    if fixed.safety_fixed:
        base += fixed.safety_tokens
    else:
        with_memories += fixed.safety_tokens
    while True:
        ordered = fmt.memory_order(kept)
        pieces = fmt.render_pieces(
            directive=directive,
            messages=fixed.messages,
            memories=ordered,
            tool_schemas=request.tool_schemas,
            nonce=nonce,
            order=order,
        )
        text = "".join(pieces)
        if fmt.counts_add_up(pieces):
            # The text's count is the sum of its pieces' (for the default format:
            # every join is a pre-tokeniser split; exact families, an upper bound
            # for estimate_v1): no need to re-tokenise ~15k characters per request.
            tokens_used = base
            if ordered:
                tokens_used += with_memories + sum(m.token_estimate for m in ordered)
        else:
            tokens_used = _exact_len(counter, text)
        if tokens_used <= ceiling:
            return Rendered(text, tokens_used, ordered, dropped)
        if not kept:
            raise TooLargeError(
                "recent_messages",
                f"directive, history and tools take {tokens_used} tokens, more than the "
                f"{ceiling} the model {model!r} leaves for context",
            )
        # A merge at a join made the text longer than its pieces: drop the
        # lowest-value memory (last in score order) and format again.
        dropped.append(kept.pop())


def build_result(
    inputs: AssemblyInputs,
    fixed: FixedSections,
    packed: PackResult,
    rendered: Rendered,
    selection: Selection,
    timer: StageTimer,
) -> AssemblyResult:
    """Stage 6: the result and every fact it reports about itself."""
    request = inputs.request
    ordered = rendered.ordered
    excluded = selection.excluded
    excluded += (memory_used(m, "budget") for m in packed.excluded)
    excluded += (memory_used(m, "budget") for m in rendered.dropped)
    metrics = AssemblyMetrics(
        **{stage.field: timer.stage_ms(stage) for stage in Stage},
        directive_load_ms=_branch_ms(inputs.branches, "directive"),
        hot_memory_retrieval_ms=_branch_ms(inputs.branches, "hot"),
        cold_memory_retrieval_ms=_branch_ms(inputs.branches, "cold"),
        total_ms=_ms(timer.total() + inputs.retrieval_ms / 1000.0),
        candidates_evaluated=packed.candidates_evaluated,
    )
    directive = inputs.directive
    return AssemblyResult(
        assembled_context=rendered.text,
        tokens_used=rendered.tokens_used,
        memories_used=tuple(memory_used(m, "included") for m in ordered),
        excluded=tuple(excluded),
        directive_tokens=fixed.directive_tokens
        + (fixed.safety_tokens if ordered or fixed.safety_fixed else 0),
        history_tokens=fixed.history_tokens,
        memory_tokens=sum(m.token_estimate for m in ordered),
        tool_tokens=fixed.tool_tokens,
        formatter_tokens=fixed.overhead_tokens if ordered else 0,
        score_schema=selection.score_schema,
        degradation_level=degradation_level(inputs.branches),
        branches=inputs.branches,
        budget=fixed.budget,
        pack=_summary(packed, rendered.dropped, ordered, selection.tenant_filtered),
        metrics=metrics,
        request_id=request.request_id,
        trace_id=request.trace_id,
        span_id=request.span_id,
        directive_version_id=(directive.version_id or "") if directive else "",
    )


def assemble_pure(
    inputs: AssemblyInputs,
    *,
    catalog: Catalog,
    tokenizers: CounterSource,
    config: PipelineConfig = DEFAULT_CONFIG,
    timer: StageTimer | None = None,
    early: EarlyAssembly | None = None,
) -> AssemblyResult:
    """Count the fixed sections, select, price, pack, render within the ceiling, build.

    A `timer` handed in keeps the stage laps for the caller (a traced call's stage spans).
    `early` holds stages done while retrieval waited (ibex.assembly.prepare); a part
    is used only when it was made from these very inputs, so the answer is the same
    without it. The laps then time only the work left.
    """
    timer = StageTimer() if timer is None else timer.restart()
    request = inputs.request
    nonce = inputs.nonce
    if not _NONCE.fullmatch(nonce):
        raise ValueError("nonce must be 2 to 160 lower-case hex or decimal digits")
    cap = resolve_model(catalog, request.model, request.available_tokens)
    family = catalog.family(cap.tokenizer_family)
    counter = tokenizers.counter(family.name, family.encoding)
    fmt = config.format
    order = config.section_order
    if early is not None and not early.fits(request, nonce, counter, fmt, order):
        early = None
    fixed = early.fixed_for(inputs.directive) if early is not None else None
    if fixed is None:
        fixed = count_fixed_sections(
            request, inputs.directive, nonce, cap, family, counter, fmt, order
        )
    timer.lap("count")
    if early is None:
        selection = select(request, inputs.hot, inputs.cold, inputs.now)
    else:
        early.commit()  # the request fits: its memory prices may be cached
        opts, now = request.options, inputs.now
        selection = merge(
            request,
            early.stream_for("hot", inputs.hot, now)
            or stream_candidates(request, inputs.hot, now, opts.skip_hot_memories),
            early.stream_for("cold", inputs.cold, now)
            or stream_candidates(request, inputs.cold, now, opts.skip_cold_memories),
        )
    timer.lap("select")
    candidates = (
        selection.candidates if selection.priced else price(selection.candidates, counter, fmt)
    )
    timer.lap("price")
    packed = pack(
        candidates,
        fixed.budget.usable_budget,
        dp_cell_ceiling=config.dp_cell_ceiling,
        max_consecutive_skips=config.max_consecutive_skips,
    )
    timer.lap("pack")
    rendered = render_within_ceiling(
        request,
        inputs.directive,
        nonce,
        fixed,
        packed.packed,
        counter,
        cap.model_id or request.model,
        fmt,
        order,
    )
    timer.lap("render")
    return build_result(inputs, fixed, packed, rendered, selection, timer)


def _exact_len(counter: Counter, text: str) -> int:
    """Count a text that carries the nonce (unique per request) without caching it."""
    return counter.count_uncached(text)


def _branch_ms(branches: Sequence[BranchOutcome], source: str) -> int:
    for b in branches:
        if b.source == source:
            return round(b.latency_ms)
    return 0


def _summary(
    result: PackResult, dropped: list[ScoredMemory], kept: list[ScoredMemory], tenant_filtered: int
) -> PackSummary:
    return PackSummary(
        path=result.path,
        candidates_evaluated=result.candidates_evaluated,
        excluded_for_budget=result.excluded_for_budget + len(dropped),
        budget_reached=result.budget_reached or bool(dropped),
        total_score=float(sum(m.composite_score for m in kept)),
        tenant_filtered=tenant_filtered,
    )
