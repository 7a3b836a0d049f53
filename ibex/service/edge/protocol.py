"""grpclib's HTTP/2 protocol with ibex's connection handling: accept-time admission,
TLS counted from accept, write batching, the early-refusal gate, the Health/Watch cap,
the reset of DATA past a unary request (`flow`) and the two-step GOAWAY; and the
listeners that serve it.

grpclib (0.4) has no public way to learn the bound port, to stop accepting
connections while existing ones keep serving, to see and close its connections,
or to listen on a second port with the same connection bookkeeping (so drain
and close cover both). Each of those reaches into a private attribute of
grpclib's server or protocol (tests/integration/test_grpc_ops.py,
test_connections.py and test_client_balancing.py exercise every function here).
`ibex.service.edge.connections` decides what happens to each connection; this module
does it.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import ssl as _ssl
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal, cast

import grpclib.server
from grpclib.const import Status
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import H2Protocol
from h2.connection import H2Connection
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

from ibex.service.edge.calls import EdgeCall, GateLeft, call_of, record
from ibex.service.edge.connections import Connections
from ibex.service.edge.deadline import CallDeadline
from ibex.service.edge.flow import UnaryRequest
from ibex.service.edge.frame_guard import (
    CLOSE_CODES,
    ENHANCE_YOUR_CALM,
    FrameGuard,
    malformed,
    resets_in,
)
from ibex.service.edge.hpack_block import MAX_STREAM_ID, send_headers_fast

GOAWAY_PING = b"ibex-bye"  # 8 bytes of PING payload marking the drain's heads-up
FLOOD_ABORT_AFTER = 1.0  # seconds a flooding peer's socket may take to flush its GOAWAY


def bound_port(server: grpclib.server.Server) -> int:
    """The port the server listens on (after `start`, also when it asked for port 0)."""
    assert server._server is not None
    return int(server._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]


_EXTRA_LISTENERS: weakref.WeakKeyDictionary[grpclib.server.Server, list[asyncio.Server]] = (
    weakref.WeakKeyDictionary()
)


async def listen_also(
    server: grpclib.server.Server,
    host: str,
    port: int,
    *,
    ssl: _ssl.SSLContext | None = None,
    reuse_port: bool = False,
) -> int:
    """Accept connections on another port too (asyncio side), served like the first.

    The listener uses the server's own protocol factory, so its connections are
    tracked by `server.close()`/`wait_closed()` like any other; `stop_accepting`
    closes it with the main one. With `reuse_port` (SO_REUSEPORT) another process
    can bind the same port while this one listens: a reload's new worker takes
    the port over before the old one stops accepting. Returns the bound port.
    """
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(
        server._protocol_factory, host, port, ssl=ssl, reuse_port=reuse_port or None
    )
    _EXTRA_LISTENERS.setdefault(server, []).append(listener)
    return int(listener.sockets[0].getsockname()[1])


def stop_accepting(server: grpclib.server.Server) -> None:
    """Close the listening sockets; established connections keep serving."""
    if server._server is not None:
        server._server.close()
    for listener in _EXTRA_LISTENERS.pop(server, []):
        listener.close()


def refusal_headers(status: int, message: str) -> list[tuple[str, str]]:
    """A trailers-only answer's headers."""
    return [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", str(status)),
        ("grpc-message", encode_grpc_message(message)),
    ]


def send_refusal(h2: H2Connection, stream_id: int, status: int, message: str) -> None:
    """Answer a just-opened stream trailers-only (HEADERS with END_STREAM).

    From `header_block` when it can: under overload h2's per-call header encoding
    was a quarter of what a refusal cost. Raises h2's ProtocolError when the
    stream is gone (e.g. reset by the caller).
    """
    headers = refusal_headers(status, message)
    if not send_headers_fast(h2, stream_id, headers, True):
        h2.send_headers(stream_id, headers, end_stream=True)


Gate = Callable[[str, CallDeadline], str | None]
"""(method path, the call's deadline) -> a refusal message, or None to admit."""

GateVerdict = Literal["refused", "admitted", "unasked"]

#: grpclib's answer to a malformed `grpc-timeout`, given here from the HEADERS.
BAD_TIMEOUT_MESSAGE = "Invalid grpc-timeout header"

Answered = Callable[[str, float], None]
"""Told a call's `:path` and the seconds from its HEADERS being read to its answer's last
byte (trailers, or a trailers-only refusal) being handed to the socket."""


def track_connections(
    server: grpclib.server.Server,
    connections: Connections,
    gate: Gate | None = None,
    gate_left: GateLeft | None = None,
    *,
    ssl: _ssl.SSLContext | None = None,
    answered: Answered | None = None,
) -> None:
    """Route every connection `server` accepts through `connections` (call before `start`).

    `Server.start` builds protocols with `self._protocol_factory`; an instance
    attribute of that name wins over the method, so each accepted socket gets a
    `_TrackedProtocol` carrying the same grpclib handler. `gate` is asked about
    every new call before grpclib starts a task for it (see `_ask_gate`);
    `gate_left` hears once for each call it let through, when the handler starts
    (`handler_started`) or, if it never does, when the call's task ends.
    `answered` hears how long each answered call took on the server, from its
    HEADERS to its last byte written (see `_CorkedTransport.answer_ends`).

    With `ssl`, TLS is done here (start the server and `listen_also` without it):
    asyncio's own TLS calls the protocol only once the handshake is done, so a
    stalled handshake would hold an fd uncounted, for asyncio's 60 s. Here the
    connection counts from accept and the handshake has
    `connections.config.tls_handshake_timeout`.
    """
    original = server._protocol_factory

    def factory() -> asyncio.BaseProtocol:
        base = original()
        tracked = _TrackedProtocol(
            base.handler, base.config, base.h2_config, connections, gate, gate_left, answered
        )
        if ssl is None:
            return tracked
        return _TlsAccept(
            asyncio.get_running_loop(),
            tracked,
            ssl,
            connections.config.tls_handshake_timeout,
        )

    server._protocol_factory = factory  # type: ignore[method-assign,assignment]


class _TlsAccept(asyncio.sslproto.SSLProtocol):
    """asyncio's server-side TLS protocol, counting its connection from accept."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tracked: _TrackedProtocol,
        context: _ssl.SSLContext,
        handshake_timeout: float,
    ) -> None:
        # No waiter (nobody awaits the handshake here); typeshed's types are narrower
        # than asyncio's (a float timeout is fine).
        super().__init__(
            loop,
            tracked,
            context,
            None,  # type: ignore[arg-type]
            server_side=True,
            ssl_handshake_timeout=handshake_timeout,  # type: ignore[arg-type]
        )
        self._tracked = tracked
        self._refused_at_accept = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._tracked.accept(transport):
            self._refused_at_accept = True
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._tracked.forget()  # also when the handshake never finished
        if not self._refused_at_accept:
            super().connection_lost(exc)


class _CorkedTransport:
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
        if self._earned is not None:
            self._earned()
        if self._answered is not None:
            self._ended.append((path, arrived))
            if not self._flush_pending:  # a refusal h2 could not send still gets its report
                self._flush_pending = True
                self._loop.call_soon(self._flush)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._done:
            return
        self._buffer.append(bytes(data))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

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


class _TrackedProtocol(H2Protocol):
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
        self._corked: _CorkedTransport | None = None
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
        corked = _CorkedTransport(
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
