"""Health and reflection read their requests as the service does: bounded, timed, counted.

grpclib's Health and reflection services read a message with
`Stream.recv_message`, which buffers whatever length the prefix declares (up
to 4 GiB) for as long as the peer takes, before anyone has authenticated, and
outside the in-flight bytes. `BoundedReads` hands every method of a servable a
stream whose `recv_message` (and async iteration) refuses a declared length
over its cap before reading the body, counts the bytes as they arrive toward
the unauthenticated pool (`MAX_UNAUTHENTICATED_BYTES`, apart from
`MAX_IN_FLIGHT_BYTES`), and gives up after the read timeout; the stream is
then answered and reset, so the peer stops sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any, Protocol

import grpclib.const
import grpclib.server

from ibex.errors import DeadlineError, IbexError, InputError
from ibex.service.edge.calls import handler_started
from ibex.service.edge.status import grpc_error
from ibex.service.edge.stream_reads import (
    connection_of,
    recv_next,
    request_complete,
    reset_unread,
)

__all__ = [
    "HEALTH_MAX_MESSAGE_BYTES",
    "REFLECTION_MAX_MESSAGE_BYTES",
    "BoundedReads",
    "Held",
    "Reserve",
]

HEALTH_MAX_MESSAGE_BYTES = 1024  # a HealthCheckRequest is one service name
REFLECTION_MAX_MESSAGE_BYTES = 64 * 1024  # a reflection request names one symbol or file


class Held(Protocol):
    """Request bytes counted in flight while a message arrives (`ibex.service.budgets`)."""

    def grow(self, size: int) -> None:
        """Count `size` more bytes before they are read (raises to refuse them)."""

    def release(self) -> None:
        """Give back everything counted."""


Reserve = Callable[[Hashable], Held]
"""A connection's reservation of unauthenticated bytes (nobody has authenticated here)."""


class _BoundedStream:
    """grpclib's server stream as the wrapped method sees it: `recv_message` and async
    iteration read through `read`; everything else is the stream's own."""

    __slots__ = ("_read", "_stream")

    def __init__(self, stream: grpclib.server.Stream[Any, Any], read: Callable[[], Any]) -> None:
        self._stream = stream
        self._read = read

    async def recv_message(self) -> Any:
        return await self._read()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while (message := await self._read()) is not None:
            yield message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class BoundedReads:
    """A servable whose every method reads request messages of at most `limit` bytes,
    counted through `reserve` and read within `read_timeout` seconds."""

    def __init__(self, inner: Any, *, limit: int, reserve: Reserve, read_timeout: float) -> None:
        self._inner = inner
        self._limit = limit
        self._reserve = reserve
        self._read_timeout = read_timeout

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            name: h._replace(func=self._bounded(h.func, h.cardinality.client_streaming))
            for name, h in self._inner.__mapping__().items()
        }

    def _bounded(
        self, func: Callable[..., Any], streaming: bool
    ) -> Callable[[grpclib.server.Stream[Any, Any]], Any]:
        async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
            # Out of the gate's count of calls waiting to start: a Watch stream lives on,
            # and must not read as work ahead of every new call.
            handler_started(stream)

            async def recv_message() -> Any:
                message = await self._read(stream)
                if message is None and not streaming:
                    raise InputError("request", "no message")
                return message

            try:
                await func(_BoundedStream(stream, recv_message))
            except IbexError as exc:
                error = grpc_error(exc)
                await stream.send_trailing_metadata(
                    status=error.status, status_message=error.message
                )
                reset_unread(stream)

        return run

    async def _read(self, stream: grpclib.server.Stream[Any, Any]) -> Any:
        """The next message (None at the end of the stream), within the read timeout."""
        # Nobody is authenticated here: the bytes come from the unauthenticated pool.
        reservation = self._reserve(connection_of(stream))
        timeout = self._read_timeout
        try:
            if request_complete(stream):
                got = await recv_next(stream, self._limit, reservation.grow)
            else:
                async with asyncio.timeout(timeout):
                    got = await recv_next(stream, self._limit, reservation.grow)
        except TimeoutError:
            raise DeadlineError(f"request: not received within {timeout:g}s") from None
        finally:
            # A decoded Health or reflection request is a few bytes: counted while it arrives.
            reservation.release()
        return None if got is None else got[0]
