"""grpclib's HTTP/2 protocol with ibex's connection handling: accept-time admission,
the HEADERS read once (path and `CallDeadline`, kept in `calls`), the early-refusal
gate, the Health/Watch cap, the reset of DATA past a unary request (`flow`), flood
closing (`frame_guard`) and the two-step GOAWAY.

`ibex.service.edge.connections` decides what happens to each connection; this module
does it on grpclib's protocol, whose private attributes it reads (`processor`,
`connection._connection`): grpclib (0.4) has no public hook for any of it
(tests/integration/test_connections.py, test_http2_attacks.py and
test_expired_deadline.py exercise it). `listeners` installs it on a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal, cast

from grpclib.const import Status
from grpclib.protocol import H2Protocol
from h2.errors import ErrorCodes
from h2.events import (
    DataReceived,
    PingAckReceived,
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamReset,
)
from h2.exceptions import ProtocolError, TooManyStreamsError
from hyperframe.frame import GoAwayFrame

from ibex.patches.hpack_block import MAX_STREAM_ID
from ibex.service.edge.calls import EdgeCall, GateLeft, call_of, record
from ibex.service.edge.connections import Connections
from ibex.service.edge.corked import Answered, CorkedTransport
from ibex.service.edge.deadline import CallDeadline
from ibex.service.edge.flow import UnaryRequest
from ibex.service.edge.frame_guard import (
    CLOSE_CODES,
    ENHANCE_YOUR_CALM,
    FrameGuard,
    malformed,
    resets_in,
)
from ibex.service.edge.refusal import BAD_TIMEOUT_MESSAGE, send_refusal

GOAWAY_PING = b"ibex-bye"  # 8 bytes of PING payload marking the drain's heads-up
GOAWAY_CONFIRM_PING = b"ibex-by2"  # the drain's second PING (see `connections`)
FLOOD_ABORT_AFTER = 1.0  # seconds a flooding peer's socket may take to flush its GOAWAY

Gate = Callable[[str, CallDeadline], str | None]
"""(method path, the call's deadline) -> a refusal message, or None to admit."""

GateVerdict = Literal["refused", "admitted", "unasked"]

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
MAX_WATCHES_PER_CONNECTION = 4
WATCH_CAP_MESSAGE = "too many Health/Watch streams on this connection"


def _peer_ip(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


def _path(event: RequestReceived) -> str:
    for name, value in event.headers or ():
        if name in (b":path", ":path"):
            return value.decode() if isinstance(value, bytes) else value
    return ""


def _deadline(event: RequestReceived, arrived: float) -> CallDeadline | None:
    """The call's deadline, counted from `arrived`; None for a malformed `grpc-timeout`."""
    try:
        return CallDeadline.from_headers(event.headers or (), arrived)
    except ValueError:
        return None


def _abort(transport: asyncio.BaseTransport) -> None:
    """Drop a socket whose close is still waiting on its peer (a no-op once it is gone)."""
    cast(asyncio.Transport, transport).abort()


class TrackedProtocol(H2Protocol):
    """grpclib's protocol plus admission, activity reports and a two-step GOAWAY."""

    _refused = False
    _raw: asyncio.BaseTransport | None = None  # the accepted socket's transport
    _last_stream_id: int | None = None  # set by the final GOAWAY: later streams are refused

    def __init__(
        self,
        handler: Any,
        config: Any,
        h2_config: Any,
        connections: Connections,
        gate: Gate | None = None,
        gate_left: GateLeft | None = None,
        answered: Answered | None = None,
    ):
        super().__init__(handler, config, h2_config)
        self._connections = connections
        self._gate = gate
        self._gate_left = gate_left
        self._answered = answered
        self._corked: CorkedTransport | None = None
        self._watches: set[int] = set()  # open Health/Watch streams
        self._guard = FrameGuard()
        self._guard.authenticated = lambda: connections.is_authenticated(self)
        self._flooded = False  # closed for a flood: what else arrives is dropped
        # Each call's hook to tell this connection its caller authenticated. It holds the
        # protocol weakly: the protocol holds the call's stream, and a side-table entry
        # that led back to its stream would never end (`calls`).
        this = weakref.ref(self)

        def authenticated() -> None:
            protocol = this()
            if protocol is not None:
                protocol._connections.authenticated(protocol)

        self._authenticated = authenticated
        self._write_paused = False  # the peer is not reading what was sent

    def accept(self, transport: asyncio.BaseTransport) -> bool:
        """Count the connection from accept (before a TLS handshake); False: closed at once."""
        self._raw = transport
        if not self._connections.admit(self, _peer_ip(transport)):
            # No room: release the fd at once, before any TLS or HTTP/2 work.
            self._refused = True
            self.handler.close()  # lets grpclib forget the handler
            cast(asyncio.Transport, transport).abort()
            return False
        return True

    def forget(self) -> None:
        """The socket is gone; if HTTP/2 never started (a TLS handshake that did not finish),
        grpclib is told too, else it would keep the connection's handler."""
        if self._refused:
            return
        self._connections.closed(self)
        if getattr(self, "processor", None) is None:
            self.handler.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._raw is None and not self.accept(transport):
            return
        corked = CorkedTransport(
            cast(asyncio.Transport, transport),
            asyncio.get_running_loop(),
            self._answered,
            self._guard.earned,
        )
        self._corked = corked
        super().connection_made(cast(asyncio.Transport, corked))

    def data_received(self, data: bytes) -> None:
        if self._refused or self._flooded:
            return
        flood = self._guard.scan(data)  # offending frames are counted before h2 reads them
        if flood is not None:
            self._close_flooded(flood)
            return
        # grpclib's own body, with hooks on the events (see its H2Protocol.data_received).
        try:
            events = self.connection.feed(data)
        except ProtocolError as exc:
            # h2 queued a GOAWAY naming the error: it is sent before the socket closes.
            reason = "protocol_error"
            if isinstance(exc, TooManyStreamsError):  # past the 100 streams advertised
                reason = "too_many_streams"
            elif "continuation" in str(exc).lower():  # h2: 64 CONTINUATION frames a block
                reason = "continuation_flood"
            self._close_flooded(reason, self.connection._connection.data_to_send())
            return
        h2 = self.connection._connection
        flood = self._guard.offend("reset_flood", resets_in(h2._data_to_send))
        if flood is not None:
            self._close_flooded(flood)
            return
        self.connection.flush()
        now = time.monotonic()
        replies = 0  # frames the peer wants answered (a call, a PING, SETTINGS)
        for event in events:
            if isinstance(event, RequestReceived):
                replies += 1
                if malformed(event.headers):  # CVE-2019-9516: never served
                    with contextlib.suppress(ProtocolError):
                        h2.reset_stream(event.stream_id, ErrorCodes.PROTOCOL_ERROR)
                    flood = self._guard.offend("empty_headers")
                    if flood is not None:
                        self._close_flooded(flood)
                        return
                    continue
                if self._refuse(event.stream_id):
                    with contextlib.suppress(ProtocolError):  # reset by the client already
                        h2.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
                    continue
                path = _path(event)
                if path == HEALTH_WATCH and not self._watch(event.stream_id):
                    with contextlib.suppress(ProtocolError):
                        send_refusal(
                            h2, event.stream_id, Status.RESOURCE_EXHAUSTED.value, WATCH_CAP_MESSAGE
                        )
                    continue
                deadline = _deadline(event, now)
                verdict = self._ask_gate(event, path, deadline)
                if verdict == "refused":
                    if self._corked is not None:  # answered trailers-only, just now
                        self._corked.answer_ends(path, now)
                    continue
                self.processor.process(event)
                # The call's deadline counts from here: its handler task runs later, behind
                # everything else the loop has to do, and that wait is queueing. Its path
                # goes with it, for the answer's time (`answer_ends`).
                stream = self.processor.streams.get(event.stream_id)
                call = None
                if stream is not None and deadline is not None:
                    call = EdgeCall(path, deadline, self._authenticated)
                    if self._unary_request(path):
                        call.request = UnaryRequest()
                    record(stream, call)
                if verdict == "admitted":
                    self._track_gated(stream, call)
                continue
            if isinstance(event, DataReceived) and self._past_request(event):
                continue
            if isinstance(event, PingAckReceived) and event.ping_data == GOAWAY_PING:
                self._connections.acked(self)
            elif isinstance(event, PingAckReceived) and event.ping_data == GOAWAY_CONFIRM_PING:
                # Streams in this same read were counted by h2 already (feed() ran first):
                # the final GOAWAY's last-stream-id includes them.
                self._connections.confirmed(self)
            elif isinstance(event, (PingReceived, RemoteSettingsChanged)):
                replies += 1
            self.processor.process(event)
        self.connection.flush()
        if self._write_paused and replies:
            flood = self._guard.offend("unread_output", replies)
            if flood is not None:
                self._close_flooded(flood)
                return
        self._connections.active(self)

    def _close_flooded(self, reason: str, goaway: bytes | None = None) -> None:
        """Send GOAWAY (`goaway`, else one with the reason's code) as the last frame, and
        abort the socket `FLOOD_ABORT_AFTER` later (the peer may not be reading at all);
        nothing more it sends is read. Its calls end at once."""
        self._flooded = True
        self._connections.flood_closed(self, reason)
        corked = self._corked
        if corked is None or self.connection.is_closing():
            self.processor.close("Connection closed: " + reason)
            return
        if goaway is None:
            self.connection.flush()
            goaway = GoAwayFrame(
                stream_id=0,
                last_stream_id=self.connection._connection.highest_inbound_stream_id,
                error_code=CLOSE_CODES.get(reason, ENHANCE_YOUR_CALM),
            ).serialize()
        corked.last_words(goaway, self._raw)
        raw = self._raw
        if raw is not None:
            asyncio.get_running_loop().call_later(FLOOD_ABORT_AFTER, _abort, raw)
        self.processor.close("Connection closed: " + reason)  # its calls end now

    def pause_writing(self) -> None:
        self._write_paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        super().resume_writing()

    def _ask_gate(
        self, event: RequestReceived, path: str, deadline: CallDeadline | None
    ) -> GateVerdict:
        """ "refused" (answered trailers only before grpclib starts a task for the call:
        RESOURCE_EXHAUSTED by the gate, or grpclib's own UNKNOWN for a malformed
        `grpc-timeout`), "admitted" (the gate counted it: `gate_left` must follow), or
        "unasked" (no gate).

        Under overload most of a refusal's cost is grpclib's per-call machinery
        (a Stream, a task, the handler, reading the message); a call the gate
        turns away here costs one HEADERS frame. Its request body, if still to
        come, is acknowledged and dropped by grpclib as for any unknown stream.
        """
        if event.stream_id is None:
            return "unasked"
        status = Status.RESOURCE_EXHAUSTED
        if deadline is None:  # the one reading of grpc-timeout refused it: never served
            status, message = Status.UNKNOWN, BAD_TIMEOUT_MESSAGE
        elif self._gate is None:
            return "unasked"
        else:
            gated = self._gate(path, deadline)
            if gated is None:
                return "admitted"
            message = gated
        # The caller may have reset the stream in the same read (its deadline passed
        # while the request sat in the socket buffer, common under overload): h2 then
        # no longer knows the stream and raises. There is nobody left to answer, and
        # letting the error out would have the loop close the whole connection,
        # failing every other call on it.
        with contextlib.suppress(ProtocolError):
            send_refusal(
                self.connection._connection,
                event.stream_id,
                status.value,
                message,
            )
        return "refused"

    def _track_gated(self, stream: Any, call: EdgeCall | None) -> None:
        """Hand `gate_left` to the call the gate just let through: its handler calls it on
        start (`handler_started`); a task cancelled before it ran calls it when done."""
        left = self._gate_left
        if left is None:
            return
        tasks = getattr(self.handler, "_tasks", {})  # grpclib's Handler: stream -> task
        task = tasks.get(stream) if stream is not None else None
        if task is None or call is None:  # grpclib answered it without a task (it cannot today)
            left()
            return
        call.hold_gate(left, task)

    def _unary_request(self, path: str) -> bool:
        """The method at `path` takes one request message (every method but reflection's)."""
        method = getattr(self.handler, "mapping", {}).get(path)
        return method is not None and not method.cardinality.client_streaming

    def _past_request(self, event: DataReceived) -> bool:
        """DATA past the end of a unary call's one request message: the stream is reset
        (PROTOCOL_ERROR), its handler cancelled, and the bytes dropped, not buffered. Their
        connection window is returned; the stream gets no more (`flow`)."""
        stream = self.processor.streams.get(event.stream_id)
        call = None if stream is None else call_of(stream)
        request = None if call is None else call.request
        if request is None or not request.past_end(event.data or b""):
            return False
        h2 = self.connection._connection
        with contextlib.suppress(ProtocolError):
            h2.reset_stream(event.stream_id, ErrorCodes.PROTOCOL_ERROR)
        with contextlib.suppress(ProtocolError):  # after the reset: the connection's only
            h2.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
        reset = StreamReset(
            stream_id=event.stream_id, error_code=ErrorCodes.PROTOCOL_ERROR, remote_reset=False
        )
        with contextlib.suppress(KeyError):  # its task has ended already
            self.processor.process(reset)  # grpclib's own path: terminate, cancel the task
        return True

    def _watch(self, stream_id: int | None) -> bool:
        """Count a new Health/Watch stream; False when the connection has its cap of them."""
        if stream_id is None:
            return True
        self._watches.intersection_update(self.processor.streams)
        if len(self._watches) >= MAX_WATCHES_PER_CONNECTION:
            return False
        self._watches.add(stream_id)
        return True

    def _refuse(self, stream_id: int | None) -> bool:
        return (
            self._last_stream_id is not None
            and stream_id is not None
            and stream_id > self._last_stream_id
        )

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._connections.closed(self)
        if getattr(self, "processor", None) is None:  # the TLS handshake never finished
            self.handler.close()
            return
        super().connection_lost(exc)

    # -- the `connections.Conn` interface ------------------------------------------------------

    def open_streams(self) -> int:
        """Calls in progress; an open Health/Watch stream is not one."""
        processor = getattr(self, "processor", None)
        if processor is None:
            return 0
        streams = processor.streams
        if self._watches:
            self._watches.intersection_update(streams)
            return len(streams) - len(self._watches)
        return len(streams)

    def _write_goaway(self, last_stream_id: int) -> None:
        # Not h2's close_connection: that moves h2 to CLOSED, after which the
        # in-flight streams could not send their responses.
        if self.connection.is_closing():
            return
        self.connection.flush()
        frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0)
        self.connection._transport.write(frame.serialize())

    def goaway_heads_up(self) -> None:
        self._write_goaway(MAX_STREAM_ID)
        if not self.connection.is_closing():
            self.connection._connection.ping(GOAWAY_PING)
            self.connection.flush()

    def goaway_confirm(self) -> None:
        if not self.connection.is_closing():
            self.connection._connection.ping(GOAWAY_CONFIRM_PING)
            self.connection.flush()

    def goaway_final(self) -> None:
        self._last_stream_id = self.connection._connection.highest_inbound_stream_id
        self._write_goaway(self._last_stream_id)

    def close_idle(self) -> None:
        if getattr(self, "connection", None) is None:
            self.close()
            return
        if not self.connection.is_closing():
            self.connection._connection.close_connection()
            self.connection.flush()
        self.close()

    def close(self) -> None:
        if getattr(self, "connection", None) is None:  # still in its TLS handshake
            if self._raw is not None and not self._raw.is_closing():
                cast(asyncio.Transport, self._raw).abort()
            return
        if not self.connection.is_closing():
            self.connection._transport.close()
