"""Wire messages (upb classes from ibex.service.pb) to and from the pipeline's structs.

The pipeline never sees generated classes, so a protobuf library change stays
in this module and the server. Nested messages are passed as dicts, which upb
builds in C.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ibex.assembly.candidates import SearchResult
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    Message,
    SearchRequest,
)
from ibex.service import pb


def request_from_proto(msg: Any) -> AssemblyRequest:
    # AssemblyOptions mirrors its message field for field (tests/unit/test_proto.py):
    # one C copy by name.
    options = (
        msgspec.convert(msg.options, AssemblyOptions, from_attributes=True)
        if msg.HasField("options")
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


def response_to_proto(r: AssemblyResult) -> Any:
    """The wire response. The nested structs mirror their messages field for field
    (tests/unit/test_proto.py pins the names), so they go across as dicts, built by one
    `msgspec.to_builtins` call per list (a C loop, half the cost of `asdict` per item)."""
    builtins = msgspec.to_builtins
    return pb.AssembleContextResponse(
        assembled_context=r.assembled_context,
        tokens_used=r.tokens_used,
        memories_included=len(r.memories_used),
        memories_used=builtins(r.memories_used),
        directive_tokens=r.directive_tokens,
        history_tokens=r.history_tokens,
        memory_tokens=r.memory_tokens,
        metrics=builtins(r.metrics),
        request_id=r.request_id,
        trace_id=r.trace_id,
        span_id=r.span_id,
        score_schema=r.score_schema,
        degradation_level=r.degradation_level,
        branches=builtins(r.branches),
        budget=builtins(r.budget),
        pack=builtins(r.pack),
        excluded=builtins(r.excluded),
    )


def branches_header(r: AssemblyResult) -> str:
    """`directive=success;hot=timeout;cold=success`: loggable without parsing the body."""
    return ";".join(f"{b.source}={b.status}" for b in r.branches)


def search_from_proto(msg: Any) -> SearchRequest:
    return SearchRequest(
        org_id=msg.org_id,
        agent_id=msg.agent_id,
        query=msg.query,
        limit=msg.limit,
        min_similarity=msg.min_similarity,
        categories=tuple(msg.categories),
        tags=tuple(msg.tags),
        session_id=msg.session_id,
    )


def search_to_proto(found: SearchResult, search_time_ms: int) -> Any:
    """The wire response: the ranked hits, the caller's own candidates, the time taken."""
    memories = [
        pb.Memory(
            id=h.hit.memory_id,
            content=h.hit.content,
            category=h.hit.category,
            confidence=h.hit.confidence,
            composite_score=h.score,
            retrieval_count=h.hit.access_count or 0,
            created_at=h.hit.created_at or "",
        )
        for h in found.hits
    ]
    return pb.SearchMemoriesResponse(
        memories=memories,
        total_candidates=found.own_candidates,
        search_time_ms=search_time_ms,
    )
