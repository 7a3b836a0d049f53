"""Opening the memory pool's connections: TCP, then TLS for https.

A connection is a stream and its `Link`, the handle the pool closes and
checks while the connection is idle. The pool takes any `Connect`, so framing
and pool tests run on in-memory streams.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from ibex.sources.http_framing import transport_error
from ibex.sources.raw_socket_stream import RECV_BYTES, RawSocketStream

__all__ = [
    "Connect",
    "Link",
    "SocketLink",
    "connect_ip",
    "link_unusable",
    "settle",
    "tcp_connect",
]


class Link(Protocol):
    """What the pool needs of a connection besides its stream."""

    def close(self) -> None:
        """Close now, synchronously: cancellation can never skip it."""
        ...

    def unusable(self) -> bool:
        """While idle: is anything waiting (EOF, a reset, stray bytes)? Then it is not reused."""
        ...


Connect = Callable[[], Awaitable[tuple[trio.abc.Stream, Link]]]


class SocketLink:
    """A TCP socket, and the TLS stream over it when there is one."""

    __slots__ = ("_sock", "_tls")

    def __init__(
        self,
        sock: trio.socket.SocketType | socket.socket,
        tls: trio.SSLStream[trio.SocketStream] | None = None,
    ) -> None:
        self._sock = sock
        self._tls = tls

    def close(self) -> None:
        """`socket.close()`: it never awaits, so no second cancellation can skip it and
        no shielded scope is needed (TLS: no close_notify)."""
        self._sock.close()

    def unusable(self) -> bool:
        """Readable while idle means EOF, a reset or stray bytes: unusable either way.

        Over TLS, bytes may already sit above the socket: plaintext decrypted
        into the SSL object (`pending()`), or records read off the socket but
        not yet decrypted (trio's incoming BIO). The socket then polls quiet
        while a stray answer waits to be taken for the next request's.

        poll, not select: select() cannot take descriptors above 1023, which a
        daemon with many gRPC connections reaches.
        """
        tls = self._tls
        if tls is not None:
            incoming = getattr(tls, "_incoming", None)
            try:
                if tls.pending() or (isinstance(incoming, ssl.MemoryBIO) and incoming.pending):
                    return True
            except (ssl.SSLError, ValueError, AttributeError):
                return True
        try:
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


def tcp_connect(host: str, port: int, ssl_context: ssl.SSLContext | None) -> Connect:
    """The default `connect`: TCP to host:port, then a TLS handshake when a context is given.

    Failures are `TransportError` (ConnectError); on any failure or
    cancellation the socket is closed before the exception leaves. Plain TCP to
    an IP literal (the usual sidecar or in-cluster address) is connected
    directly (`connect_ip`): no resolver, no Happy Eyeballs nursery.
    """
    family = _ip_family(host)

    async def connect() -> tuple[trio.abc.Stream, Link]:
        if family is not None and ssl_context is None:
            try:
                raw = await connect_ip(family, host, port)
            except OSError:
                raise transport_error("ConnectError") from None
            return RawSocketStream(raw), SocketLink(raw)
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            raise transport_error("ConnectError") from None
        sock = stream.socket
        if ssl_context is None:
            raw = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())
            return RawSocketStream(raw), SocketLink(raw)
        tls = trio.SSLStream(stream, ssl_context, server_hostname=host, https_compatible=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            sock.close()
            raise transport_error("ConnectError") from None
        except BaseException:
            sock.close()
            raise
        return tls, SocketLink(sock, tls)

    return connect


def _ip_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an IP literal, None for a name to resolve."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


async def connect_ip(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to an IP literal, with the options trio's
    `open_tcp_stream` sets (TCP_NODELAY, TCP_NOTSENT_LOWAT where there is one).

    One socket and one wait for writability: `open_tcp_stream` spends a resolver
    call, a nursery and its cancel scopes on each connection, which the pool opens
    on the request path whenever no idle connection is free. OSError when the
    connect fails; the socket is closed on any failure or cancellation.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)
        if lowat is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, lowat, 16 * 1024)
        err = sock.connect_ex((host, port))
        if err in (errno.EINPROGRESS, errno.EAGAIN):
            await trio.lowlevel.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
    except BaseException:
        sock.close()
        raise
    return sock


def link_unusable(link: Link) -> bool:
    """`link.unusable()`, and True when the check itself fails."""
    try:
        return link.unusable()
    except Exception:
        return True


async def settle(stream: trio.abc.Stream, link: Link, patience: float) -> bool:
    """Read what a TLS 1.3 server sends after the handshake; True if the connection is clean.

    The server sends its session tickets once it has the client's Finished,
    after the client's handshake has returned. Unread, they make the socket
    readable while the connection is idle, and the reuse check closes it as
    dirty: every warmed connection would be thrown away by its first call.
    They carry no application data, so they are read here, for at most
    `patience` seconds or until the session holds a ticket. Application data
    or EOF on a connection nobody asked anything of makes it unclean. Plain
    TCP and older TLS (tickets inside the handshake) only get the idle check.
    """
    if not isinstance(stream, trio.SSLStream) or stream.version() != "TLSv1.3":
        return not link_unusable(link)
    deadline = trio.current_time() + patience
    while (left := deadline - trio.current_time()) > 0:
        with trio.move_on_after(min(left, 0.005)):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await stream.receive_some(RECV_BYTES)
            return False  # data, EOF or a broken stream: nothing to keep
        session = stream.session
        if session is not None and session.has_ticket and not link_unusable(link):
            break
    return not link_unusable(link)
