"""Patches of the HTTP/2 stack's internals: grpclib, h2, hpack and hyperframe.

Each install function checks the versions it was written for (`ibex.versions`)
before it changes anything; nothing is applied at import.

- `answer_expired_deadlines` (grpclib): an already expired deadline answers
  DEADLINE_EXCEEDED instead of an internal error;
- `lighten_h2` (grpclib, h2, hpack, hyperframe): response headers from
  `ibex.patches.hpack_block`, and two per-frame debugging aids switched off;
- `count_open_streams_inline` (h2): the open-stream count that guards
  MAX_CONCURRENT_STREAMS, without two property calls per stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import grpclib.protocol
import grpclib.utils
import hpack.hpack
import hpack.table
from grpclib.metadata import Deadline
from h2.connection import H2Connection
from h2.exceptions import StreamClosedError
from h2.stream import STREAM_OPEN, StreamState
from hyperframe.frame import Frame

from ibex.patches.hpack_block import send_headers_fast
from ibex.versions import require

__all__ = ["answer_expired_deadlines", "count_open_streams_inline", "lighten_h2"]


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
    require("grpclib")
    grpclib.utils.DeadlineWrapper.start = _deadline_start  # type: ignore[method-assign]


async def _stream_send_headers(
    self: grpclib.protocol.Stream, headers: list[tuple[str, str]], end_stream: bool = False
) -> None:
    """grpclib's `Stream.send_headers` (0.4), with the headers from `send_headers_fast`;
    trailers also tell the transport, when it asks (`stream_answered`, the server's
    corked transport), that the stream's answer ended."""
    assert self.id is not None
    await self.connection.write_ready.wait()
    # grpclib's own workaround: h2 would try to create a stream it has forgotten.
    if self.id not in self._h2_connection.streams:
        raise StreamClosedError(self.id)
    h2 = self._h2_connection
    if not send_headers_fast(h2, self.id, headers, end_stream):
        h2.send_headers(self.id, headers, end_stream=end_stream)
    self._transport.write(h2.data_to_send())
    self.connection.headers_send_process()
    if end_stream:
        answered = getattr(self._transport, "stream_answered", None)
        if answered is not None:
            answered(self)


class _Silent:
    """A module logger that drops everything.

    hpack logs every header field it encodes or decodes at DEBUG (values
    included: bearer tokens, principals), through a real `logging.Logger`
    whose level check is on the path of every header (docs/performance.md).
    """

    __slots__ = ()

    def debug(self, *args: object, **kwargs: object) -> None:
        return None


def _short_frame_repr(frame: Frame) -> str:
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


def lighten_h2() -> None:
    """Send response headers from `header_block`, and take two debugging aids off
    h2's per-frame path (idempotent).

    h2's `send_headers` runs its general encoder for every answer's headers and
    trailers; `header_block` writes the same fields from a pre-encoded block.
    h2 formats `repr(frame)` for its no-op trace logger on every frame it
    receives, and hyperframe's repr re-serializes the frame body to show it; the
    repr here keeps the frame type and stream. hpack's loggers are silenced (see
    `_Silent`). What each saves: docs/performance.md.
    """
    require("grpclib", "h2", "hpack", "hyperframe")
    Frame.__repr__ = _short_frame_repr  # type: ignore[method-assign]
    grpclib.protocol.Stream.send_headers = _stream_send_headers  # type: ignore[method-assign]
    for module in (hpack.hpack, hpack.table):
        if isinstance(getattr(module, "log", None), logging.Logger):
            module.log = _Silent()  # type: ignore[attr-defined]


# --- h2's open-stream count ------------------------------------------------------------


def _open_streams(self: H2Connection, remainder: int) -> int:
    """h2's `H2Connection._open_streams` (4.x), the same walk with each stream's state
    read once instead of through its `open` and `closed` properties.

    h2 counts the open streams of one parity (and moves closed ones to
    `_closed_streams`) for every stream the peer opens, to enforce
    MAX_CONCURRENT_STREAMS: a walk over every stream the connection holds, so with
    many concurrent calls the two property calls per stream add up.
    """
    count = 0
    to_delete = []
    closed = StreamState.CLOSED
    for stream_id, stream in self.streams.items():
        state = stream.state_machine.state
        if STREAM_OPEN[state] and stream_id % 2 == remainder:
            count += 1
        elif state == closed:
            to_delete.append(stream_id)
    for stream_id in to_delete:
        stream = self.streams.pop(stream_id)
        self._closed_streams[stream_id] = stream.closed_by
    return count


def count_open_streams_inline() -> None:
    """Install `_open_streams` on h2's connection (idempotent)."""
    require("h2")
    H2Connection._open_streams = _open_streams  # type: ignore[method-assign]
