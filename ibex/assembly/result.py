"""Stage 6, the result: the answer and every fact it reports about itself.

Which memories were used and why the others were not, the token split, the
degradation level, the pack summary and each stage's whole milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ibex.assembly.candidates import Selection, memory_used
from ibex.assembly.fixed_sections import FixedSections
from ibex.assembly.render import RenderedContext
from ibex.assembly.stage_timer import StageTimer, whole_ms
from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyResult,
    BranchOutcome,
    DegradationLevel,
    PackResult,
    PackSummary,
    ScoredMemory,
    Stage,
)

if TYPE_CHECKING:
    from ibex.assembly.pipeline import AssemblyInputs

__all__ = ["build_result", "degradation_level", "timing_metrics"]


def degradation_level(branches: Iterable[BranchOutcome]) -> DegradationLevel:
    """L0 full, L1 one memory source missing, L2 none; skipped by request is not missing."""
    missing = sum(
        1 for b in branches if b.source in ("hot", "cold") and b.status in ("timeout", "error")
    )
    return "L0" if missing == 0 else "L1" if missing == 1 else "L2"


def build_result(
    inputs: AssemblyInputs,
    fixed: FixedSections,
    packed: PackResult,
    rendered: RenderedContext,
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
        **timing_metrics(inputs, timer.total()),
        candidates_evaluated=packed.candidates_evaluated,
    )
    directive = inputs.directive
    return AssemblyResult(
        assembled_context=rendered.text,
        tokens_used=rendered.tokens_used,
        memories_used=tuple([memory_used(m, "included") for m in ordered]),
        excluded=tuple(excluded),
        directive_tokens=fixed.directive_tokens
        + (fixed.safety_tokens if ordered or fixed.safety_fixed else 0),
        history_tokens=fixed.history_tokens,
        memory_tokens=sum([m.token_estimate for m in ordered]),
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


def timing_metrics(inputs: AssemblyInputs, work: float) -> dict[str, int]:
    """The metrics that depend on retrieval's timing: each branch's latency, and the total
    of retrieval and `work` (the pipeline's seconds)."""
    return {
        "directive_load_ms": _branch_ms(inputs.branches, "directive"),
        "hot_memory_retrieval_ms": _branch_ms(inputs.branches, "hot"),
        "cold_memory_retrieval_ms": _branch_ms(inputs.branches, "cold"),
        "total_ms": whole_ms(work + inputs.retrieval_ms / 1000.0),
    }


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
        total_score=float(sum([m.composite_score for m in kept])),
        tenant_filtered=tenant_filtered,
    )
