"""HTTP/2 flow control as the memory bound of request bytes nobody has read yet.

grpclib buffers a stream's DATA until the handler reads it and only then returns
the window (WINDOW_UPDATE), so what a peer can make the daemon hold unread is
what the daemon advertises: `STREAM_WINDOW` per stream, `CONNECTION_WINDOW` per
connection in all (grpclib's defaults are 4 MiB each). Envoy's edge guidance
uses 64 KiB per stream and 1 MiB per connection; the stream window here is
larger so a large request needs fewer round trips while its handler reads it.

A unary request is one message: `UnaryRequest` reads each prefix off the DATA
as it arrives and says when a peer sends past that message's end (more DATA
after a Health/Watch request, say). The protocol then resets the stream and
drops those bytes instead of buffering them (`protocol.TrackedProtocol`).
"""

from __future__ import annotations

import grpclib.config

STREAM_WINDOW = 256 * 1024
CONNECTION_WINDOW = 1024 * 1024


def grpclib_configuration() -> grpclib.config.Configuration:
    """grpclib's server configuration with the daemon's receive windows."""
    return grpclib.config.Configuration(
        http2_connection_window_size=CONNECTION_WINDOW,
        http2_stream_window_size=STREAM_WINDOW,
    )


class UnaryRequest:
    """Where a unary call's one request message ends, from its DATA as it arrives."""

    __slots__ = ("_left", "_prefix")

    def __init__(self) -> None:
        self._prefix = b""  # the 5-byte gRPC prefix, as it arrives
        self._left = -1  # bytes of the message still to come (-1: prefix incomplete)

    def past_end(self, data: bytes) -> bool:
        """True when `data` (the next DATA payload) carries bytes beyond the message."""
        size = len(data)
        if self._left < 0:
            take = min(5 - len(self._prefix), size)
            self._prefix += data[:take]
            size -= take
            if len(self._prefix) < 5:
                return False
            self._left = int.from_bytes(self._prefix[1:5], "big")
        if size > self._left:
            return True
        self._left -= size
        return False
