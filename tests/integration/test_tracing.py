"""Traces end to end: the daemon exports OTLP/HTTP protobuf to a real receiver in this process.

The receiver is a plain HTTP server on loopback that accepts `POST /v1/traces`
and decodes `ExportTraceServiceRequest` with opentelemetry-proto, as a
collector would. The daemon runs in-process with `OTEL_*` set; leaving
`running_daemon` stops it, which flushes the batch processor, so every span
is at the receiver when the block ends (no polling).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import itertools
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ibex.ops.logs import JsonFormatter
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    SERVICE,
    RunningDaemon,
    daemon_process,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
FIELD_TRACE = "0af7651916cd43dd8448eb211c80319c"
FIELD_SPAN = "b7ad6b7169203331"
STAGES = ["count", "select", "price", "pack", "render"]
MAX_BODY = 8 * 1024 * 1024


class Receiver:
    """An OTLP/HTTP traces endpoint: every span received, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(min(length, MAX_BODY))
                request = ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    receiver.paths.append(self.path)
                    receiver.content_types.append(self.headers.get("Content-Type", ""))
                    for rs in request.resource_spans:
                        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans.extend((resource, s) for s in ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def received(self) -> list[tuple[dict[str, Any], Span]]:
        with self._lock:
            return list(self.spans)


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attrs(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> pytest.MonkeyPatch:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    return monkeypatch


@contextlib.contextmanager
def json_logs() -> Iterator[io.StringIO]:
    """The `ibex` loggers' lines as the daemon writes them (bound request fields included)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("ibex")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def assemble(d: RunningDaemon, metadata: list[tuple[str, str]] | None = None, **fields: Any) -> Any:
    request = context_pb2.AssembleContextRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="How do I deploy the billing service?",
        model="gpt-4o",
        request_id="req-trace",
        **fields,
    )
    with d.channel() as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        return stub.AssembleContext(request, metadata=metadata or None, timeout=5)


def by_trace(spans: list[tuple[dict[str, Any], Span]], trace: str) -> list[Span]:
    return [s for _, s in spans if s.trace_id.hex() == trace]


async def test_traceparent_gives_one_rpc_span_with_branch_and_stage_children(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # spans leave only at the exit flush
    with json_logs() as logs:
        async with running_daemon() as d:
            assert d.daemon.tracing is not None
            reply = await in_thread(
                assemble,
                d,
                [("traceparent", f"00-{TRACE}-{PARENT}-01")],
                # Fields name another trace: W3C metadata wins.
                trace_id=FIELD_TRACE,
                span_id=FIELD_SPAN,
            )
            assert receiver.received() == []
    received = receiver.received()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert set(receiver.content_types) == {"application/x-protobuf"}
    assert {r["service.name"] for r, _ in received} == {"ibex-context"}
    spans = by_trace(received, TRACE)
    assert len(spans) == len(received) == 1 + 3 + len(STAGES)

    (rpc,) = [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    assert rpc.name == f"{SERVICE}/AssembleContext"
    assert rpc.parent_span_id.hex() == PARENT
    assert attrs(rpc) == {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": "AssembleContext",
        "rpc.grpc.status_code": 0,
        "ibex.degradation_level": reply.degradation_level,
    }
    assert rpc.status.code != rpc.status.STATUS_CODE_ERROR
    children = [s for s in spans if s is not rpc]
    assert all(s.parent_span_id == rpc.span_id for s in children)
    assert all(rpc.start_time_unix_nano <= s.start_time_unix_nano for s in children)
    assert all(s.end_time_unix_nano <= rpc.end_time_unix_nano for s in children)

    branches = {s.name: s for s in children if s.name.startswith("branch.")}
    assert sorted(branches) == ["branch.cold", "branch.directive", "branch.hot"]
    for outcome in reply.branches:
        span = branches[f"branch.{outcome.source}"]
        a = attrs(span)
        assert a["ibex.branch.source"] == outcome.source
        assert a["ibex.branch.status"] == outcome.status == "success"
        assert a["ibex.branch.latency_ms"] == pytest.approx(outcome.latency_ms, abs=1e-3)
        duration_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
        assert duration_ms == pytest.approx(outcome.latency_ms, abs=0.01)

    stages = sorted(
        (s for s in children if s.name.startswith("stage.")), key=lambda s: s.start_time_unix_nano
    )
    assert [s.name for s in stages] == [f"stage.{n}" for n in STAGES]
    assert [attrs(s)["ibex.stage"] for s in stages] == STAGES
    for before, after in itertools.pairwise(stages):  # laps are back to back
        assert abs(after.start_time_unix_nano - before.end_time_unix_nano) <= 1000
    # Retrieval comes before the pipeline.
    assert max(s.end_time_unix_nano for s in branches.values()) <= stages[0].start_time_unix_nano

    # The request's log lines (the sample's foreign hit is logged) carry the effective trace id.
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    dropped = [line for line in lines if line["event"] == "tenant_filter_dropped"]
    assert dropped and all(line["trace_id"] == TRACE for line in dropped)
    (on,) = [line for line in lines if line["event"] == "tracing_on"]
    assert on["endpoint"] == receiver.endpoint


async def test_request_fields_parent_the_span_without_traceparent(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    otel_env.setenv("OTEL_SERVICE_NAME", "ibex-canary")
    async with running_daemon() as d:
        await in_thread(assemble, d, None, trace_id=FIELD_TRACE, span_id=FIELD_SPAN)
        # An invalid traceparent is ignored: the fields still parent the call.
        await in_thread(
            assemble,
            d,
            [("traceparent", f"00-{'0' * 32}-{PARENT}-01")],
            trace_id=FIELD_TRACE,
            span_id=FIELD_SPAN,
        )
        # Neither: a new root.
        await in_thread(assemble, d)
    received = receiver.received()
    assert {r["service.name"] for r, _ in received} == {"ibex-canary"}  # OTEL_SERVICE_NAME wins
    rpcs = [s for _, s in received if s.kind == Span.SPAN_KIND_SERVER]
    assert len(rpcs) == 3
    fielded, invalid, root = rpcs
    for span in (fielded, invalid):
        assert span.trace_id.hex() == FIELD_TRACE
        assert span.parent_span_id.hex() == FIELD_SPAN
    assert root.trace_id.hex() not in (FIELD_TRACE, TRACE) and root.parent_span_id == b""
    assert len(by_trace(received, root.trace_id.hex())) == 1 + 3 + len(STAGES)


async def test_a_refused_call_has_its_status_on_the_rpc_span(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    async with running_daemon() as d:
        with pytest.raises(grpc.RpcError) as err:
            await in_thread(
                assemble, d, [("traceparent", f"00-{TRACE}-{PARENT}-01")], available_tokens=-1
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (span,) = [s for _, s in receiver.received()]
    assert span.trace_id.hex() == TRACE and span.parent_span_id.hex() == PARENT
    assert attrs(span)["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT: the caller's, not ours
    assert span.status.code != span.status.STATUS_CODE_ERROR


async def test_sampler_decides_and_a_parent_not_sampled_stays_unsampled(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    async with running_daemon() as d:
        await in_thread(assemble, d, [("traceparent", f"00-{TRACE}-{PARENT}-00")])
        await in_thread(assemble, d, [("traceparent", f"00-{FIELD_TRACE}-{PARENT}-01")])
    received = receiver.received()
    assert by_trace(received, TRACE) == []
    assert len(by_trace(received, FIELD_TRACE)) == len(received) == 1 + 3 + len(STAGES)


async def test_sampler_off_exports_nothing(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    async with running_daemon() as d:
        assert d.daemon.tracing is not None
        await in_thread(assemble, d, [("traceparent", f"00-{TRACE}-{PARENT}-01")])
        await in_thread(assemble, d, trace_id=FIELD_TRACE, span_id=FIELD_SPAN)
    assert receiver.received() == []


@pytest.mark.parametrize(
    "env",
    [
        {},  # no exporter configured
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
async def test_tracing_off(
    otel_env: pytest.MonkeyPatch, receiver: Receiver, env: dict[str, str]
) -> None:
    if not env:
        otel_env.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    for name, value in env.items():
        otel_env.setenv(name, value)
    with json_logs() as logs:
        async with running_daemon() as d:
            assert d.daemon.tracing is None
            reply = await in_thread(assemble, d, [("traceparent", f"00-{TRACE}-{PARENT}-01")])
    assert reply.degradation_level == "L0"
    assert receiver.received() == []
    # Logs keep the request's own trace_id field (here: none).
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    assert all("trace_id" not in line for line in lines if line["event"] != "tracing_off")


async def test_an_unauthenticated_call_exports_no_span_under_its_traceparent(
    otel_env: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    token = "tracing-token-Hq3z-never-logged"
    hashes = frozenset({hashlib.sha256(token.encode()).hexdigest()})
    async with running_daemon(auth_tokens_sha256=hashes) as d:
        for metadata in (
            [("traceparent", f"00-{TRACE}-{PARENT}-01")],
            [("traceparent", f"00-{TRACE}-{PARENT}-01"), ("authorization", "Bearer guess")],
        ):
            with pytest.raises(grpc.RpcError) as err:
                await in_thread(assemble, d, metadata, trace_id=TRACE, span_id=PARENT)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The same caller with the token is traced: the exporter works and was flushed.
        await in_thread(
            assemble,
            d,
            [
                ("traceparent", f"00-{FIELD_TRACE}-{PARENT}-01"),
                ("authorization", f"Bearer {token}"),
            ],
        )
    received = receiver.received()
    assert by_trace(received, TRACE) == []
    assert len(by_trace(received, FIELD_TRACE)) == len(received) == 1 + 3 + len(STAGES)


async def test_a_start_with_credentials_in_the_endpoint_logs_none(
    receiver: Receiver, tmp_path: Path
) -> None:
    """`ibex serve` with the endpoint's credentials in its URL: every line of the start,
    the traced call and the stop, at debug level, shows the URL without them."""
    port = receiver.server.server_address[1]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://ibex:hunter2-secret@127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "20",
        "IBEX_CONTEXT_LOG_LEVEL": "debug",
    }
    with daemon_process(env, tmp_path / "serve.log") as proc:

        def call() -> Any:
            request = context_pb2.AssembleContextRequest(
                agent_id=AGENT, org_id=ORG, query="deploy billing", model="gpt-4o"
            )
            with grpc.insecure_channel(proc.target) as channel:
                stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
                traceparent = ("traceparent", f"00-{TRACE}-{PARENT}-01")
                return stub.AssembleContext(request, metadata=[traceparent], timeout=10)

        assert (await in_thread(call)).assembled_context
        proc.terminate()
        assert await in_thread(proc.wait) == 0
        stderr = proc.stderr
    assert by_trace(receiver.received(), TRACE)  # the endpoint was used
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert "hunter2" not in stderr
    (on,) = [line for line in lines if line["event"] == "tracing_on"]
    assert on["endpoint"] == f"http://<redacted>@127.0.0.1:{port}"
