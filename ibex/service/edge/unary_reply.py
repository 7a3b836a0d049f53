"""A unary call's whole reply (HEADERS, its message, OK trailers) written in one synchronous step.

grpclib sends a reply in three awaited steps from the handler's asyncio task, and
the corked transport sends their bytes at the end of that loop iteration. An
answer ready on the Trio side would take two more passes of the scheduler to leave
that way: one to wake the handler's task, one for the cork's flush. Under
trio-asyncio the asyncio loop runs inside Trio, so the same h2 calls and the
transport write can be made from a Trio task, synchronously: `send_reply_now` does
what grpclib's `send_initial_metadata`, `send_message` and `send_trailing_metadata`
do (its events dispatched, its counters and flags set), in one step, and the bytes
leave at once.

It writes only when nothing can stop the whole reply: the handler has sent nothing,
the connection can be written, the HTTP/2 stream can still send, and the flow-control
window takes the whole message now. Otherwise it writes nothing and says so; the
handler then sends as grpclib does, waiting for the window if it must. It drives
private parts of grpclib's server stream (0.4, whose version
`ibex.patches.grpclib_h2` checks) and h2's connection.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Mapping
from typing import Any

import grpclib.server
from grpclib.const import Status
from grpclib.metadata import encode_metadata
from h2.connection import ConnectionState
from h2.stream import StreamState
from multidict import MultiDict

from ibex.patches.hpack_block import send_headers_fast

__all__ = ["reply_finished", "send_reply", "send_reply_now"]

_CAN_SEND = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE)
_OK = str(Status.OK.value)


class _Suspended(Exception):
    """An event listener awaited something: it cannot run in one synchronous step."""


def _run_now(step: Coroutine[Any, Any, Any]) -> Any:
    """The value of a coroutine that finishes without suspending (grpclib's event
    dispatch: a no-op, or listeners that only edit the event); `_Suspended` otherwise."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise _Suspended


async def send_reply(
    stream: grpclib.server.Stream[Any, Any], metadata: Mapping[str, str], message: Any
) -> None:
    """The reply's HEADERS (with `metadata`) and message, as grpclib sends them; its
    trailers follow when the handler ends."""
    await stream.send_initial_metadata(metadata=metadata)
    await stream.send_message(message)


def reply_finished(stream: grpclib.server.Stream[Any, Any]) -> bool:
    """Whether the reply's trailers were sent: for the caller the call is over, whatever
    happens to the handler after (grpclib may still cancel it at the deadline)."""
    return bool(getattr(stream, "_send_trailing_metadata_done", False))


def send_reply_now(
    stream: grpclib.server.Stream[Any, Any], metadata: Mapping[str, str], message: Any
) -> bool:
    """Write the whole reply to `stream` now, synchronously, or nothing (False).

    Callable from any task of the Trio run the asyncio loop runs in. True: the
    reply's bytes were handed to the socket, and the stream is marked as having
    sent its headers, message and trailers, so grpclib sends nothing more for it.
    When it writes nothing, grpclib's SendInitialMetadata and SendMessage events have
    been dispatched already and are dispatched again as the handler sends (the
    daemon listens to neither; a listener that must run once belongs on trailers).
    A failure after h2 has taken the reply aborts the connection and raises: h2's
    state (HPACK's table included) then holds bytes the peer never gets.
    """
    s: Any = stream
    if (
        s._send_initial_metadata_done
        or s._send_message_done
        or s._send_trailing_metadata_done
        or s._cancel_done
        or s._cardinality.server_streaming
    ):
        return False
    h2_stream = s._stream
    connection = h2_stream.connection
    transport = h2_stream._transport
    h2 = h2_stream._h2_connection
    stream_id = h2_stream.id
    if (
        stream_id is None
        or not connection.write_ready.is_set()
        or transport.is_closing()
        or h2.state_machine.state is ConnectionState.CLOSED
    ):
        return False
    state = h2.streams.get(stream_id)
    if state is None or state.state_machine.state not in _CAN_SEND:
        return False
    try:
        (initial,) = _run_now(s._dispatch.send_initial_metadata(MultiDict(metadata)))
        (message,) = _run_now(s._dispatch.send_message(message))
        encoded = s._codec.encode(message, s._send_type)
        data = b"\x00" + len(encoded).to_bytes(4, "big") + encoded
        if h2.local_flow_control_window(stream_id) < len(data):
            return False  # the handler sends it as the window opens
        (trailing,) = _run_now(
            s._dispatch.send_trailing_metadata(
                MultiDict(), status=Status.OK, status_message=None, status_details=None
            )
        )
    except _Suspended:
        return False
    headers = [(":status", "200"), ("content-type", s._content_type), *encode_metadata(initial)]
    trailers = [("grpc-status", _OK), *encode_metadata(trailing)]
    if not send_headers_fast(h2, stream_id, headers, False):
        h2.send_headers(stream_id, headers)
    connection.headers_send_process()
    frame = h2.max_outbound_frame_size
    for start in range(0, len(data), frame):
        chunk = data[start : start + frame]
        h2.send_data(stream_id, chunk)
        h2_stream.data_sent += len(chunk)
        connection.data_sent += len(chunk)
        connection.data_send_process()
    if not send_headers_fast(h2, stream_id, trailers, True):
        h2.send_headers(stream_id, trailers, end_stream=True)
    connection.headers_send_process()
    s._send_initial_metadata_done = True
    s._send_message_done = True
    s._messages_sent += 1
    connection.messages_sent += 1
    connection.last_message_sent = time.monotonic()
    s._send_trailing_metadata_done = True
    out = h2.data_to_send()
    answer = getattr(transport, "send_answer", None)  # the server's corked transport
    try:
        if answer is not None:
            answer(out, h2_stream)
        else:
            transport.write(out)
    except BaseException:
        transport.abort()
        raise
    return True
