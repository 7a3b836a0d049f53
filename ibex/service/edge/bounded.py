"""Health and reflection read their requests as the service does: bounded, timed, counted.

grpclib's Health and reflection services read a message with
`Stream.recv_message`, which buffers whatever length the prefix declares (up
to 4 GiB) for as long as the peer takes, before anyone has authenticated, and
outside the in-flight bytes. `BoundedReads` gives every method of a servable a
`recv_message` that refuses a declared length over its cap before reading the
body, counts the bytes as they arrive toward the unauthenticated pool
(`MAX_UNAUTHENTICATED_BYTES`, apart from `MAX_IN_FLIGHT_BYTES`), and
gives up after the read timeout; the stream is then answered and reset, so the
peer stops sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpclib.const
import grpclib.server

from ibex.errors import DeadlineError, IbexError, InputError
from ibex.service.admission import Admission
from ibex.service.edge.calls import handler_started
from ibex.service.edge.status import grpc_error
from ibex.service.edge.stream_reads import (
    connection_of,
    recv_next,
    request_complete,
    reset_unread,
)

HEALTH_MAX_MESSAGE_BYTES = 1024  # a HealthCheckRequest is one service name
REFLECTION_MAX_MESSAGE_BYTES = 64 * 1024  # a reflection request names one symbol or file


class BoundedReads:
    """A servable whose every method reads request messages of at most `limit` bytes."""

    def __init__(self, inner: Any, *, limit: int, admission: Admission) -> None:
        self._inner = inner
        self._limit = limit
        self._admission = admission

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

            stream.recv_message = recv_message  # type: ignore[method-assign]
            try:
                await func(stream)
            except IbexError as exc:
                error = grpc_error(exc)
                await stream.send_trailing_metadata(
                    status=error.status, status_message=error.message
                )
                reset_unread(stream)

        return run

    async def _read(self, stream: grpclib.server.Stream[Any, Any]) -> Any:
        """The next message (None at the end of the stream), within the read timeout."""
        admission = self._admission
        # Nobody is authenticated here: the bytes come from the unauthenticated pool.
        reservation = admission.unauthenticated.reservation(connection_of(stream))
        timeout = admission.config.read_timeout
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
