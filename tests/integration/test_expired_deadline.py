"""A call whose deadline has already passed on arrival: DEADLINE_EXCEEDED, no error log.

grpclib alone answers such a call UNKNOWN ("Internal Server Error") and logs
"Timeout occurred" at error level; the contract says DEADLINE_EXCEEDED. The
request is sent over raw HTTP/2 (h2) with `grpc-timeout: 1n`, which no stock
client sends on purpose but a slow network delivers all the time.

Also here, over the same raw HTTP/2: a request that stalls half-sent ends at the
read timeout, and only a request still arriving is read under a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import socket
import struct
import time
import unittest.mock
import weakref
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
import trio
from h2.exceptions import StreamClosedError

import ibex.service.edge.crossing as crossing_module
import ibex.service.edge.protocol as protocol_module
import ibex.service.handlers as handlers_module
from ibex.service.admission import GATE_CPU_MESSAGE
from ibex.service.assembler import Assembler
from ibex.service.handlers import ContextService
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    SERVICE,
    RunningDaemon,
    grpcio_probe,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2


def _request_frame() -> bytes:
    """One AssembleContext request as a length-prefixed gRPC message."""
    body = context_pb2.AssembleContextRequest(org_id=ORG, agent_id=AGENT, model="gpt-4o")
    payload = body.SerializeToString()
    return struct.pack(">?I", False, len(payload)) + payload


def _headers(port: int, timeout: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", f"/{SERVICE}/AssembleContext"),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", timeout),
    ]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _answer(
    sock: socket.socket, conn: h2.connection.H2Connection, stream_id: int
) -> dict[str, str]:
    """Stream `stream_id`'s response headers and trailers, read until grpc-status."""
    result: dict[str, str] = {}
    while "grpc-status" not in result:
        data = sock.recv(65536)
        if not data:
            break
        for event in conn.receive_data(data):
            if (
                isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived)
                and event.stream_id == stream_id
            ):
                result.update((_text(k), _text(v)) for k, v in event.headers)
        sock.sendall(conn.data_to_send())
    return result


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "event", r.getMessage()) for r in caplog.records]


def _client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


@contextlib.contextmanager
def _connected(port: int) -> Iterator[tuple[socket.socket, h2.connection.H2Connection]]:
    """A raw h2 client connection to the daemon, its preface and settings sent."""
    conn = _client()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        yield sock, conn


def raw_call(port: int, timeout_header: str, *, send_body: bool = True) -> dict[str, str]:
    """One unary AssembleContext over h2; the response trailers (or headers) as a dict."""
    with _connected(port) as (sock, conn):
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, _headers(port, timeout_header))
        if send_body:
            conn.send_data(stream, _request_frame(), end_stream=True)
        sock.sendall(conn.data_to_send())
        return _answer(sock, conn, stream)


@pytest.fixture
async def daemon() -> Any:
    async with running_daemon() as d:
        yield d


