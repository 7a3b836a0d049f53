"""When tracing is on: the OTEL_* variables read at start-up, and the daemon without the extra."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from ibex.assembly.pipeline import StageTimer
from ibex.assembly.structs import BranchOutcome, BranchSource
from ibex.ops.tracing import setup_tracing, tracing_wanted
from ibex.service.assembler import _record
from ibex.sources.retrieved import Retrieved

ENDPOINT = "http://127.0.0.1:4318"


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": " OTLP "}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT + "/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            False,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            True,
        ),
    ],
)
def test_tracing_wanted(env: dict[str, str], on: bool) -> None:
    assert tracing_wanted(env)[0] is on


def test_unsupported_exporter_is_a_warning_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "ibex"):
        assert setup_tracing({"OTEL_TRACES_EXPORTER": "zipkin"}) is None
    (record,) = [r for r in caplog.records if r.getMessage() == "tracing_off"]
    assert record.levelno == logging.WARNING and "zipkin" in record.__dict__["detail"]


def test_without_the_extra_tracing_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As if opentelemetry were not installed: importing it (or the SDK side) fails.
    monkeypatch.setitem(sys.modules, "ibex.ops.otel_sdk", None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with caplog.at_level(logging.WARNING, "ibex"):
        assert setup_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}) is None
    assert [r.getMessage() for r in caplog.records] == ["tracing_unavailable"]


def test_tracing_on_logs_the_endpoint_without_its_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    with caplog.at_level(logging.INFO, "ibex"):
        tracing = setup_tracing(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://user:secret@127.0.0.1:4318"}
        )
    assert tracing is not None
    tracing.shutdown()
    (record,) = [r for r in caplog.records if r.getMessage() == "tracing_on"]
    assert record.__dict__["endpoint"] == "http://<redacted>@127.0.0.1:4318"


def test_tracing_on_builds_a_provider() -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    tracing = setup_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT})
    assert tracing is not None
    tracing.shutdown()


class Recorder:
    """What `Assembler` hands a traced call, captured (the `CallTrace` interface)."""

    def __init__(self) -> None:
        self.branches: dict[str, tuple[str, float, str, float, float]] = {}
        self.stages: list[tuple[str, float, float]] = []
        self.attributes: dict[str, object] = {}

    def branch(
        self, source: str, status: str, latency_ms: float, detail: str, start: float, end: float
    ) -> None:
        self.branches[source] = (status, latency_ms, detail, start, end)

    def stage(self, name: str, start: float, end: float) -> None:
        self.stages.append((name, start, end))


async def test_branch_times_are_each_branchs_own() -> None:
    started = trio.current_time() - 1.0
    got = Retrieved(
        directive=None,
        hot=(),
        cold=(),
        branches=(
            BranchOutcome("directive", "success", 0.0, "cached"),  # answered without a task
            BranchOutcome("hot", "success", 3.0, ""),
            BranchOutcome("cold", "timeout", 20.0, "request wall of 20ms reached"),
        ),
        elapsed_ms=20.0,
        started=started,
    )
    starts: dict[BranchSource, float] = {"hot": started + 0.002, "cold": started + 0.001}
    timer = StageTimer()
    timer.start, timer.seconds = 500.0, {"count": 0.5, "select": 0.25}
    rec = Recorder()
    _record(rec, got, starts, timer, SimpleNamespace(degradation_level="L1"))  # type: ignore[arg-type]
    d, hot, cold = (rec.branches[s] for s in ("directive", "hot", "cold"))
    assert d[:3] == ("success", 0.0, "cached") and d[3] == d[4]  # at retrieval's start
    assert hot[3] - d[3] == pytest.approx(0.002) and hot[4] - hot[3] == pytest.approx(0.003)
    # Cut by the request wall: it ends where retrieval ended, not 20 ms after its own start.
    assert cold[0] == "timeout" and cold[3] - d[3] == pytest.approx(0.001)
    assert cold[4] - d[3] == pytest.approx(0.020)
    assert rec.stages == [("count", 500.0, 500.5), ("select", 500.5, 500.75)]
    assert rec.attributes == {"ibex.degradation_level": "L1"}


def test_the_serving_path_does_not_import_the_sdk_unless_tracing_is_on() -> None:
    """The tracing SDK and its HTTP client cost start-up time: loaded only when used.

    (redis-py imports parts of opentelemetry itself when it is installed.)
    """
    prefixes = (
        "opentelemetry.sdk.trace",
        "opentelemetry.exporter",
        "requests",
        "ibex.ops.otel_sdk",
    )
    probe = (
        "import sys, ibex.service.root, ibex.cli\n"
        "from ibex.ops.tracing import setup_tracing\n"
        "assert setup_tracing({}) is None\n"
        f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


@pytest.fixture
def traced() -> Any:
    """A real `Tracing` exporting to memory; its batch processor is flushed before reading."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ibex.ops.otel_sdk import Tracing

    memory = InMemorySpanExporter()
    tracing = Tracing(exporter=memory)

    def finished() -> list[Any]:
        tracing.provider.force_flush()
        return list(memory.get_finished_spans())

    yield tracing, SimpleNamespace(get_finished_spans=finished)
    tracing.shutdown()


