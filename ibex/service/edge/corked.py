"""Writes of one loop iteration leave as one, and the moment an answer's last byte leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpclib.protocol

from ibex.service.edge.calls import call_of

__all__ = ["Answered", "CorkedTransport"]

Answered = Callable[[str, float], None]
"""Told a call's `:path` and the seconds from its HEADERS being read to its answer's last
byte (trailers, or a trailers-only refusal) being handed to the socket."""


class CorkedTransport:
    """A transport whose writes within one loop iteration go out as one.

    grpclib writes each HTTP/2 step as it happens: a unary answer is three
    writes (headers, data, trailers), three syscalls and three segments the
    client wakes for. Buffered until the end of the current loop iteration
    (`call_soon`), they leave as one, in order. Closing flushes first.

    The flush is also when an answer's last byte leaves the process: calls whose
    answer ended in the buffer (`answer_ends`) are reported to `answered` then.
    """

    __slots__ = (
        "_answered",
        "_buffer",
        "_done",
        "_earned",
        "_ended",
        "_flush_pending",
        "_loop",
        "_transport",
    )

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        answered: Answered | None = None,
        earned: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        self._earned = earned  # told of every answered call (`FrameGuard.earned`)
        self._done = False  # `last_words` said: later writes are dropped
        self._loop = loop  # writes also come from Trio tasks (GOAWAY), outside asyncio
        self._buffer: list[bytes] = []
        self._flush_pending = False
        self._answered = answered
        self._ended: list[tuple[str, float]] = []  # (path, HEADERS read) of answers buffered

    def answer_ends(self, path: str, arrived: float) -> None:
        """A call's answer ended in what was written since the last flush."""
        self._note_end(path, arrived)
        if self._answered is not None and not self._flush_pending:
            # A refusal h2 could not send still gets its report.
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _note_end(self, path: str, arrived: float) -> None:
        """Tell `earned` of an answered call and keep its report for the next flush."""
        if self._earned is not None:
            self._earned()
        if self._answered is not None:
            self._ended.append((path, arrived))

    def stream_answered(self, stream: grpclib.protocol.Stream) -> None:
        """`stream` sent its trailers (`ibex.patches.grpclib_h2`): its call's answer ended."""
        call = call_of(stream)
        if call is not None:
            self.answer_ends(call.path, call.deadline.arrived)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._done:
            return
        self._buffer.append(bytes(data))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def send_answer(self, data: bytes, stream: grpclib.protocol.Stream) -> None:
        """Send what is buffered and `data`, which ends `stream`'s answer, now rather than
        at the end of the loop iteration: an answer written from the Trio side
        (`send_reply_now`) has no asyncio iteration to wait for."""
        call = call_of(stream)
        if call is not None:
            self._note_end(call.path, call.deadline.arrived)
        if data and not self._done:
            self._buffer.append(bytes(data))
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        if self._buffer:
            data = b"".join(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
            self._buffer.clear()
            if not self._transport.is_closing():
                self._transport.write(data)
        if self._ended:
            ended, self._ended = self._ended, []
            if self._answered is not None and not self._transport.is_closing():
                now = time.monotonic()
                for path, arrived in ended:
                    self._answered(path, now - arrived)

    def close(self) -> None:
        if self._done:  # after `last_words` the socket is left to its abort timer
            return
        self._flush()
        self._transport.close()

    def last_words(self, data: bytes, raw: asyncio.BaseTransport | None) -> None:
        """Send what is buffered and `data`, and nothing after; then half-close (plain TCP:
        FIN once the bytes are out, while what the peer still sends is read and dropped)
        or close (TLS). A plain close with unread input would be a reset, which can
        destroy the GOAWAY on its way."""
        self.write(data)
        self._flush()
        self._done = True
        transport = self._transport
        if transport is raw and transport.can_write_eof() and not transport.is_closing():
            transport.write_eof()
        else:
            transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