async def test_an_expired_deadline_is_deadline_exceeded_and_not_an_error(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        expired = await in_thread(raw_call, daemon.port, "1n")
        normal = await in_thread(raw_call, daemon.port, "5S")
    assert expired["grpc-status"] == "4"  # DEADLINE_EXCEEDED
    assert normal["grpc-status"] == "0"
    assert _errors(caplog) == []


async def test_a_standing_queue_refuses_a_short_call_before_grpclib_starts_it(
    daemon: RunningDaemon,
) -> None:
    """While the queue stands, a call whose deadline the expected wait would eat is answered
    RESOURCE_EXHAUSTED from its HEADERS alone (trailers only), and counted as shed; a call
    with room is still served."""
    state = daemon.daemon.admission
    started = len(state.metrics.requests.collect()[0].samples)
    state.queue.standing, state.queue.estimate, state.pending = True, 0.5, 1
    try:
        # Headers only: refused from them alone (a handler would wait for the body
        # until the 45 ms deadline and answer DEADLINE_EXCEEDED instead).
        short = await in_thread(functools.partial(raw_call, send_body=False), daemon.port, "45m")
        roomy = await in_thread(raw_call, daemon.port, "5S")
    finally:
        state.queue.standing, state.queue.estimate, state.pending = False, 0.0, 0
    assert short["grpc-status"] == "8"
    assert short["grpc-message"].startswith("overloaded")
    assert ":status" in short and "grpc-message" in short  # one trailers-only HEADERS frame
    assert roomy["grpc-status"] == "0"
    assert state.metrics.shed_requests.labels("queue")._value.get() == 1
    assert len(state.metrics.requests.collect()[0].samples) > started


def reset_then_call(port: int) -> dict[str, str]:
    """Stream 1: HEADERS, then RST_STREAM in the same write (a caller that gave up while
    its request sat in the socket buffer); then stream 3, an ordinary call, on the same
    connection. Stream 3's trailers."""
    conn = _client()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        conn.send_headers(1, _headers(port, "45m"))
        conn.reset_stream(1)
        sock.sendall(conn.data_to_send())
        conn.send_headers(3, _headers(port, "5S"))
        conn.send_data(3, _request_frame(), end_stream=True)
        sock.sendall(conn.data_to_send())
        return _answer(sock, conn, 3)


async def test_a_refused_stream_already_reset_by_its_caller_leaves_the_connection_up(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """Under overload a caller's RST_STREAM often arrives in the same read as its HEADERS.
    The early refusal then has no stream to answer; it must not raise out of
    data_received, which would close the connection and fail every call on it."""
    state = daemon.daemon.admission
    state.queue.standing, state.queue.estimate, state.pending = True, 0.5, 1
    try:
        with caplog.at_level(logging.INFO):
            other = await in_thread(reset_then_call, daemon.port)
    finally:
        state.queue.standing, state.queue.estimate, state.pending = False, 0.0, 0
    assert other.get("grpc-status") == "0"
    assert _errors(caplog) == []


async def call_patched(
    daemon: RunningDaemon,
    caplog: pytest.LogCaptureFixture,
    method: str,
    replacement: Any,
    timeout_header: str,
) -> dict[str, str]:
    """One raw call with a ContextService method replaced, logs captured from info up."""
    with (
        unittest.mock.patch.object(ContextService, method, replacement),
        caplog.at_level(logging.INFO),
    ):
        return await in_thread(raw_call, daemon.port, timeout_header)


async def test_a_caller_gone_when_the_answer_is_sent_is_not_an_error(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """h2 raises StreamClosedError when the answer's send finds the stream reset (the
    caller gave up while its answer was being made; under overload, when the reset is
    read before grpclib could cancel the handler). That is a caller gone, logged at
    info and counted CANCELLED, never an error-level "Application error". The send is
    the handler's (the answer could not be written whole from the Trio side)."""

    async def gone(stream: Any, metadata: Any, message: Any) -> None:
        raise StreamClosedError(1)

    with (
        unittest.mock.patch.object(crossing_module, "send_reply_now", lambda *_: False),
        unittest.mock.patch.object(crossing_module, "send_reply", gone),
        caplog.at_level(logging.INFO),
    ):
        answer = await in_thread(raw_call, daemon.port, "5S")
    assert answer["grpc-status"] == "1"  # CANCELLED
    assert _errors(caplog) == []
    assert "caller_gone" in _events(caplog)


async def test_an_answer_finished_after_grpclib_gave_up_is_a_deadline_miss_not_an_error(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """grpclib cancels the handler at the caller's deadline, but an assembly that cannot be
    interrupted (counting in a worker thread) still returns its answer to the handler.
    Finishing normally after grpclib's cancel made it log "Failed to handle cancellation"
    at error level for every such call under overload; it is a deadline miss (info)."""
    real = ContextService._assemble_in_trio

    async def slow(self: Any, request: Any, ticket: Any, *rest: Any) -> Any:
        result = await real(self, request, ticket, *rest)
        # The Trio task is cancelled while the thread runs, but reaches no checkpoint
        # after it: trio-asyncio hands the result to the cancelled asyncio task.
        await trio.to_thread.run_sync(time.sleep, 0.3)
        return result

    late = await call_patched(daemon, caplog, "_assemble_in_trio", slow, "50m")
    assert late["grpc-status"] == "4"  # DEADLINE_EXCEEDED
    assert _errors(caplog) == []
    assert "deadline_missed" in _events(caplog)


async def test_every_call_the_gate_lets_through_is_released(daemon: RunningDaemon) -> None:
    """The gate counts calls between their HEADERS and their handler's start (the CPU wait
    estimate depends on it); whatever becomes of a call, the count returns to zero."""
    state = daemon.daemon.admission
    await in_thread(raw_call, daemon.port, "5S")  # served
    await in_thread(raw_call, daemon.port, "1n")  # expired on arrival
    await in_thread(reset_then_call, daemon.port)  # reset in the same read, then served
    await in_thread(functools.partial(raw_call, send_body=False), daemon.port, "45m")  # no body
    # A malformed grpc-timeout is answered by grpclib without asking the gate: nothing
    # counted, so nothing to release (a release anyway drove the count below zero, and
    # a hostile caller repeating it would blind the CPU gate).
    bad = await in_thread(raw_call, daemon.port, "soon")
    assert bad.get("grpc-status") not in (None, "0")
    with trio.fail_after(10):
        while state.gated or state.in_flight:  # noqa: ASYNC110 (state of another loop)
            await trio.sleep(0.01)
    assert state.gated == 0 and state.in_flight == 0


async def test_what_the_edge_keeps_of_a_call_ends_with_its_stream(daemon: RunningDaemon) -> None:
    """The edge's facts about a call (path, deadline, the gate's release) live in a side
    table keyed weakly by grpclib's stream, never on grpclib's objects: whatever becomes of
    a call (served, expired, reset, refused), its entry goes once grpclib lets go of it."""
    recorded: list[weakref.ref[Any]] = []
    real = protocol_module.record

    def spy(stream: Any, call: Any) -> None:
        recorded.append(weakref.ref(stream))
        real(stream, call)

    with unittest.mock.patch.object(protocol_module, "record", spy):
        await in_thread(raw_call, daemon.port, "5S")
        await in_thread(raw_call, daemon.port, "1n")
        await in_thread(reset_then_call, daemon.port)
        await in_thread(functools.partial(raw_call, send_body=False), daemon.port, "45m")
    assert len(recorded) == 5
    state = daemon.daemon
    with trio.fail_after(10):
        while state.connections.count:  # noqa: ASYNC110 (another loop's state)
            await trio.sleep(0.01)
    assert state.server is not None
    state.server.__gc_collect__()  # grpclib's own sweep of closed connections' handlers
    gc.collect()
    assert [ref for ref in recorded if ref() is not None] == []


async def test_the_wall_is_anchored_at_the_calls_arrival(daemon: RunningDaemon) -> None:
    """The handler hands the assembly when the call's HEADERS were read (on the Trio
    clock), so the retrieval wall counts from there, not from when retrieval began."""
    seen: dict[str, Any] = {}
    real = Assembler.assemble_checked

    async def spy(self: Any, request: Any, **kw: Any) -> Any:
        seen.update(kw, now=trio.current_time())
        return await real(self, request, **kw)

    with unittest.mock.patch.object(Assembler, "assemble_checked", spy):
        answer = await in_thread(raw_call, daemon.port, "5S")
    assert answer["grpc-status"] == "0"
    assert seen["arrived"] is not None
    assert 0.0 <= seen["now"] - seen["arrived"] < 5.0
    # The deadline is the caller's grpc-timeout counted from that same arrival: one value
    # read from the HEADERS, not grpclib's (which counts from the handler's start).
    assert seen["deadline"] - seen["arrived"] == pytest.approx(5.0, abs=1e-6)


async def test_a_timeout_the_spec_does_not_allow_is_refused_from_its_headers(
    daemon: RunningDaemon,
) -> None:
    """grpc-timeout takes at most 8 digits: a 9-digit value is answered as grpclib answers
    any malformed timeout (UNKNOWN), trailers only, and never served on a deadline the
    gate did not read."""
    state = daemon.daemon.admission
    served = state.metrics.requests.labels("AssembleContext", "OK")._value.get()
    answer = await in_thread(raw_call, daemon.port, "123456789m")
    assert answer["grpc-status"] == "2"  # UNKNOWN
    assert answer["grpc-message"] == "Invalid grpc-timeout header"
    assert state.metrics.requests.labels("AssembleContext", "OK")._value.get() == served
    assert state.gated == 0


async def test_a_saturated_loop_refuses_assembly_but_never_health_or_reflection(
    daemon: RunningDaemon,
) -> None:
    """The CPU gate turns away, from its HEADERS, a call the saturated loop could not
    finish in time, as RESOURCE_EXHAUSTED; health probes and reflection always pass (a
    refused probe would take a busy worker out of rotation, or restart it)."""
    state = daemon.daemon.admission
    saved = state.cpu.utilisation, state.cpu.per_call, state.cpu.sample
    state.cpu.utilisation, state.cpu.per_call = 1.0, 10.0  # 10 s of CPU per call
    state.cpu.sample = lambda now: None  # type: ignore[method-assign]
    try:
        refused = await in_thread(raw_call, daemon.port, "5S")
        probe = await in_thread(
            grpcio_probe,
            daemon.target,
            f"{SERVICE}.AssembleContext",
            f"{SERVICE}.AssembleContext",
            "",
            SERVICE,
        )
    finally:
        state.cpu.utilisation, state.cpu.per_call, state.cpu.sample = saved
    assert refused["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
    assert refused["grpc-message"] == GATE_CPU_MESSAGE
    assert probe["health"] == {"": "SERVING", SERVICE: "SERVING"}
    assert SERVICE in probe["services"]
    assert state.metrics.shed_requests.labels("cpu")._value.get() == 1


def raw_calls_on_one_connection(port: int, n: int) -> tuple[list[dict[str, str]], int]:
    """n sequential calls on one h2 connection: each answer's headers and trailers, and
    how many entries the answers left in the client's HPACK dynamic table."""
    answers = []
    with _connected(port) as (sock, conn):
        for _ in range(n):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, _headers(port, "5S"))
            conn.send_data(stream, _request_frame(), end_stream=True)
            sock.sendall(conn.data_to_send())
            answers.append(_answer(sock, conn, stream))
    return answers, len(conn.decoder.header_table.dynamic_entries)


async def test_answers_leave_as_pre_encoded_header_blocks(daemon: RunningDaemon) -> None:
    # The daemon sends its response headers and trailers from static-table fields and
    # literals (hpack_block.header_block), not through h2's encoder, which would index
    # the x-ibex-* metadata into the caller's dynamic table.
    answers, indexed = await in_thread(raw_calls_on_one_connection, daemon.port, 3)
    for answer in answers:
        assert answer[":status"] == "200"
        assert answer["content-type"].startswith("application/grpc")
        assert answer["grpc-status"] == "0"
        assert answer["x-ibex-degradation"] in {"L0", "L1", "L2"}
        assert answer["x-ibex-branches"].startswith("directive=")
    assert indexed == 0


def split_call(port: int, pause: float, *, finish: bool) -> dict[str, str]:
    """HEADERS and the first half of the request; after `pause`, the rest with END_STREAM
    (or nothing, when not `finish`: a stalled caller). The trailers."""
    frame = _request_frame()
    with _connected(port) as (sock, conn):
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, _headers(port, "20S"))
        conn.send_data(stream, frame[: len(frame) // 2])
        sock.sendall(conn.data_to_send())
        time.sleep(pause)
        if finish:
            conn.send_data(stream, frame[len(frame) // 2 :], end_stream=True)
            sock.sendall(conn.data_to_send())
        return _answer(sock, conn, stream)


async def test_a_request_that_stalls_ends_at_the_read_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A caller that sends part of its request and stops holds nothing past the read
    timeout: DEADLINE_EXCEEDED (its own 20 s deadline is far off), logged at info."""
    async with running_daemon(request_read_timeout=0.3) as d:
        with caplog.at_level(logging.INFO):
            t0 = time.monotonic()
            stalled = await in_thread(split_call, d.port, 0.0, finish=False)
            took = time.monotonic() - t0
        assert stalled["grpc-status"] == "4"
        assert "not received within 0.3s" in stalled.get("grpc-message", "")
        assert took < 10  # the read timeout ended it, not the caller's deadline (20 s)
        assert "deadline_missed" in _events(caplog)
        assert _errors(caplog) == []
        assert d.daemon.admission.in_flight == 0


async def test_a_request_sent_in_two_parts_within_the_read_timeout_is_answered() -> None:
    """Only a request that arrived whole skips the read timer; one still arriving is read
    under it, to the end."""
    async with running_daemon(request_read_timeout=5.0) as d:
        answer = await in_thread(split_call, d.port, 0.05, finish=True)
    assert answer["grpc-status"] == "0"


async def test_only_a_request_still_arriving_arms_the_read_timer() -> None:
    """HEADERS and the whole body in one write leave nothing to wait for: no read timer
    (arming and cancelling one costs the loop two crossings per call). A request still
    arriving is read under one."""
    armed: list[float] = []
    real = asyncio.timeout

    def counting(delay: float | None) -> asyncio.Timeout:
        armed.append(delay or 0.0)
        return real(delay)

    async with running_daemon(request_read_timeout=5.0) as d:
        with unittest.mock.patch.object(handlers_module.asyncio, "timeout", counting):
            whole = await in_thread(raw_call, d.port, "5S")
            assert armed == []
            split = await in_thread(split_call, d.port, 0.05, finish=True)
    assert whole["grpc-status"] == "0"
    assert split["grpc-status"] == "0"
    assert armed == [5.0]
