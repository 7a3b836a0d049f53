"""The OpenTelemetry SDK side of `ibex.ops.tracing`: the provider, RPC spans and their children.

Imported only when tracing is on (it needs the `otel` extra). Child spans are
built after the answer from the times the request path recorded, with
explicit start and end times (see `CallTrace`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ibex import __version__
from ibex.ops.tracing import SERVICE_NAME

# gRPC status names -> codes (the `rpc.grpc.status_code` attribute).
GRPC_CODES: Final = {
    name: i
    for i, name in enumerate(
        (
            "OK",
            "CANCELLED",
            "UNKNOWN",
            "INVALID_ARGUMENT",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION",
            "ABORTED",
            "OUT_OF_RANGE",
            "UNIMPLEMENTED",
            "INTERNAL",
            "UNAVAILABLE",
            "DATA_LOSS",
            "UNAUTHENTICATED",
        )
    )
}
# The codes OpenTelemetry's RPC conventions count as a server span's error; the
# others (a bad argument, a refused caller, a shed) are the caller's to own.
_SERVER_ERRORS: Final = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)
_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
_HEX16 = re.compile(r"[0-9a-fA-F]{16}")


def _resource() -> Resource:
    """`service.name` is ibex-context unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say."""
    resource = Resource.create({"service.version": __version__})
    name = resource.attributes.get("service.name")
    if not name or str(name).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


class Tracing:
    """The process's tracer provider (SDK sampler, OTLP/HTTP exporter, batch processor)."""

    def __init__(self, exporter: SpanExporter | None = None) -> None:
        # The SDK reads OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and OTEL_EXPORTER_OTLP_* here.
        self.provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
        exporter = OTLPSpanExporter() if exporter is None else exporter
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("ibex", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def call(self, service: str, method: str, metadata: Any, start: float) -> CallTrace:
        """A trace for one RPC that started at `start` (perf_counter) with this metadata."""
        return CallTrace(self, service, method, metadata, start)

    def parent(self, metadata: Any, trace_id: str = "", span_id: str = "") -> Context:
        """The caller's span: W3C `traceparent` metadata, else the request's ids, else none.

        An invalid `traceparent` is ignored (W3C: restart the trace). The request's
        fields carry no sampled flag; they are taken as sampled, since a caller
        fills them for a call it traces.
        """
        if metadata:
            ctx = self.propagator.extract(metadata, context=Context())
            if otel_trace.get_current_span(ctx).get_span_context().is_valid:
                return ctx
        if (
            len(trace_id) == 32
            and len(span_id) == 16
            and _HEX32.fullmatch(trace_id)
            and _HEX16.fullmatch(span_id)
        ):
            sc = SpanContext(
                int(trace_id, 16),
                int(span_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            if sc.is_valid:
                return otel_trace.set_span_in_context(NonRecordingSpan(sc), Context())
        return Context()

    def shutdown(self) -> None:
        """Export what is queued and stop (at daemon exit; bounded by the exporter's timeout)."""
        self.provider.shutdown()


@dataclass(slots=True, eq=False, repr=False)  # no repr: the metadata holds credentials
class CallTrace:
    """One RPC's span and the timings its children are built from (perf_counter seconds)."""

    tracing: Tracing
    service: str
    method: str
    metadata: Any
    start: float
    span: Span | None = field(default=None, init=False)
    attributes: dict[str, str | int | float] = field(default_factory=dict, init=False)
    # (source, status, latency_ms, detail, start, end)
    branches: list[tuple[str, str, float, str, float, float]] = field(
        default_factory=list, init=False
    )
    stages: list[tuple[str, float, float]] = field(default_factory=list, init=False)

    def open(self, trace_id: str = "", span_id: str = "") -> str:
        """Start the RPC span under the caller's span; the effective trace id, hex (for logs)."""
        if self.span is None:
            parent = self.tracing.parent(self.metadata, trace_id, span_id)
            self.span = self.tracing.tracer.start_span(
                f"{self.service}/{self.method}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": self.service,
                    "rpc.method": self.method,
                },
                start_time=_epoch_ns(self.start, time.perf_counter(), time.time_ns()),
            )
        return format(self.span.get_span_context().trace_id, "032x")

    def branch(
        self, source: str, status: str, latency_ms: float, detail: str, start: float, end: float
    ) -> None:
        self.branches.append((source, status, latency_ms, detail, start, end))

    def stage(self, name: str, start: float, end: float) -> None:
        self.stages.append((name, start, end))

    def finish(self, code: str) -> None:
        """End the RPC span with its status, and build its children if it is sampled."""
        self.open()
        span = self.span
        assert span is not None
        if span.is_recording():
            self._children(span)
            span.set_attribute("rpc.grpc.status_code", GRPC_CODES.get(code, 2))
            for key, value in self.attributes.items():
                span.set_attribute(key, value)
            if code in _SERVER_ERRORS:
                span.set_status(Status(StatusCode.ERROR, code))
        span.end()

    def _children(self, span: Span) -> None:
        tracer = self.tracing.tracer
        ctx = otel_trace.set_span_in_context(span, Context())
        now, now_ns = time.perf_counter(), time.time_ns()
        for source, status, latency_ms, detail, start, end in self.branches:
            attrs: dict[str, str | float] = {
                "ibex.branch.source": source,
                "ibex.branch.status": status,
                "ibex.branch.latency_ms": latency_ms,
            }
            if detail:
                attrs["ibex.branch.detail"] = detail
            child = tracer.start_span(
                f"branch.{source}",
                context=ctx,
                attributes=attrs,
                start_time=_epoch_ns(start, now, now_ns),
            )
            if status in ("timeout", "error"):
                child.set_status(Status(StatusCode.ERROR, status))
            child.end(end_time=_epoch_ns(end, now, now_ns))
        for name, start, end in self.stages:
            tracer.start_span(
                f"stage.{name}",
                context=ctx,
                attributes={"ibex.stage": name},
                start_time=_epoch_ns(start, now, now_ns),
            ).end(end_time=_epoch_ns(end, now, now_ns))


def _epoch_ns(t: float, now: float, now_ns: int) -> int:
    """A perf_counter reading as Unix-epoch nanoseconds, anchored at one pair of readings."""
    return now_ns - int((now - t) * 1e9)
