"""A caller that ends its connection while its answer is being made: a caller gone, not INTERNAL.

Over a real socket (raw HTTP/2 with h2): the caller sends an AssembleContext
call, and once the daemon is making the answer it says GOAWAY and closes the
TCP connection, as a client does when it shuts down or gives up on a channel.
h2 then refuses anything more on that connection: sending the answer's
HEADERS raises its ProtocolError ("Invalid input ConnectionInputs.SEND_HEADERS
in state ConnectionState.CLOSED"), not the StreamClosedError a reset stream
gives. The caller is gone: the call ends CANCELLED, never an error-level
`handler_failed` counted INTERNAL.

The window is made deterministic without timing: the answer is held, after
the assembly's last checkpoint, in a worker thread until grpclib has handled
the caller's GOAWAY (so the cancel grpclib sends the handler cannot surface,
as when the GOAWAY lands right as the answer is due at the wall).
"""

from __future__ import annotations

import logging
import socket
import threading
import unittest.mock
from typing import Any

import grpclib.protocol
import h2.config
import h2.connection
import pytest
import trio

from ibex.ops.metrics import Metrics
from ibex.service.handlers import ContextService
from ibex.testing.grpc_harness import in_thread, running_daemon
from tests.integration.test_expired_deadline import _headers, _request_frame

WAIT = 10.0  # seconds any one step may take on a loaded machine


def call_then_leave(port: int, answering: threading.Event, finished: threading.Event) -> None:
    """Send one call; once the daemon is answering it, GOAWAY; close the connection once
    the call has finished (so the GOAWAY, not the connection's loss, ends it)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, _headers(port, "5S"))
        conn.send_data(stream, _request_frame(), end_stream=True)
        sock.sendall(conn.data_to_send())
        if not answering.wait(WAIT):
            raise TimeoutError("the daemon never started the answer")
        conn.close_connection()
        sock.sendall(conn.data_to_send())
        finished.wait(WAIT)


async def test_a_caller_that_leaves_mid_answer_is_a_caller_gone_not_internal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answering = threading.Event()  # the assembly is done, its answer about to be sent
    goaway_handled = threading.Event()  # grpclib has closed the connection's handlers
    codes: list[str] = []
    finished = threading.Event()

    real_assemble = ContextService._assemble_in_trio

    async def held(self: Any, *args: Any) -> Any:
        result = await real_assemble(self, *args)
        answering.set()
        # No checkpoint after this: trio-asyncio hands the result to the handler even
        # though grpclib cancelled it meanwhile (the answer was already due).
        await trio.to_thread.run_sync(goaway_handled.wait, WAIT)
        return result

    real_terminated = grpclib.protocol.EventsProcessor.process_connection_terminated

    def terminated(self: Any, event: Any) -> None:
        real_terminated(self, event)
        goaway_handled.set()

    real_observe = Metrics.observe_request

    def observe(self: Any, method: str, code: str, seconds: float) -> None:
        real_observe(self, method, code, seconds)
        if method == "AssembleContext":
            codes.append(code)
            finished.set()

    with (
        unittest.mock.patch.object(ContextService, "_assemble_in_trio", held),
        unittest.mock.patch.object(
            grpclib.protocol.EventsProcessor, "process_connection_terminated", terminated
        ),
        unittest.mock.patch.object(Metrics, "observe_request", observe),
        caplog.at_level(logging.INFO),
    ):
        async with running_daemon() as daemon:
            with trio.fail_after(3 * WAIT):
                await in_thread(call_then_leave, daemon.port, answering, finished)
    assert goaway_handled.is_set()
    assert codes == ["CANCELLED"]
    events = [getattr(r, "event", r.getMessage()) for r in caplog.records]
    assert "handler_failed" not in events
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
