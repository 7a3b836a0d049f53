"""The pure assembly: retrieval results in, a verified context block out.

No I/O and no clock other than stage timings: everything the pipeline needs
(directive, hits, branch outcomes, nonce, "now") comes in an `AssemblyInputs`.
Every candidate ends either included or excluded with a reason. `tokens_used`
is the sum of the final text's piece counts, which is the text's exact count
when every join is a pre-tokeniser split (checked on the final pieces, see
`formatter.joins_split_cleanly`); otherwise the whole text is re-counted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from ibex.assembly import formatter as fmt
from ibex.assembly.budget import compute_budget
from ibex.assembly.candidates import select_candidates, used
from ibex.assembly.catalog import Catalog, FamilyPolicy, ModelCapability
from ibex.assembly.packer import DEFAULT_DP_CELL_CEILING, DEFAULT_MAX_CONSECUTIVE_SKIPS, pack
from ibex.assembly.scoring import score_schema
from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    DegradationLevel,
    Directive,
    MemoryHit,
    PackResult,
    PackSummary,
    ScoredMemory,
)
from ibex.errors import InputError, TooLargeError

UNKNOWN_MODEL_MAX_OUTPUT = 4096
# Hex, or new_nonce's fixed-width decimal: 64 random bytes are 155 decimal digits.
_NONCE = re.compile(r"[0-9a-f]{2,160}")


class Counter(Protocol):
    """What the pipeline needs from a token counter (see ibex.assembly.tokens)."""

    estimate_kind: str

    def count(self, text: str) -> int: ...

    def count_uncached(self, text: str) -> int: ...


class CounterSource(Protocol):
    def counter(self, family: str, encoding: str | None) -> Counter: ...


DEFAULT_NONCE_BYTES = 16


class PipelineConfig(msgspec.Struct, frozen=True):
    """The pure core's knobs; the defaults are the packer's and the formatter's own."""

    dp_cell_ceiling: int = DEFAULT_DP_CELL_CEILING
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    nonce_bytes: int = DEFAULT_NONCE_BYTES


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


def resolve_model(catalog: Catalog, model: str, available_tokens: int) -> ModelCapability:
    """Catalog entry, or an `unknown`-family stand-in sized by available_tokens."""
    cap = catalog.resolve(model)
    if cap is not None:
        return cap
    if available_tokens > 0:
        return ModelCapability(
            provider="unknown",
            context_window=available_tokens,
            max_output_tokens=UNKNOWN_MODEL_MAX_OUTPUT,
            tokenizer_family="unknown",
            model_id=model,
        )
    raise InputError("model", f"unknown model {model[:64]!r} and available_tokens not set")


def degradation_level(branches: Iterable[BranchOutcome]) -> DegradationLevel:
    """L0 full, L1 one memory source missing, L2 none; skipped by request is not missing."""
    missing = sum(
        1 for b in branches if b.source in ("hot", "cold") and b.status in ("timeout", "error")
    )
    return "L0" if missing == 0 else "L1" if missing == 1 else "L2"


def _count_pieces(counter: Counter, pieces: Iterable[str]) -> int:
    return sum(counter.count(p) for p in pieces if p)


def _ms(seconds: float) -> int:
    return round(seconds * 1000.0)


