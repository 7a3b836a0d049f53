"""Everything that touches grpclib's private attributes, in one module.

grpclib (0.4) has no public way to bound a request's size before it is
buffered, to learn the bound port, or to stop accepting connections while
existing ones keep serving. Each of those reaches into a private attribute;
they live here so a grpclib upgrade is checked in one place
(tests/integration/test_grpc_ops.py exercises every function below).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpclib.server
import grpclib.utils
from grpclib.metadata import Deadline

from ibex.errors import InputError, TooLargeError, Unimplemented


async def recv_bounded(stream: grpclib.server.Stream[Any, Any], limit: int) -> Any:
    """The unary request message, refused before it is buffered when over `limit` bytes.

    grpclib reads a whole message before decoding it and has no size cap, so
    this reads the 5-byte gRPC prefix itself and checks the declared length
    first; HTTP/2 flow control keeps the unread body bounded by the window.
    It then does what `Stream.recv_message` does (decode, dispatch event).
    """
    inner = stream._stream
    meta = await inner.recv_data(5)
    if len(meta) < 5:
        raise InputError("request", "no message")
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise Unimplemented("request: compressed messages are not supported")
    if length > limit:
        raise TooLargeError("request", f"message of {length} bytes exceeds the {limit}-byte limit")
    data = await inner.recv_data(length)
    if len(data) != length:
        raise InputError("request", "truncated message")
    try:
        message = stream._codec.decode(data, stream._recv_type)
    except Exception:
        raise InputError("request", "not a valid protobuf message") from None
    (message,) = await stream._dispatch.recv_message(message)
    stream._messages_received += 1
    inner.connection.messages_received += 1
    inner.connection.last_message_received = time.monotonic()
    return message


def bound_port(server: grpclib.server.Server) -> int:
    """The port the server listens on (after `start`, also when it asked for port 0)."""
    assert server._server is not None
    return int(server._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]


def stop_accepting(server: grpclib.server.Server) -> None:
    """Close the listening sockets; established connections keep serving."""
    if server._server is not None:
        server._server.close()


@contextmanager
def _deadline_start(self: grpclib.utils.DeadlineWrapper, deadline: Deadline) -> Iterator[None]:
    """grpclib's `DeadlineWrapper.start`, except that an already expired deadline cancels
    the call through the wrapper like any other: the caller gets DEADLINE_EXCEEDED and
    grpclib logs it at info. (Upstream raises TimeoutError before the wrapper is armed,
    which answers UNKNOWN "Internal Server Error" and logs "Timeout occurred" at error.)
    """
    timeout = max(0.0, deadline.time_remaining())

    def callback() -> None:
        self.cancel(TimeoutError("Deadline exceeded"))

    timer = asyncio.get_event_loop().call_later(timeout, callback)
    try:
        yield
    finally:
        timer.cancel()


def answer_expired_deadlines() -> None:
    """Install `_deadline_start` (idempotent; grpclib 0.4's DeadlineWrapper)."""
    grpclib.utils.DeadlineWrapper.start = _deadline_start  # type: ignore[method-assign]