@pytest.mark.parametrize(
    ("code", "number", "error"),
    [
        ("OK", 0, False),
        ("INVALID_ARGUMENT", 3, False),
        ("RESOURCE_EXHAUSTED", 8, False),
        ("PERMISSION_DENIED", 7, False),
        ("DEADLINE_EXCEEDED", 4, True),
        ("INTERNAL", 13, True),
        ("UNIMPLEMENTED", 12, True),
    ],
)
def test_rpc_span_status(traced: Any, code: str, number: int, error: bool) -> None:
    from opentelemetry.trace import StatusCode

    tracing, memory = traced
    start = time.perf_counter()
    call = tracing.call("svc.S", "M", {}, start)
    call.branch("cold", "timeout", 20.0, "no answer within 20ms", start, start + 0.02)
    call.finish(code)
    spans = {s.name: s for s in memory.get_finished_spans()}
    rpc = spans["svc.S/M"]
    assert rpc.attributes["rpc.grpc.status_code"] == number
    assert (rpc.status.status_code is StatusCode.ERROR) is error
    cold = spans["branch.cold"]
    assert cold.status.status_code is StatusCode.ERROR
    assert cold.attributes["ibex.branch.detail"] == "no answer within 20ms"
    assert cold.parent.span_id == rpc.context.span_id
    assert cold.end_time - cold.start_time == pytest.approx(20_000_000, abs=1000)


@pytest.mark.parametrize(
    ("trace_id", "span_id"),
    [
        ("0" * 32, "b7ad6b7169203331"),  # all-zero trace id: invalid
        ("0af7651916cd43dd8448eb211c80319c", "0" * 16),  # all-zero span id: invalid
        ("0af7651916cd43dd8448eb211c80319", "b7ad6b7169203331"),  # 31 digits
        ("0af7651916cd43dd8448eb211c80319g", "b7ad6b7169203331"),  # not hex
        ("0af7651916cd43dd8448eb211c80319c", ""),  # no span id
    ],
)
def test_invalid_request_ids_start_a_new_trace(traced: Any, trace_id: str, span_id: str) -> None:
    tracing, memory = traced
    call = tracing.call("svc.S", "M", {}, time.perf_counter())
    effective = call.open(trace_id, span_id)
    call.finish("OK")
    (rpc,) = memory.get_finished_spans()
    assert rpc.parent is None and format(rpc.context.trace_id, "032x") == effective != trace_id


def test_request_ids_in_upper_case_are_the_same_trace(traced: Any) -> None:
    tracing, memory = traced
    call = tracing.call("svc.S", "M", {}, time.perf_counter())
    assert call.open("0AF7651916CD43DD8448EB211C80319C", "B7AD6B7169203331") == (
        "0af7651916cd43dd8448eb211c80319c"
    )
    call.finish("OK")
    (rpc,) = memory.get_finished_spans()
    assert rpc.parent.span_id == 0xB7AD6B7169203331 and rpc.parent.is_remote
