"""What the protobuf wire layer costs per AssembleContext call, per codec.

The server decodes one request and encodes one response per call. Pure-Python
betterproto2 is convenient but slow; this compares it with the official
`protobuf` package (upb backend) driven through the grpcio-tools pb2 classes,
and tries `betterproto2-rust-codec` when it is installed.

Each codec is timed on realistic messages: a request with 4 history turns of
~500 chars, 3 tool schemas, options and a principal context; a response with 30
MemoryUsed (12 emitted, 18 excluded), 3 branches, budget, pack, metrics and a
12 KB assembled_context. Besides raw decode/encode it times the whole boundary
the server really crosses: bytes -> `AssemblyRequest` struct and `AssemblyResult`
struct -> bytes.

Run: ``.venv/bin/python -m benchmarks.codec`` (prints a table, writes
``benchmarks/results/codec.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from google.protobuf.internal import api_implementation

from ibex._proto.ibex.auth import v1 as bp_auth
from ibex._proto.ibex.context import v1 as bp
from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    MemoryUsed,
    Message,
    PackSummary,
    TokenBudget,
)
from ibex.service import convert, pb

RESULTS = Path(__file__).parent / "results" / "codec.json"
TARGET_US = 300.0

_ORG = "0b3c8a52-6f0e-4c47-9d2a-1f6f8f6b2a11"
_AGENT = "7d2f4e18-3a9b-4f0c-8e6d-5b1a2c3d4e5f"
_TURN = (
    "Could you look at the deployment logs from last night? The checkout service started "
    "returning 502s around 02:10 UTC and the on-call engineer rolled back at 02:40, but we "
    "still don't know whether the new connection-pool settings or the database failover "
    "caused it. Summarise the timeline, point out anything unusual in the error rates, and "
    "suggest what we should check before we try the rollout again this afternoon. Keep it "
    "short, I need to forward it to the incident channel before the 10am sync meeting. x"
)
_TOOL = json.dumps(
    {
        "name": "search_logs",
        "description": "Search structured service logs in a time window and return matches.",
        "input_schema": {
            "type": "object",
            "properties": {
                "service": {"type": "string", "description": "Service name"},
                "query": {"type": "string", "description": "Lucene-style query"},
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "required": ["service", "query", "start", "end"],
        },
    }
)


def sample_request() -> AssemblyRequest:
    roles = ("user", "assistant", "user", "assistant")
    return AssemblyRequest(
        agent_id=_AGENT,
        org_id=_ORG,
        session_id="sess-2f9c1e",
        query=_TURN,
        model="gpt-4o",
        directive_version_id="5a8e3c2b-1d4f-4e6a-9b7c-0f1e2d3c4b5a",
        available_tokens=32000,
        recent_messages=tuple(Message(role=r, content=_TURN) for r in roles),
        options=AssemblyOptions(
            recency_weight=0.2,
            relevance_weight=0.5,
            usefulness_weight=0.2,
            confidence_weight=0.1,
            max_memories=40,
        ),
        request_id="req-8f1d2c3b4a596877",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        tool_schemas=(_TOOL, _TOOL.replace("search_logs", "get_metrics"), _TOOL[:400] + "}"),
    )


def _memory(i: int, exclusion: str) -> MemoryUsed:
    return MemoryUsed(
        memory_id=f"{i:08x}-1111-4222-8333-444455556666",
        composite_score=0.9 - i * 0.01,
        relevance_score=0.8 - i * 0.01,
        recency_score=0.5,
        usefulness_score=0.4,
        rank=i + 1,
        category=("procedural", "factual", "preference", "episodic")[i % 4],
        exclusion=exclusion,  # type: ignore[arg-type]
        similarity=0.77,
        confidence=0.9,
        token_estimate=120 + i,
    )


def sample_result() -> AssemblyResult:
    return AssemblyResult(
        assembled_context=("<memory id='x' category='factual'>" + "y" * 90 + "</memory>\n")
        * (12 * 1024 // 128),
        tokens_used=3100,
        memories_used=tuple(_memory(i, "included") for i in range(12)),
        excluded=tuple(_memory(i, "budget") for i in range(12, 30)),
        directive_tokens=400,
        history_tokens=480,
        memory_tokens=1900,
        tool_tokens=260,
        formatter_tokens=60,
        score_schema="weighted_v1",
        degradation_level="L1",
        branches=(
            BranchOutcome("directive", "success", 0.8),
            BranchOutcome("hot", "success", 6.4),
            BranchOutcome("cold", "timeout", 45.0, "cold branch exceeded 45ms"),
        ),
        budget=TokenBudget(128000, 4096, 512, 400, 480, 260, 60, 122192, False, "o200k", "exact"),
        pack=PackSummary("dp", 30, 18, True, 9.87),
        metrics=AssemblyMetrics(1, 1, 6, 45, 1, 2, 1, 52, 30),
        request_id="req-8f1d2c3b4a596877",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
    )


_ISSUED = datetime.datetime(2025, 1, 1, 12, 0, tzinfo=datetime.UTC)


# --- betterproto2 -------------------------------------------------------------------------


def bp_request(r: AssemblyRequest) -> bp.AssembleContextRequest:
    o = r.options
    return bp.AssembleContextRequest(
        agent_id=r.agent_id,
        org_id=r.org_id,
        session_id=r.session_id,
        query=r.query,
        model=r.model,
        directive_version_id=r.directive_version_id,
        available_tokens=r.available_tokens,
        recent_messages=[bp.Message(role=m.role, content=m.content) for m in r.recent_messages],
        options=bp.AssemblyOptions(
            skip_cold_memories=o.skip_cold_memories,
            skip_hot_memories=o.skip_hot_memories,
            recency_weight=o.recency_weight,
            relevance_weight=o.relevance_weight,
            usefulness_weight=o.usefulness_weight,
            confidence_weight=o.confidence_weight,
            max_memories=o.max_memories,
        ),
        request_id=r.request_id,
        trace_id=r.trace_id,
        span_id=r.span_id,
        principal_context=bp_auth.PrincipalContext(
            org_id=r.org_id,
            principal_id="svc-proxy",
            agent_id=r.agent_id,
            principal_type="service",
            authz_snapshot_id="snap-1",
            authz_snapshot_digest="d" * 64,
            authority="proxy",
            issued_at=_ISSUED,
            expires_at=_ISSUED,
            request_id=r.request_id,
            trace_id=r.trace_id,
            source="proxy",
            permissions=7,
            token_id="tok-1",
        ),
        tool_schemas=list(r.tool_schemas),
    )


def bp_to_struct(m: bp.AssembleContextRequest) -> AssemblyRequest:
    o = m.options or bp.AssemblyOptions()
    return AssemblyRequest(
        agent_id=m.agent_id,
        org_id=m.org_id,
        query=m.query,
        model=m.model,
        session_id=m.session_id,
        directive_version_id=m.directive_version_id,
        available_tokens=m.available_tokens,
        recent_messages=tuple(Message(x.role, x.content) for x in m.recent_messages),
        options=AssemblyOptions(
            o.skip_cold_memories,
            o.skip_hot_memories,
            o.recency_weight,
            o.relevance_weight,
            o.usefulness_weight,
            o.confidence_weight,
            o.max_memories,
        ),
        request_id=m.request_id,
        trace_id=m.trace_id,
        span_id=m.span_id,
        tool_schemas=tuple(m.tool_schemas),
    )


def _bp_memory(u: MemoryUsed) -> bp.MemoryUsed:
    return bp.MemoryUsed(
        memory_id=u.memory_id,
        composite_score=u.composite_score,
        relevance_score=u.relevance_score,
        recency_score=u.recency_score,
        usefulness_score=u.usefulness_score,
        rank=u.rank,
        category=u.category,
        exclusion=u.exclusion,
        similarity=u.similarity,
        confidence=u.confidence,
        token_estimate=u.token_estimate,
    )


def bp_response(r: AssemblyResult) -> bp.AssembleContextResponse:
    b, p, mt = r.budget, r.pack, r.metrics
    return bp.AssembleContextResponse(
        assembled_context=r.assembled_context,
        tokens_used=r.tokens_used,
        memories_included=len(r.memories_used),
        memories_used=[_bp_memory(u) for u in r.memories_used],
        directive_tokens=r.directive_tokens,
        history_tokens=r.history_tokens,
        memory_tokens=r.memory_tokens,
        metrics=bp.AssemblyMetrics(
            mt.budget_calculation_ms,
            mt.directive_load_ms,
            mt.hot_memory_retrieval_ms,
            mt.cold_memory_retrieval_ms,
            mt.ranking_ms,
            mt.packing_ms,
            mt.formatting_ms,
            mt.total_ms,
            mt.candidates_evaluated,
        ),
        request_id=r.request_id,
        trace_id=r.trace_id,
        span_id=r.span_id,
        score_schema=r.score_schema,
        degradation_level=r.degradation_level,
        branches=[bp.BranchOutcome(x.source, x.status, x.latency_ms, x.detail) for x in r.branches],
        budget=bp.TokenBudget(
            b.context_window,
            b.response_reserve,
            b.safety_buffer,
            b.directive_tokens,
            b.messages_tokens,
            b.tool_schema_tokens,
            b.formatter_overhead_tokens,
            b.usable_budget,
            b.constrained,
            b.tokenizer_family,
            b.estimate_kind,
        ),
        pack=bp.PackSummary(
            p.path, p.candidates_evaluated, p.excluded_for_budget, p.budget_reached, p.total_score
        ),
        excluded=[_bp_memory(u) for u in r.excluded],
    )


# --- protobuf (upb): the server's own path, ibex.service.pb + ibex.service.convert ---


def _time(fn: Callable[[], object], iterations: int) -> dict[str, float]:
    """Median and p90 of individually timed calls, in µs, after a warm-up."""
    for _ in range(min(200, iterations)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        start = clock()
        fn()
        samples.append((clock() - start) / 1000)
    samples.sort()
    return {
        "median_us": round(statistics.median(samples), 2),
        "p90_us": round(samples[int(len(samples) * 0.9)], 2),
    }


def _rust_codec() -> tuple[Any | None, str]:
    try:
        version = metadata.version("betterproto2-rust-codec")
        import betterproto2_rust_codec as codec
    except (metadata.PackageNotFoundError, ImportError):
        return None, "not installed"
    try:
        codec.serialize(bp.Message(role="user", content="probe"))
    except Exception as exc:  # the codec reports a schema mismatch as RuntimeError
        return None, f"{version} incompatible with betterproto2 {_version('betterproto2')}: {exc}"
    return codec, version


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def run(iterations: int) -> dict[str, Any]:
    request, result = sample_request(), sample_result()
    bp_req = bp_request(request)
    req_bytes = bytes(bp_req)
    bp_resp = bp_response(result)
    resp_bytes = bytes(bp_resp)
    pb_resp = convert.response_to_proto(result)
    if pb.AssembleContextRequest.FromString(req_bytes).tool_schemas != bp_req.tool_schemas:
        raise AssertionError("pb2 and betterproto2 disagree on the request")
    if pb_resp.SerializeToString() != resp_bytes:
        raise AssertionError("pb2 and betterproto2 disagree on the response")

    codecs: dict[str, dict[str, Any]] = {}
    codecs["betterproto2"] = {
        "request_decode": _time(lambda: bp.AssembleContextRequest.parse(req_bytes), iterations),
        "request_to_struct": _time(
            lambda: bp_to_struct(bp.AssembleContextRequest.parse(req_bytes)), iterations
        ),
        "response_encode": _time(lambda: bytes(bp_resp), iterations),
        "response_from_struct": _time(lambda: bytes(bp_response(result)), iterations),
    }
    rust, rust_note = _rust_codec()
    if rust is not None:
        codecs["betterproto2+rust"] = {
            "request_decode": _time(
                lambda: rust.deserialize(bp.AssembleContextRequest(), req_bytes), iterations
            ),
            "response_encode": _time(lambda: rust.serialize(bp_resp), iterations),
            "response_from_struct": _time(lambda: rust.serialize(bp_response(result)), iterations),
        }
    codecs[f"protobuf-{api_implementation.Type()}"] = {
        "request_decode": _time(
            lambda: pb.AssembleContextRequest.FromString(req_bytes), iterations
        ),
        "request_to_struct": _time(
            lambda: convert.request_from_proto(pb.AssembleContextRequest.FromString(req_bytes)),
            iterations,
        ),
        "response_encode": _time(lambda: pb_resp.SerializeToString(), iterations),
        "response_from_struct": _time(
            lambda: convert.response_to_proto(result).SerializeToString(), iterations
        ),
    }
    for figures in codecs.values():
        raw = figures["request_decode"]["median_us"] + figures["response_encode"]["median_us"]
        figures["decode_plus_encode_median_us"] = round(raw, 2)
        if "request_to_struct" in figures:
            boundary = (
                figures["request_to_struct"]["median_us"]
                + figures["response_from_struct"]["median_us"]
            )
            figures["struct_boundary_median_us"] = round(boundary, 2)
        figures["under_target"] = raw < TARGET_US

    return {
        "benchmark": "codec",
        "target_decode_plus_encode_us": TARGET_US,
        "iterations": iterations,
        "request_bytes": len(req_bytes),
        "response_bytes": len(resp_bytes),
        "codecs": codecs,
        "rust_codec": rust_note,
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "betterproto2": _version("betterproto2"),
            "protobuf": _version("protobuf"),
            "protobuf_backend": api_implementation.Type(),
        },
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"request {report['request_bytes']} B, response {report['response_bytes']} B, "
        f"{report['iterations']} iterations, median (p90) µs"
    )
    columns = ("request_decode", "response_encode", "request_to_struct", "response_from_struct")
    print(f"{'codec':<20}" + "".join(f"{c:>24}" for c in columns))
    for name, figures in report["codecs"].items():
        cells = []
        for column in columns:
            cell = figures.get(column)
            cells.append(f"{cell['median_us']:>12.1f} ({cell['p90_us']:.1f})" if cell else "-")
        print(f"{name:<20}" + "".join(f"{c:>24}" for c in cells))
    print(f"rust codec: {report['rust_codec']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = run(args.iterations)
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
