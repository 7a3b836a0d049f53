"""A small HTTP/1.1 keep-alive client on Trio streams, made for the memory service.

Why not httpx2: it cost about 480 us of CPU per call here against about
125 us for this pool, both including the ~36 us msgspec decode of a
20-memory answer (benchmarks/memory_client.py), and the daemon makes two calls
per answer within a budget of 1.5 ms. The memory service contract needs far
less than a general client: two fixed requests, JSON bodies read whole into
memory, keep-alive, optional TLS.

Scope: one request at a time per connection (no pipelining). Response framing is
`ibex.sources.http_framing` (llhttp via httptools, sans-IO); this module is
the I/O and the pool around it. Anything the server says that is not clean
HTTP/1.x is a `TransportError`, never a guess. No redirects, no proxies, no
cookies, no compression (we send no Accept-Encoding).

The pool opens connections through an injectable `connect` function (default:
TCP, then TLS for https), so framing and pool tests can run on in-memory
streams.

Cancellation, which a pool here must get exactly right (encode/httpcore#1093:
a request cancelled while waiting for or opening a connection leaked its pool
slot, and a pool that leaks slots ends up serving nothing):

- A pool slot is a `trio.Semaphore` permit held with `async with`: released on
  every exit, and handed FIFO to the longest waiter (trio's parking lot).
- A connection goes back to the idle list only from the `finally` of a
  complete, well-formed exchange. Failed anywhere, or cancelled before the
  whole request was written (connecting, TLS handshake, writing), it is
  closed instead: its state is unknown. Closing is a synchronous
  `Link.close()` (`socket.close()` for real connections): it never awaits,
  so no second cancellation can skip it and no shielded scope is needed.
- Cancelled after the whole request was written (waiting for or reading the
  answer), the connection is in a known state. Closing it would cost a new
  connection for the next call (the daemon cuts slow calls at the wall by
  design: at 100 rps that was about 100 connects a second), so when the pool
  was given a nursery it drains the rest of that answer there instead:
  parsed and discarded, at most `drain_bytes` read and `drain_seconds`
  waited. The cancelled call's slot goes with the connection and is released
  only when the drain ends, so a draining connection counts against
  `max_connections` and no waiter is handed it; it rejoins the idle list
  only if the answer ended cleanly (complete, keep-alive, nothing after it),
  else it is closed. `aclose()` cancels every drain.
- Idle connections expire after `keepalive_expiry`; one that the server closed
  (or that has unexpected bytes waiting) is seen by a zero-timeout readability
  check and dropped before reuse. Over TLS the check also looks inside the TLS
  layer: bytes already read off the socket (a stray answer decrypted into the
  SSL object, or records still encrypted in its input buffer) would otherwise
  be delivered as the next request's answer. If a reused connection still
  fails before a single response byte arrives, the server closed it under us:
  the request is repeated once on a fresh connection. That is connection housekeeping, not a
  retry of a failed call (the reads are idempotent; the feedback write carries an
  Idempotency-Key); a fresh connection that fails is an error at once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, NamedTuple, Protocol
from urllib.parse import urlsplit

import trio

from ibex.sources.http_framing import (
    Response,
    ResponseParser,
    ResponseTooLarge,
    TransportError,
    TransportTimeout,
    transport_error,
)

__all__ = [
    "Connect",
    "HttpPool",
    "Link",
    "Origin",
    "PoolStats",
    "RawSocketStream",
    "Response",
    "ResponseTooLarge",
    "SocketLink",
    "TransportError",
    "TransportTimeout",
    "split_base_url",
    "tcp_connect",
]

_RECV_BYTES: Final = 64 * 1024
# Drain caps for a cancelled call's answer: past either, reconnecting is the cheaper way.
DRAIN_BYTES: Final = 64 * 1024
DRAIN_SECONDS: Final = 1.0
# How long a warmed TLS 1.3 connection waits for the server's session tickets (`_settle`),
# when new, and when an idle one turns readable later.
SETTLE_SECONDS: Final = 0.25
SETTLE_AGAIN_SECONDS: Final = 0.02
_TOKEN_SEPARATORS: Final = frozenset(b' \t"(),/:;<=>?@[\\]{}')


class Link(Protocol):
    """What the pool needs of a connection besides its stream."""

    def close(self) -> None:
        """Close now, synchronously: cancellation can never skip it."""
        ...

    def unusable(self) -> bool:
        """While idle: is anything waiting (EOF, a reset, stray bytes)? Then it is not reused."""
        ...


Connect = Callable[[], Awaitable[tuple[trio.abc.Stream, Link]]]


class PoolStats(NamedTuple):
    """A snapshot of the pool, for tests and diagnostics."""

    connections: int  # open connections: idle + in_use + draining
    idle: int
    in_use: int  # connections leased to a request right now
    leases: int  # slots held, including requests still connecting and drains
    waiters: int  # requests queued for a slot
    opened: int  # connections opened since the pool was created
    limit: int  # max_connections
    draining: int = 0  # cancelled calls' answers being read off their connections


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int
    prefix: str  # path every request target is appended to, without a trailing slash
    authority: str  # the Host header value


def split_base_url(base_url: str) -> Origin:
    """Check and split a base URL; ValueError (never echoing the URL) when unusable."""
    parts = urlsplit(base_url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError("base URL must start with http:// or https://")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("base URL must not carry credentials, a query or a fragment")
    host = parts.hostname
    if not host:
        raise ValueError("base URL has no host")
    default_port = 443 if scheme == "https" else 80
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError("base URL has an invalid port") from None
    authority = f"[{host}]" if ":" in host else host
    if port != default_port:
        authority = f"{authority}:{port}"
    return Origin(scheme, host, port, parts.path.rstrip("/"), authority)


def _header_lines(headers: Mapping[str, str]) -> list[str]:
    """`Name: value\r\n` lines, or ValueError for a name or value that could split the head."""
    lines = []
    for name, value in headers.items():
        if not name or any(ord(c) in _TOKEN_SEPARATORS or ord(c) < 33 for c in name):
            raise ValueError("invalid header name")
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"header {name}: value must not contain CR, LF or NUL")
        lines.append(f"{name}: {value}\r\n")
    return lines


class _Stale(Exception):
    """A reused connection failed before any response byte: the server had closed it."""


class RawSocketStream(trio.abc.Stream):
    """Plain TCP on a non-blocking stdlib socket that parks in Trio only when it must.

    trio's SocketStream yields to the scheduler after every send and receive
    that succeeded at once, each a full scheduler pass: one exchange with the
    memory service cost five Trio steps where two are needed (the start, and
    the wake when the answer is readable). Here each operation checks for
    cancellation on entry (raising at once if cancelled, as any checkpoint
    would), tries the syscall and waits for readiness only on EAGAIN.
    """

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            sent, total = 0, len(view)
            while sent < total:
                try:
                    sent += self.sock.send(view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.sock)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return self.sock.recv(max_bytes or _RECV_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)

    async def aclose(self) -> None:
        self.sock.close()
        await trio.lowlevel.checkpoint()


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
        """Synchronous, so cancellation can never skip it (TLS: no close_notify)."""
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
    cancellation the socket is closed before the exception leaves.
    """

    async def connect() -> tuple[trio.abc.Stream, Link]:
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


