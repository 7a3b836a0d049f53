"""An AssembleContext answer is written from the Trio side, whole, or left to the handler.

Real daemon on a real socket, raw HTTP/2 (h2) as the caller. The answer is known on
the Trio side; its reply (HEADERS with the x-ibex metadata, the message, OK
trailers) is written there in one step (`send_reply_now`) when the connection can
take all of it at once. When the caller's flow-control window cannot take the
message, or an event listener of grpclib's awaits, nothing is written there: the
handler sends the reply as grpclib does, as the window opens. Either way the caller
gets the same complete answer and every count is made once.
"""

from __future__ import annotations

import asyncio
import struct
import unittest.mock
from collections.abc import Callable, Coroutine
from typing import Any

import h2.connection
import h2.events
import h2.settings
import pytest
import sniffio
import trio
from grpclib.events import SendTrailingMetadata, listen

import ibex.service.edge.crossing as crossing_module
from ibex.service.edge.corked import CorkedTransport
from ibex.testing.grpc_harness import RunningDaemon, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2
from tests.integration.test_expired_deadline import _connected, _headers, _request_frame, _text

WAIT = 10.0  # seconds a step may take on a loaded machine


def call(port: int, window: int | None = None) -> tuple[dict[str, str], bytes]:
    """One AssembleContext call; its headers and trailers, and its DATA. With `window`, the
    caller's stream window starts that small and opens once the first DATA arrives."""
    with _connected(port) as (sock, conn):
        if window is not None:
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, _headers(port, "5S"))
        conn.send_data(stream, _request_frame(), end_stream=True)
        sock.sendall(conn.data_to_send())
        fields: dict[str, str] = {}
        body = b""
        opened = window is None
        while "grpc-status" not in fields:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if getattr(event, "stream_id", None) != stream:
                    continue
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    fields.update((_text(k), _text(v)) for k, v in event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                    if not opened:
                        conn.increment_flow_control_window(1 << 20, stream_id=stream)
                        opened = True
            sock.sendall(conn.data_to_send())
        return fields, body


def message(body: bytes) -> Any:
    """The one length-prefixed gRPC message in `body`, decoded."""
    compressed, length = struct.unpack(">?I", body[:5])
    assert not compressed and len(body) == 5 + length
    return context_pb2.AssembleContextResponse.FromString(body[5:])


def spied() -> tuple[list[tuple[str, bool]], Callable[..., bool]]:
    """`send_reply_now` as the crossing calls it, noting where it ran and what it did."""
    seen: list[tuple[str, bool]] = []
    real = crossing_module.send_reply_now

    def spy(*args: Any) -> bool:
        done = real(*args)
        seen.append((sniffio.current_async_library(), done))
        return done

    return seen, spy


def tagging(awaits: bool, runs: list[str]) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """A trailers listener that tags the answer (after a yield to the loop when `awaits`)."""

    async def tag(event: Any) -> None:
        if awaits:
            await asyncio.sleep(0)
        event.metadata["x-test-tag"] = "seen"
        runs.append("tagged")

    return tag


def counts(daemon: RunningDaemon) -> tuple[float, float, float]:
    """Answers counted OK, answers timed to their last byte, assemblies counted."""
    registry = daemon.daemon.metrics.registry
    method = {"method": "AssembleContext"}
    return (
        registry.get_sample_value("ibex_grpc_requests_total", {**method, "code": "OK"}) or 0.0,
        registry.get_sample_value("ibex_answer_seconds_count", method) or 0.0,
        sum(
            registry.get_sample_value("ibex_degradation_total", {"level": level}) or 0.0
            for level in ("L0", "L1", "L2")
        ),
    )


async def answered(window: int | None, awaits: bool) -> tuple[Any, ...]:
    """One call to a fresh daemon with a trailers listener; what the caller got, where
    the reply was written, the listener's runs and the counts the call added."""
    seen, spy = spied()
    runs: list[str] = []
    async with running_daemon() as daemon:
        assert daemon.daemon.server is not None
        listen(daemon.daemon.server, SendTrailingMetadata, tagging(awaits, runs))
        before = counts(daemon)
        with (
            unittest.mock.patch.object(crossing_module, "send_reply_now", spy),
            trio.fail_after(3 * WAIT),
        ):
            fields, body = await in_thread(call, daemon.port, window)
            while counts(daemon)[0] == before[0]:  # noqa: ASYNC110 (the handler's end)
                await trio.sleep(0.01)
        added = tuple(a - b for a, b in zip(counts(daemon), before, strict=True))
    return fields, body, seen, runs, added


def assert_complete(fields: dict[str, str], body: bytes) -> None:
    assert fields[":status"] == "200"
    assert fields["content-type"].startswith("application/grpc")
    assert fields["x-ibex-degradation"] in {"L0", "L1", "L2"}
    assert fields["x-ibex-branches"].startswith("directive=")
    assert fields["grpc-status"] == "0"
    assert fields["x-test-tag"] == "seen"
    answer = message(body)
    assert answer.degradation_level == fields["x-ibex-degradation"]
    assert answer.assembled_context
    assert answer.tokens_used > 0
    assert [b.source for b in answer.branches] == ["directive", "hot", "cold"]


@pytest.mark.parametrize(
    ("window", "awaits", "written"),
    [
        pytest.param(None, False, True, id="written-whole-from-the-trio-side"),
        pytest.param(16, False, False, id="window-too-small-sent-by-the-handler-as-it-opens"),
        pytest.param(None, True, False, id="listener-that-awaits-leaves-it-to-the-handler"),
    ],
)
async def test_an_answer_reaches_its_caller_whole_and_counted_once(
    window: int | None, awaits: bool, written: bool
) -> None:
    fields, body, seen, runs, added = await answered(window, awaits)
    assert seen == [("trio", written)]
    assert_complete(fields, body)
    assert runs == ["tagged"]
    assert added == (1.0, 1.0, 1.0)  # ended OK, timed to its last byte, assembly counted


def ended(daemon: RunningDaemon) -> float:
    """AssembleContext calls counted, whatever their code."""
    registry = daemon.daemon.metrics.registry
    return sum(
        registry.get_sample_value(
            "ibex_grpc_requests_total", {"method": "AssembleContext", "code": code}
        )
        or 0.0
        for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL")
    )


async def test_an_answer_written_before_grpclib_cancels_its_handler_counts_as_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """grpclib can cancel a handler (its deadline timer) after the Trio side wrote the
    whole reply and before the handler woke. The caller has its answer: the call is
    counted OK, once, with no `deadline_missed` line."""
    real = crossing_module.send_reply_now
    cancelled: list[Any] = []
    async with running_daemon() as daemon:
        server: Any = daemon.daemon.server

        def write_then_cancel(*args: Any) -> bool:
            done = real(*args)
            for handler in server._handlers:  # grpclib's handler tasks, by stream
                for task in handler._tasks.values():
                    task.cancel()
                    cancelled.append(task)
            return done

        before, calls_before = counts(daemon), ended(daemon)
        with (
            unittest.mock.patch.object(crossing_module, "send_reply_now", write_then_cancel),
            trio.fail_after(3 * WAIT),
        ):
            fields, body = await in_thread(call, daemon.port)
            while ended(daemon) == calls_before:  # noqa: ASYNC110 (the handler's end)
                await trio.sleep(0.01)
        added = tuple(a - b for a, b in zip(counts(daemon), before, strict=True))
    assert cancelled
    assert fields["grpc-status"] == "0"
    assert message(body).assembled_context
    assert added == (1.0, 1.0, 1.0)  # ended OK, timed to its last byte, assembly counted
    assert "deadline_missed" not in caplog.text


async def test_a_reply_that_fails_to_leave_closes_its_connection_and_the_next_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Writing a reply can fail after h2 took it (HPACK's table then holds headers the
    caller never got, so nothing more on that connection could be read right). The
    connection is aborted: its caller sees it close at once instead of waiting out its
    deadline, and a new connection is served."""
    real = CorkedTransport.send_answer
    failed: list[int] = []

    def fail_once(self: CorkedTransport, data: bytes, stream: Any) -> None:
        if not failed:
            failed.append(len(data))
            raise RuntimeError("the write failed")
        real(self, data, stream)

    async with running_daemon() as daemon:
        with (
            unittest.mock.patch.object(CorkedTransport, "send_answer", fail_once),
            trio.fail_after(3 * WAIT),
        ):
            first, _ = await in_thread(call, daemon.port)
            second, body = await in_thread(call, daemon.port)
    assert failed
    assert "grpc-status" not in first  # closed, not answered
    assert second["grpc-status"] == "0"
    assert message(body).assembled_context
    assert "reply_failed" in caplog.text
