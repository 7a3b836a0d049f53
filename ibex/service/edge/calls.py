"""What the edge knows about each call beyond grpclib's stream, in a side table.

grpclib's streams have no room for ibex's facts about a call (its `:path`, its
`CallDeadline`, where its one request message ends, the gate's pending
release), so the protocol records them here as it reads the call's HEADERS,
keyed weakly by grpclib's HTTP/2 stream: an entry ends with its stream.

Nothing an entry holds may lead back to its stream, or the weak key would never
die: `gate_left`'s callback closes over the entry, not the stream, and
`authenticated` holds its connection's protocol (which holds the stream) weakly.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpclib.protocol
import grpclib.server

from ibex.service.edge.deadline import CallDeadline
from ibex.service.edge.flow import UnaryRequest

__all__ = [
    "EdgeCall",
    "call_deadline",
    "call_of",
    "caller_authenticated",
    "handler_started",
    "record",
]

GateLeft = Callable[[], None]
"""Called once for every call the gate admitted, when its handler starts or its task ends."""


@dataclass(slots=True, eq=False)
class EdgeCall:
    """One call as its connection's protocol read it."""

    path: str
    deadline: CallDeadline
    #: Tells the call's connection that a caller on it authenticated (`Connections`).
    authenticated: Callable[[], None]
    #: Where the call's one request message ends (None: a streaming method).
    request: UnaryRequest | None = None
    #: The gate's release, its task and the task's fallback callback, until the handler starts.
    gate_left: tuple[GateLeft, asyncio.Task[Any], Callable[[object], None]] | None = None

    def handler_started(self) -> None:
        """Release the gate's count (once): the handler runs, or its task ended without it."""
        pending, self.gate_left = self.gate_left, None
        if pending is not None:
            left, task, done = pending
            task.remove_done_callback(done)
            left()

    def hold_gate(self, left: GateLeft, task: asyncio.Task[Any]) -> None:
        """`left` is owed when the handler starts; if the task ends before, when it ends."""

        def done(_: object) -> None:
            if self.gate_left is not None:
                self.gate_left = None
                left()

        self.gate_left = (left, task, done)
        task.add_done_callback(done)


_CALLS: weakref.WeakKeyDictionary[grpclib.protocol.Stream, EdgeCall] = weakref.WeakKeyDictionary()


def record(stream: grpclib.protocol.Stream, call: EdgeCall) -> None:
    """Keep `call` for as long as grpclib's `stream` lives."""
    _CALLS[stream] = call


def call_of(stream: grpclib.protocol.Stream | grpclib.server.Stream[Any, Any]) -> EdgeCall | None:
    """The call on `stream` (grpclib's HTTP/2 stream, its server stream, or a wrapper of
    that holding it as `_stream`), or None when it did not come through the tracked
    protocol."""
    inner: Any = stream
    while not isinstance(inner, grpclib.protocol.Stream):
        inner = getattr(inner, "_stream", None)
        if inner is None:
            return None
    return _CALLS.get(inner)


def call_deadline(stream: grpclib.server.Stream[Any, Any]) -> CallDeadline:
    """The call's deadline as read from its HEADERS. A stream that did not come through the
    tracked protocol has no entry: its deadline is read from grpclib's, counted from now."""
    call = call_of(stream)
    if call is not None:
        return call.deadline
    left = None if stream.deadline is None else stream.deadline.time_remaining()
    return CallDeadline.after(left)


def caller_authenticated(stream: grpclib.server.Stream[Any, Any]) -> None:
    """A call on this stream's connection passed authentication (see `Connections`)."""
    call = call_of(stream)
    if call is not None:
        call.authenticated()


def handler_started(stream: grpclib.server.Stream[Any, Any]) -> None:
    """The handler of a call the gate let through now runs: it no longer waits to start.

    The task's fallback done callback is removed too, so a call costs the loop no
    extra callback when it ends.
    """
    call = call_of(stream)
    if call is not None:
        call.handler_started()