class _Lease:
    """One request's hold on its slot: which step it is in, and whether a drain took the slot."""

    __slots__ = ("detached", "stage")

    def __init__(self) -> None:
        self.stage = "PoolTimeout"  # which step the safety-net timeout interrupted
        self.detached = False


class _Conn:
    __slots__ = ("idle_since", "link", "reused", "stream")

    def __init__(self, stream: trio.abc.Stream, link: Link) -> None:
        self.stream = stream
        self.link = link
        self.reused = False
        self.idle_since = 0.0

    def close(self) -> None:
        self.link.close()

    def dead_or_dirty(self) -> bool:
        try:
            return self.link.unusable()
        except Exception:
            return True


class HttpPool:
    """Bounded keep-alive pool for one origin; use from Trio tasks only.

    `base_url` may carry a path prefix that every request target is appended
    to. `headers` are sent with every request (e.g. Authorization); they are
    never logged or put in an error message. `timeout` bounds a whole request
    (queueing included) for callers that set no deadline of their own.
    `connect` opens one connection (default `tcp_connect` to the origin, with
    `ssl_context` or the system trust for https); tests pass in-memory ones.
    `background` is where cancelled calls' answers are drained (see the module
    docstring); it must outlive `aclose()`. Without it such connections are
    closed. The drain caps are clamped to `max_response_bytes` and
    `keepalive_expiry`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str],
        max_connections: int,
        keepalive_expiry: float,
        timeout: float,
        max_response_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
        connect: Connect | None = None,
        background: trio.Nursery | None = None,
        drain_bytes: int = DRAIN_BYTES,
        drain_seconds: float = DRAIN_SECONDS,
    ) -> None:
        origin = split_base_url(base_url)
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if connect is None:
            tls = origin.scheme == "https"
            context = (ssl_context or ssl.create_default_context()) if tls else None
            connect = tcp_connect(origin.host, origin.port, context)
        self._connect_fn = connect
        self._prefix = origin.prefix
        lines = [f"Host: {origin.authority}\r\n", *_header_lines(headers)]
        self._static = "".join(lines).encode("latin-1")
        self._max_connections = max_connections
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Conn] = []  # oldest first; reuse takes the newest
        self._in_use = 0
        self._opened = 0
        self._keepalive_expiry = keepalive_expiry
        self._timeout = timeout
        self._max_body = max_response_bytes
        self._closed = False
        self._background = background
        self._drain_bytes = min(drain_bytes, max_response_bytes)
        self._drain_seconds = min(drain_seconds, keepalive_expiry)
        self._drains: set[trio.CancelScope] = set()

    def stats(self) -> PoolStats:
        idle = len(self._idle)
        draining = len(self._drains)
        return PoolStats(
            connections=idle + self._in_use + draining,
            idle=idle,
            in_use=self._in_use,
            leases=self._max_connections - self._slots.value,
            waiters=self._slots.statistics().tasks_waiting,
            opened=self._opened,
            limit=self._max_connections,
            draining=draining,
        )

    async def aclose(self) -> None:
        """Close idle connections now, cancel drains, close leased ones when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for scope in self._drains:
            scope.cancel()
        await trio.lowlevel.checkpoint()

    async def warm(self, min_idle: int = 1, fresh_for: float = 0.0) -> int:
        """Open connections until `min_idle` idle ones stay usable `fresh_for` more seconds.

        So a call finds its connection made (TCP and, for https, the TLS handshake
        and the server's session tickets read, see `_settle`) instead of connecting
        inside its branch's budget: before the first call, and while idle, since
        idle connections expire after `keepalive_expiry`. Idle connections that
        expired, or that the server closed, are dropped first. Only free slots are
        used, never queued for: a pool whose slots are all leased is in use, hence
        warm. Returns how many connections were opened; TransportError
        (ConnectError) when a connect fails. The caller bounds the time.
        """
        if self._closed:
            raise RuntimeError("HTTP pool is closed")
        await self._sweep()
        opened = 0
        while self._fresh_idle(fresh_for) < min_idle:
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                break
            try:
                conn = await self._connect()
                try:
                    clean = await self._settle(conn, SETTLE_SECONDS)
                except BaseException:
                    conn.close()
                    raise
            finally:
                self._slots.release()
            opened += 1
            if not clean or self._closed:
                conn.close()
                if not clean:  # the server answered nothing asked, or closed at once
                    raise transport_error("ConnectError")
                break
            # An idle pooled connection like any other: one the server closes before
            # it is used gets the one re-send on a fresh connection.
            conn.reused = True
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
        return opened

    async def _sweep(self) -> None:
        """Close idle connections that expired, or that the server closed or wrote to;
        a TLS one with records waiting is settled first (late session tickets)."""
        horizon = trio.current_time() - self._keepalive_expiry
        keep, suspects = [], []
        for conn in self._idle:
            if conn.idle_since < horizon:
                conn.close()
            elif not conn.dead_or_dirty():
                keep.append(conn)
            elif isinstance(conn.stream, trio.SSLStream):
                suspects.append(conn)
            else:
                conn.close()
        self._idle[:] = keep
        for conn in suspects:  # out of the idle list while read: no call can take them
            try:
                clean = await self._settle(conn, SETTLE_AGAIN_SECONDS)
            except BaseException:
                conn.close()
                raise
            if clean and not self._closed:
                self._idle.append(conn)
                self._idle.sort(key=lambda c: c.idle_since)  # oldest first
            else:
                conn.close()

    async def _settle(self, conn: _Conn, patience: float) -> bool:
        """Read what a TLS 1.3 server sends after the handshake; True if `conn` is clean.

        The server sends its session tickets once it has the client's Finished,
        after the client's handshake has returned. Unread, they make the socket
        readable while the connection is idle, and the reuse check closes it as
        dirty: every warmed connection would be thrown away by its first call.
        They carry no application data, so they are read here, for at most
        `patience` seconds or until the session holds a ticket. Application data
        or EOF on a connection nobody asked anything of makes it unclean. Plain
        TCP and older TLS (tickets inside the handshake) only get the idle check.
        """
        stream = conn.stream
        if not isinstance(stream, trio.SSLStream) or stream.version() != "TLSv1.3":
            return not conn.dead_or_dirty()
        deadline = trio.current_time() + patience
        while (left := deadline - trio.current_time()) > 0:
            with trio.move_on_after(min(left, 0.005)):
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, OSError
                ):
                    await stream.receive_some(_RECV_BYTES)
                return False  # data, EOF or a broken stream: nothing to keep
            session = stream.session
            if session is not None and session.has_ticket and not conn.dead_or_dirty():
                break
        return not conn.dead_or_dirty()

    def _fresh_idle(self, fresh_for: float) -> int:
        """Idle connections that will not expire within `fresh_for` seconds."""
        horizon = trio.current_time() - self._keepalive_expiry + fresh_for
        return sum(1 for conn in self._idle if conn.idle_since >= horizon)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes | None = None,
        content_type: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """One request; the whole body in memory. Raises TransportError (a SourceError).

        `headers` are added to this request only (e.g. an Idempotency-Key).
        """
        if self._closed:
            raise RuntimeError("HTTP pool is closed")
        data = self._encode(method, target, body, content_type, headers)
        lease = _Lease()
        with trio.move_on_after(self._timeout):
            try:  # a free slot is taken without a trip through the scheduler
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                await self._slots.acquire()
            try:
                return await self._leased(data, lease)
            finally:
                if not lease.detached:  # else the drain holds the slot and releases it
                    self._slots.release()
        raise TransportTimeout(f"transport timeout ({lease.stage})")

    def _encode(
        self,
        method: str,
        target: str,
        body: bytes | None,
        content_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        if not target.startswith("/") or not target.isascii() or any(c in target for c in " \r\n"):
            raise ValueError("request target must be an absolute, percent-encoded path")
        head = f"{method} {self._prefix}{target} HTTP/1.1\r\n".encode("ascii") + self._static
        if headers:
            head += "".join(_header_lines(headers)).encode("latin-1")
        if body is None:
            return head + b"\r\n"
        extra = f"Content-Type: {content_type}\r\n" if content_type else ""
        tail = f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        return b"".join((head, tail, body))

    async def _leased(self, data: bytes, lease: _Lease) -> Response:
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, data, lease)
            except _Stale:
                pass  # closed by _exchange; go again on a fresh connection
        lease.stage = "ConnectTimeout"
        conn = await self._connect()
        try:
            return await self._exchange(conn, data, lease)
        except _Stale:
            raise transport_error("ReadError") from None

    def _take_idle(self) -> _Conn | None:
        idle = self._idle
        if not idle:
            return None
        horizon = trio.current_time() - self._keepalive_expiry
        if idle[0].idle_since < horizon:  # the oldest has expired: sweep them all
            for conn in idle:
                if conn.idle_since < horizon:
                    conn.close()
            idle[:] = [c for c in idle if c.idle_since >= horizon]
        while idle:
            conn = idle.pop()
            if not conn.dead_or_dirty():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        try:
            stream, link = await self._connect_fn()
        except (OSError, trio.BrokenResourceError):
            raise transport_error("ConnectError") from None
        self._opened += 1
        return _Conn(stream, link)

    async def _exchange(self, conn: _Conn, data: bytes, lease: _Lease) -> Response:
        """Send and read one answer; the connection is pooled again only if it all went well,
        or drained if the call was cancelled while waiting for it."""
        self._in_use += 1
        keep = False
        parser: ResponseParser | None = None  # set once the whole request is written
        try:
            lease.stage = "WriteTimeout"
            try:
                await conn.stream.send_all(data)
            except (trio.BrokenResourceError, OSError):
                if conn.reused:
                    raise _Stale from None
                raise transport_error("WriteError") from None
            lease.stage = "ReadTimeout"
            parser = ResponseParser(self._max_body)
            response, keep = await self._read_response(conn, parser)
            return response
        except trio.Cancelled:
            if parser is not None and self._drain(conn, parser):
                lease.detached = True
            raise
        finally:
            self._in_use -= 1
            if lease.detached:
                pass  # the drain owns the connection now
            elif keep and not self._closed:
                conn.reused = True
                conn.idle_since = trio.current_time()
                self._idle.append(conn)
            else:
                conn.close()

    def _drain(self, conn: _Conn, parser: ResponseParser) -> bool:
        """Hand a cancelled call's connection, and its slot, to a drain; False if there is none."""
        nursery = self._background
        if nursery is None or self._closed or self._drain_bytes <= 0 or self._drain_seconds <= 0:
            return False
        scope = trio.CancelScope(deadline=trio.current_time() + self._drain_seconds)
        try:
            nursery.start_soon(self._drain_task, conn, parser, scope)
        except RuntimeError:  # the nursery is closing: no new tasks
            return False
        self._drains.add(scope)
        return True

    async def _drain_task(
        self, conn: _Conn, parser: ResponseParser, scope: trio.CancelScope
    ) -> None:
        """Read and discard the rest of the answer; pool the connection if it ended cleanly."""
        keep = False
        try:
            with scope:
                keep = await self._discard_rest(conn, parser)
        except (TransportError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            keep = False
        finally:
            self._drains.discard(scope)
            if keep and not self._closed:
                conn.reused = True
                conn.idle_since = trio.current_time()
                self._idle.append(conn)  # before the slot is freed, so its next holder finds it
            else:
                conn.close()
            self._slots.release()

    async def _discard_rest(self, conn: _Conn, parser: ResponseParser) -> bool:
        """Feed the parser to the end of the answer; True if the connection may be reused."""
        parser.discard_body()
        budget = self._drain_bytes
        while True:
            chunk = await conn.stream.receive_some(_RECV_BYTES)
            if not chunk:
                return False
            budget -= len(chunk)
            if budget < 0:
                return False
            if parser.feed(chunk):
                return parser.keep_alive

    async def _read_response(self, conn: _Conn, parser: ResponseParser) -> tuple[Response, bool]:
        """Feed the parser until the answer is complete; (answer, may the connection be reused)."""
        first = True
        while True:
            try:
                chunk = await conn.stream.receive_some(_RECV_BYTES)
            except (trio.BrokenResourceError, OSError):
                if first and conn.reused:
                    raise _Stale from None
                raise transport_error("ReadError") from None
            if not chunk:
                if first and conn.reused:
                    raise _Stale
                return parser.feed_eof(), False
            first = False
            if parser.feed(chunk):
                return parser.response, parser.keep_alive