def assemble_pure(
    inputs: AssemblyInputs,
    *,
    catalog: Catalog,
    tokenizers: CounterSource,
    config: PipelineConfig = DEFAULT_CONFIG,
) -> AssemblyResult:
    """Budget, score, pack, format and verify one assembly."""
    t0 = time.perf_counter()
    request = inputs.request
    nonce = inputs.nonce
    if not _NONCE.fullmatch(nonce):
        raise ValueError("nonce must be 2 to 160 lower-case hex or decimal digits")
    cap = resolve_model(catalog, request.model, request.available_tokens)
    family: FamilyPolicy = catalog.family(cap.tokenizer_family)
    counter = tokenizers.counter(family.name, family.encoding)

    directive = inputs.directive
    directive_pieces = fmt.directive_section(directive)
    # Pieces carrying the nonce are new every request: count them without the
    # cache, or each request would push ~30 never-reused entries into it.
    safety_tokens = _exact_len(counter, fmt.safety_piece(nonce))
    directive_only = _count_pieces(counter, directive_pieces)
    directive_tokens = directive_only + safety_tokens
    history_tokens = _count_pieces(counter, fmt.history_section(request.recent_messages))
    tool_tokens = _count_pieces(counter, fmt.tools_section(request.tool_schemas))
    overhead = _exact_len(counter, fmt.memories_open(nonce)) + counter.count(fmt.MEMORIES_CLOSE)
    budget = compute_budget(
        cap,
        family,
        estimate_kind=counter.estimate_kind,
        available_tokens=request.available_tokens,
        directive_tokens=directive_tokens,
        messages_tokens=history_tokens,
        tool_schema_tokens=tool_tokens,
        formatter_overhead_tokens=overhead,
    )
    t1 = time.perf_counter()

    candidates, excluded = select_candidates(request, inputs.hot, inputs.cold, inputs.now)
    # memory_open = prefix + nonce + suffix, split at pre-tokeniser boundaries
    # (see fmt.memory_open_suffix): the nonce is counted once, the rest cached.
    fixed_tokens = (
        counter.count(fmt.MEMORY_OPEN_PREFIX)
        + _exact_len(counter, nonce)
        + counter.count(fmt.MEMORY_CLOSE)
    )
    candidates = [
        msgspec.structs.replace(
            m,
            token_estimate=fixed_tokens
            + counter.count(fmt.memory_open_suffix(m))
            + counter.count(fmt.body_piece(m.content)),
        )
        for m in candidates
    ]
    t2 = time.perf_counter()

    result = pack(
        candidates,
        budget.usable_budget,
        dp_cell_ceiling=config.dp_cell_ceiling,
        max_consecutive_skips=config.max_consecutive_skips,
    )
    t3 = time.perf_counter()

    packed = list(result.packed)
    dropped: list[ScoredMemory] = []
    while True:
        ordered = fmt.memory_order(packed)
        pieces = fmt.render_pieces(
            directive=directive,
            messages=request.recent_messages,
            memories=ordered,
            tool_schemas=request.tool_schemas,
            nonce=nonce,
        )
        text = "".join(pieces)
        if fmt.joins_split_cleanly(pieces):
            # Every join is a pre-tokeniser split, so the text's count is the sum
            # of its pieces' (exact families; an upper bound for estimate_v1):
            # no need to re-tokenise ~15k characters per request.
            tokens_used = directive_only + history_tokens + tool_tokens
            if ordered:
                tokens_used += safety_tokens + overhead + sum(m.token_estimate for m in ordered)
        else:
            tokens_used = _exact_len(counter, text)
        if tokens_used <= budget.ceiling:
            break
        if not packed:
            raise TooLargeError(
                "recent_messages",
                f"directive, history and tools take {tokens_used} tokens, more than the "
                f"{budget.ceiling} the model {cap.model_id or request.model!r} leaves for context",
            )
        # A merge at a join made the text longer than its pieces: drop the
        # lowest-value memory (last in score order) and format again.
        dropped.append(packed.pop())
    t4 = time.perf_counter()

    memory_tokens = sum(m.token_estimate for m in ordered)
    included = tuple(used(m, "included") for m in ordered)
    excluded += (used(m, "budget") for m in result.excluded)
    excluded += (used(m, "budget") for m in dropped)
    pack_summary = _summary(result, dropped, ordered)
    metrics = AssemblyMetrics(
        budget_calculation_ms=_ms(t1 - t0),
        directive_load_ms=_branch_ms(inputs.branches, "directive"),
        hot_memory_retrieval_ms=_branch_ms(inputs.branches, "hot"),
        cold_memory_retrieval_ms=_branch_ms(inputs.branches, "cold"),
        ranking_ms=_ms(t2 - t1),
        packing_ms=_ms(t3 - t2),
        formatting_ms=_ms(t4 - t3),
        total_ms=_ms(t4 - t0 + inputs.retrieval_ms / 1000.0),
        candidates_evaluated=result.candidates_evaluated,
    )
    emitted_directive = directive_only + (safety_tokens if ordered else 0)
    return AssemblyResult(
        assembled_context=text,
        tokens_used=tokens_used,
        memories_used=included,
        excluded=tuple(excluded),
        directive_tokens=emitted_directive,
        history_tokens=history_tokens,
        memory_tokens=memory_tokens,
        tool_tokens=tool_tokens,
        formatter_tokens=overhead if ordered else 0,
        score_schema=score_schema(request.options),
        degradation_level=degradation_level(inputs.branches),
        branches=inputs.branches,
        budget=budget,
        pack=pack_summary,
        metrics=metrics,
        request_id=request.request_id,
        trace_id=request.trace_id,
        span_id=request.span_id,
        directive_version_id=(directive.version_id or "") if directive else "",
    )


def _exact_len(counter: Counter, text: str) -> int:
    """Count a text that carries the nonce (unique per request) without caching it."""
    return counter.count_uncached(text)


def _branch_ms(branches: Sequence[BranchOutcome], source: str) -> int:
    for b in branches:
        if b.source == source:
            return round(b.latency_ms)
    return 0


def _summary(
    result: PackResult, dropped: list[ScoredMemory], kept: list[ScoredMemory]
) -> PackSummary:
    return PackSummary(
        path=result.path,
        candidates_evaluated=result.candidates_evaluated,
        excluded_for_budget=result.excluded_for_budget + len(dropped),
        budget_reached=result.budget_reached or bool(dropped),
        total_score=float(sum(m.composite_score for m in kept)),
    )
