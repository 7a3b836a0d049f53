"""The gRPC port's listeners: every accepted connection goes through the tracked protocol.

grpclib (0.4) has no public way to learn the bound port, to stop accepting
connections while existing ones keep serving, to see its connections, or to
listen on a second port with the same connection bookkeeping (so drain and
close cover both). Each of those reaches into a private attribute of grpclib's
server (tests/integration/test_grpc_ops.py, test_connections.py and
test_client_balancing.py exercise every function here).
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import ssl as _ssl
import weakref
from typing import NamedTuple

import grpclib.server

from ibex.service.edge.calls import GateLeft
from ibex.service.edge.connections import Connections
from ibex.service.edge.corked import Answered
from ibex.service.edge.protocol import Gate, TrackedProtocol

__all__ = ["TrackedServer", "bound_port", "listen_also", "stop_accepting", "track_connections"]


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


class TrackedServer(grpclib.server.Server):
    """grpclib's server whose accepted connections go through `TrackedProtocol`.

    `Server.start` builds each connection's protocol with `_protocol_factory`;
    overriding it in a subclass (not on grpclib's object) keeps grpclib's own
    handler bookkeeping and hands the handler to the tracked protocol. Until
    `track_connections` is called it serves as grpclib's server does.
    """

    _tracking: _Tracking | None = None

    def _protocol_factory(self) -> asyncio.BaseProtocol:  # type: ignore[override]
        base = super()._protocol_factory()
        tracking = self._tracking
        if tracking is None:
            return base
        tracked = TrackedProtocol(
            base.handler,
            base.config,
            base.h2_config,
            tracking.connections,
            tracking.gate,
            tracking.gate_left,
            tracking.answered,
        )
        if tracking.ssl is None:
            return tracked
        return _TlsAccept(
            asyncio.get_running_loop(),
            tracked,
            tracking.ssl,
            tracking.connections.config.tls_handshake_timeout,
        )


class _Tracking(NamedTuple):
    connections: Connections
    gate: Gate | None
    gate_left: GateLeft | None
    ssl: _ssl.SSLContext | None
    answered: Answered | None


def track_connections(
    server: TrackedServer,
    connections: Connections,
    gate: Gate | None = None,
    gate_left: GateLeft | None = None,
    *,
    ssl: _ssl.SSLContext | None = None,
    answered: Answered | None = None,
) -> None:
    """Route every connection `server` accepts through `connections` (call before `start`).

    `gate` is asked about every new call before grpclib starts a task for it
    (see `_ask_gate`); `gate_left` hears once for each call it let through, when
    the handler starts (`handler_started`) or, if it never does, when the call's
    task ends. `answered` hears how long each answered call took on the server,
    from its HEADERS to its last byte written (see `CorkedTransport.answer_ends`).

    With `ssl`, TLS is done here (start the server and `listen_also` without it):
    asyncio's own TLS calls the protocol only once the handshake is done, so a
    stalled handshake would hold an fd uncounted, for asyncio's 60 s. Here the
    connection counts from accept and the handshake has
    `connections.config.tls_handshake_timeout`.
    """
    server._tracking = _Tracking(connections, gate, gate_left, ssl, answered)


class _TlsAccept(asyncio.sslproto.SSLProtocol):
    """asyncio's server-side TLS protocol, counting its connection from accept."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tracked: TrackedProtocol,
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
