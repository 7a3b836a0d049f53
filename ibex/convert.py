"""Wire messages (upb classes from ibex.wire) to and from the pipeline's structs.

The pipeline never sees generated classes, so a protobuf library change stays
in this module and the server. Nested messages are passed as dicts, which upb
builds in C.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ibex import wire
from ibex.structs import (
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    MemoryUsed,
    Message,
)


def request_from_proto(msg: Any) -> AssemblyRequest:
    o = msg.options if msg.HasField("options") else None
    options = (
        AssemblyOptions(
            skip_cold_memories=o.skip_cold_memories,
            skip_hot_memories=o.skip_hot_memories,
            recency_weight=o.recency_weight,
            relevance_weight=o.relevance_weight,
            usefulness_weight=o.usefulness_weight,
            confidence_weight=o.confidence_weight,
            max_memories=o.max_memories,
        )
        if o is not None
        else AssemblyOptions()
    )
    return AssemblyRequest(
        agent_id=msg.agent_id,
        org_id=msg.org_id,
        query=msg.query,
        model=msg.model,
        session_id=msg.session_id,
        directive_version_id=msg.directive_version_id,
        available_tokens=msg.available_tokens,
        recent_messages=tuple(Message(m.role, m.content) for m in msg.recent_messages),
        options=options,
        request_id=msg.request_id,
        trace_id=msg.trace_id,
        span_id=msg.span_id,
        tool_schemas=tuple(msg.tool_schemas),
    )


def _memories(items: Iterable[MemoryUsed]) -> list[dict[str, Any]]:
    return [
        dict(
            memory_id=m.memory_id,
            composite_score=m.composite_score,
            relevance_score=m.relevance_score,
            recency_score=m.recency_score,
            usefulness_score=m.usefulness_score,
            rank=m.rank,
            category=m.category,
            exclusion=m.exclusion,
            similarity=m.similarity,
            confidence=m.confidence,
            token_estimate=m.token_estimate,
        )
        for m in items
    ]


def response_to_proto(r: AssemblyResult) -> Any:
    b = r.budget
    mt = r.metrics
    return wire.AssembleContextResponse(
        assembled_context=r.assembled_context,
        tokens_used=r.tokens_used,
        memories_included=len(r.memories_used),
        memories_used=_memories(r.memories_used),
        directive_tokens=r.directive_tokens,
        history_tokens=r.history_tokens,
        memory_tokens=r.memory_tokens,
        metrics=dict(
            budget_calculation_ms=mt.budget_calculation_ms,
            directive_load_ms=mt.directive_load_ms,
            hot_memory_retrieval_ms=mt.hot_memory_retrieval_ms,
            cold_memory_retrieval_ms=mt.cold_memory_retrieval_ms,
            ranking_ms=mt.ranking_ms,
            packing_ms=mt.packing_ms,
            formatting_ms=mt.formatting_ms,
            total_ms=mt.total_ms,
            candidates_evaluated=mt.candidates_evaluated,
        ),
        request_id=r.request_id,
        trace_id=r.trace_id,
        span_id=r.span_id,
        score_schema=r.score_schema,
        degradation_level=r.degradation_level,
        branches=[
            dict(source=x.source, status=x.status, latency_ms=x.latency_ms, detail=x.detail)
            for x in r.branches
        ],
        budget=dict(
            context_window=b.context_window,
            response_reserve=b.response_reserve,
            safety_buffer=b.safety_buffer,
            directive_tokens=b.directive_tokens,
            messages_tokens=b.messages_tokens,
            tool_schema_tokens=b.tool_schema_tokens,
            formatter_overhead_tokens=b.formatter_overhead_tokens,
            usable_budget=b.usable_budget,
            constrained=b.constrained,
            tokenizer_family=b.tokenizer_family,
            estimate_kind=b.estimate_kind,
        ),
        pack=dict(
            path=r.pack.path,
            candidates_evaluated=r.pack.candidates_evaluated,
            excluded_for_budget=r.pack.excluded_for_budget,
            budget_reached=r.pack.budget_reached,
            total_score=r.pack.total_score,
        ),
        excluded=_memories(r.excluded),
    )


def branches_header(r: AssemblyResult) -> str:
    """`directive=success;hot=timeout;cold=success`: loggable without parsing the body."""
    return ";".join(f"{b.source}={b.status}" for b in r.branches)
