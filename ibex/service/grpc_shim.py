"""Everything that touches grpclib's private attributes, in one module.

grpclib (0.4) has no public way to bound a request's size before it is
buffered, to learn the bound port, or to stop accepting connections while
existing ones keep serving, nor to listen on a second port with the same
connection bookkeeping (so drain and close cover both). Each of those reaches
into a private attribute; they live here so a grpclib upgrade is checked in one place
(tests/integration/test_grpc_ops.py and test_client_balancing.py exercise them all).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import struct
import time
import weakref
from typing import Any

import grpclib.server

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


_EXTRA_LISTENERS: weakref.WeakKeyDictionary[grpclib.server.Server, list[asyncio.Server]] = (
    weakref.WeakKeyDictionary()
)


async def listen_also(
    server: grpclib.server.Server, host: str, port: int, *, ssl: _ssl.SSLContext | None = None
) -> int:
    """Accept connections on another port too (asyncio side), served like the first.

    The listener uses the server's own protocol factory, so its connections are
    tracked by `server.close()`/`wait_closed()` like any other; `stop_accepting`
    closes it with the main one. Returns the bound port.
    """
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(server._protocol_factory, host, port, ssl=ssl)
    _EXTRA_LISTENERS.setdefault(server, []).append(listener)
    return int(listener.sockets[0].getsockname()[1])


def stop_accepting(server: grpclib.server.Server) -> None:
    """Close the listening sockets; established connections keep serving."""
    if server._server is not None:
        server._server.close()
    for listener in _EXTRA_LISTENERS.pop(server, []):
        listener.close()
