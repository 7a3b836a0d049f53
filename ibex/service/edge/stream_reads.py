"""Reading a call's request off its grpclib stream, bounded, and whether it has all
arrived.

grpclib (0.4) has no public way to bound a request's size before it is buffered,
nor to see whether the request was read to its end: these functions reach into
its private stream attributes (tests/integration/test_edge_bounds.py and
test_grpc_ops.py exercise them).
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable
from typing import Any

import grpclib.server

from ibex.errors import InputError, TooLargeError, Unimplemented

Reserve = Callable[[int], None]
"""Told each part of a request message before its bytes are read (may raise to refuse)."""

LOOK_AHEAD = 64 * 1024
"""The bytes a message not yet arrived reserves ahead of what it has sent: a prefix
declaring 4 MiB holds this much until its bytes come, not 4 MiB."""
Check = Callable[[bytes], None]
"""Shown a request message's bytes before they are decoded (may raise to refuse)."""


async def recv_bounded(
    stream: grpclib.server.Stream[Any, Any],
    limit: int,
    reserve: Reserve | None = None,
    check: Check | None = None,
) -> tuple[Any, int]:
    """The unary request message and its size in bytes, refused before it is buffered
    when over `limit` bytes.

    grpclib reads a whole message before decoding it and has no size cap, so
    this reads the 5-byte gRPC prefix itself and checks the declared length
    first; HTTP/2 flow control keeps the unread body bounded by the window.
    `reserve` hears each part before it is read, so the bytes are counted (toward
    the in-flight bytes) before they are buffered: the whole message when it has
    all arrived, else `LOOK_AHEAD` at a time as it arrives, so a declared length
    alone holds no more than one step.
    `check` sees the bytes before they are decoded (ibex.service.edge.wire_counts counts
    repeated fields there). It then does what `Stream.recv_message` does (decode,
    dispatch event).
    """
    message = await recv_next(stream, limit, reserve, check)
    if message is None:
        raise InputError("request", "no message")
    return message


async def recv_next(
    stream: grpclib.server.Stream[Any, Any],
    limit: int,
    reserve: Reserve | None = None,
    check: Check | None = None,
) -> tuple[Any, int] | None:
    """`recv_bounded` for a stream of request messages: None at the end of the stream."""
    inner = stream._stream
    meta = await inner.recv_data(5)
    if not meta:
        return None
    if len(meta) < 5:
        raise InputError("request", "truncated message")
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise Unimplemented("request: compressed messages are not supported")
    if length > limit:
        raise TooLargeError("request", f"message of {length} bytes exceeds the {limit}-byte limit")
    if reserve is None or length <= LOOK_AHEAD or request_complete(stream):
        if reserve is not None:
            reserve(length)
        data = await inner.recv_data(length)
    else:
        parts = []
        left = length
        while left:
            step = min(left, LOOK_AHEAD)
            reserve(step)
            part = await inner.recv_data(step)
            if len(part) != step:
                raise InputError("request", "truncated message")
            parts.append(part)
            left -= step
        data = b"".join(parts)
    if len(data) != length:
        raise InputError("request", "truncated message")
    if check is not None:
        check(data)
    try:
        message = stream._codec.decode(data, stream._recv_type)
    except Exception:
        raise InputError("request", "not a valid protobuf message") from None
    (message,) = await stream._dispatch.recv_message(message)
    stream._messages_received += 1
    inner.connection.messages_received += 1
    inner.connection.last_message_received = time.monotonic()
    return message, length


def reset_unread(stream: grpclib.server.Stream[Any, Any]) -> None:
    """After an answer to a request not read to its end: RST_STREAM(NO_ERROR), as grpc-go
    does, so the peer stops sending (what it sent is acknowledged and dropped)."""
    if not request_complete(stream):
        with contextlib.suppress(Exception):  # already closed or reset
            stream._stream.reset_nowait()


def connection_of(stream: grpclib.server.Stream[Any, Any]) -> object:
    """The HTTP/2 connection the call came on (a key for its byte share)."""
    return stream._stream.connection


def request_complete(stream: grpclib.server.Stream[Any, Any]) -> bool:
    """True when the caller's END_STREAM has been read: the whole request is buffered,
    so reading it cannot stall (and needs no timer)."""
    buffer = getattr(stream._stream, "buffer", None)
    return getattr(buffer, "_eof", False) is True
