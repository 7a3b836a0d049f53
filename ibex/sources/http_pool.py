"""A small HTTP/1.1 keep-alive client on Trio streams, made for the memory service.

Why not httpx2: it cost about 480 us of CPU per call here against about
125 us for this pool, both including the ~36 us msgspec decode of a
20-memory answer (benchmarks/memory_client.py), and the daemon makes two calls
per answer within a budget of 1.5 ms. The memory service contract needs far
less than a general client: two fixed requests, JSON bodies read whole into
memory, keep-alive, optional TLS.

Scope: one request at a time per connection (no pipelining), Content-Length,
chunked and close-delimited bodies, `Connection: close`, interim 1xx answers
skipped, a body size cap. Anything else the server says that is not clean
HTTP/1.x is a `TransportError`, never a guess. No redirects, no proxies, no
cookies, no compression (we send no Accept-Encoding).

Cancellation, which a pool here must get exactly right (encode/httpcore#1093:
a request cancelled while waiting for or opening a connection leaked its pool
slot, and a pool that leaks slots ends up serving nothing):

- A pool slot is a `trio.Semaphore` permit held with `async with`: released on
  every exit, and handed FIFO to the longest waiter (trio's parking lot).
- A connection goes back to the idle list only from the `finally` of a
  complete, well-formed exchange. Cancelled or failed anywhere (connecting,
  TLS handshake, writing, reading), it is closed instead. Closing is a
  synchronous `socket.close()`: it never awaits, so no second cancellation
  can skip it and no shielded scope is needed.
- Idle connections expire after `keepalive_expiry`; one that the server closed
  (or that has unexpected bytes waiting) is seen by a zero-timeout readability
  check and dropped before reuse. If a reused connection still fails before a
  single response byte arrives, the server closed it under us: the request is
  repeated once on a fresh connection. That is connection housekeeping, not a
  retry of a failed call (both requests are idempotent reads); a fresh
  connection that fails is an error at once.
"""

from __future__ import annotations

import re
import select
import ssl
from collections.abc import Mapping
from typing import Final, NamedTuple
from urllib.parse import urlsplit

import trio

from ibex.sources.base import SourceError

MAX_HEAD_BYTES: Final = 64 * 1024
_RECV_BYTES: Final = 64 * 1024
_HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,15}")
_TOKEN_SEPARATORS: Final = frozenset(b' \t"(),/:;<=>?@[\\]{}')


class TransportError(SourceError):
    """Connecting, sending or receiving failed, or the answer was not HTTP/1.x.

    str() is `transport error (<Kind>)`, with httpx's kind names
    (ConnectError, WriteError, ReadError, RemoteProtocolError): safe to log.
    """


class TransportTimeout(TransportError):
    """The pool's own safety-net timeout fired (the caller's cancel scope did not)."""


class ResponseTooLarge(TransportError):
    """The body is over the configured cap; the connection is dropped unread."""


class PoolStats(NamedTuple):
    """A snapshot of the pool, for tests and diagnostics."""

    connections: int  # open connections: idle + in_use
    idle: int
    in_use: int  # connections leased to a request right now
    leases: int  # slots held, including requests still connecting
    waiters: int  # requests queued for a slot
    opened: int  # connections opened since the pool was created
    limit: int  # max_connections


class Response(NamedTuple):
    status: int
    body: bytes


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


class _Stale(Exception):
    """A reused connection failed before any response byte: the server had closed it."""


class _Conn:
    __slots__ = ("idle_since", "reused", "sock", "stream")

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.sock = sock
        self.reused = False
        self.idle_since = 0.0

    def close(self) -> None:
        """Synchronous, so cancellation can never skip it (TLS: no close_notify)."""
        self.sock.close()

    def dead_or_dirty(self) -> bool:
        """Readable while idle means EOF, a reset or stray bytes: unusable either way.

        poll, not select: select() cannot take descriptors above 1023, which a
        daemon with many gRPC connections reaches.
        """
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


def _error(kind: str) -> TransportError:
    return TransportError(f"transport error ({kind})")


def _malformed() -> TransportError:
    return _error("RemoteProtocolError")


class HttpPool:
    """Bounded keep-alive pool for one origin; use from Trio tasks only.

    `base_url` may carry a path prefix that every request target is appended
    to. `headers` are sent with every request (e.g. Authorization); they are
    never logged or put in an error message. `timeout` bounds a whole request
    (queueing included) for callers that set no deadline of their own.
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
    ) -> None:
        origin = split_base_url(base_url)
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self._host = origin.host
        self._port = origin.port
        tls = origin.scheme == "https"
        self._ssl = (ssl_context or ssl.create_default_context()) if tls else None
        self._prefix = origin.prefix
        lines = [f"Host: {origin.authority}"]
        for name, value in headers.items():
            if not name or any(ord(c) in _TOKEN_SEPARATORS or ord(c) < 33 for c in name):
                raise ValueError("invalid header name")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name}: value must not contain CR, LF or NUL")
            lines.append(f"{name}: {value}")
        self._static = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._max_connections = max_connections
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Conn] = []  # oldest first; reuse takes the newest
        self._in_use = 0
        self._opened = 0
        self._keepalive_expiry = keepalive_expiry
        self._timeout = timeout
        self._max_body = max_response_bytes
        self._closed = False

    def stats(self) -> PoolStats:
        idle = len(self._idle)
        return PoolStats(
            connections=idle + self._in_use,
            idle=idle,
            in_use=self._in_use,
            leases=self._max_connections - self._slots.value,
            waiters=self._slots.statistics().tasks_waiting,
            opened=self._opened,
            limit=self._max_connections,
        )

    async def aclose(self) -> None:
        """Close idle connections now and leased ones when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        await trio.lowlevel.checkpoint()

    async def request(
        self, method: str, target: str, body: bytes | None = None, content_type: str = ""
    ) -> Response:
        """One request; the whole body in memory. Raises TransportError (a SourceError)."""
        if self._closed:
            raise RuntimeError("HTTP pool is closed")
        data = self._encode(method, target, body, content_type)
        stage = ["PoolTimeout"]  # which step the safety-net timeout interrupted
        with trio.move_on_after(self._timeout):
            async with self._slots:
                return await self._leased(data, stage)
        raise TransportTimeout(f"transport timeout ({stage[0]})")

    def _encode(self, method: str, target: str, body: bytes | None, content_type: str) -> bytes:
        if not target.startswith("/") or not target.isascii() or any(c in target for c in " \r\n"):
            raise ValueError("request target must be an absolute, percent-encoded path")
        head = f"{method} {self._prefix}{target} HTTP/1.1\r\n".encode("ascii")
        if body is None:
            return head + self._static + b"\r\n"
        extra = f"Content-Type: {content_type}\r\n" if content_type else ""
        tail = f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        return b"".join((head, self._static, tail, body))

    async def _leased(self, data: bytes, stage: list[str]) -> Response:
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, data, stage)
            except _Stale:
                pass  # closed by _exchange; go again on a fresh connection
        stage[0] = "ConnectTimeout"
        conn = await self._connect()
        try:
            return await self._exchange(conn, data, stage)
        except _Stale:
            raise _error("ReadError") from None

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
            stream = await trio.open_tcp_stream(self._host, self._port)
        except OSError:
            raise _error("ConnectError") from None
        self._opened += 1
        sock = stream.socket
        if self._ssl is None:
            return _Conn(stream, sock)
        tls = trio.SSLStream(stream, self._ssl, server_hostname=self._host, https_compatible=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            sock.close()
            raise _error("ConnectError") from None
        except BaseException:
            sock.close()
            raise
        return _Conn(tls, sock)

    async def _exchange(self, conn: _Conn, data: bytes, stage: list[str]) -> Response:
        """Send and read one answer; the connection is pooled again only if it all went well."""
        self._in_use += 1
        keep = False
        try:
            stage[0] = "WriteTimeout"
            try:
                await conn.stream.send_all(data)
            except (trio.BrokenResourceError, OSError):
                if conn.reused:
                    raise _Stale from None
                raise _error("WriteError") from None
            stage[0] = "ReadTimeout"
            response, keep = await self._read_response(conn)
            return response
        finally:
            self._in_use -= 1
            if keep and not self._closed:
                conn.reused = True
                conn.idle_since = trio.current_time()
                self._idle.append(conn)
            else:
                conn.close()

    async def _receive(self, conn: _Conn, first: bool = False) -> bytes | bytearray:
        try:
            chunk = await conn.stream.receive_some(_RECV_BYTES)
        except (trio.BrokenResourceError, OSError):
            chunk = b""
        if not chunk:
            if first and conn.reused:
                raise _Stale
            raise _error("ReadError")
        return chunk

    async def _read_response(self, conn: _Conn) -> tuple[Response, bool]:
        buf = bytearray(await self._receive(conn, first=True))
        while True:
            end = buf.find(b"\r\n\r\n")
            while end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise _malformed()
                start = max(0, len(buf) - 3)
                buf += await self._receive(conn)
                end = buf.find(b"\r\n\r\n", start)
            if end > MAX_HEAD_BYTES:
                raise _malformed()
            status, keep, headers = _parse_head(bytes(buf[:end]))
            del buf[: end + 4]
            if status >= 200:
                break
            if status == 101:
                raise _malformed()  # we never asked to switch protocols
            # an interim 1xx answer: the real one follows on the same connection

        te = headers.get(b"transfer-encoding")
        length = headers.get(b"content-length")
        if status in (204, 304):
            body = b""
            leftover = bool(buf)
        elif te is not None:
            if length is not None or te.strip().lower() != b"chunked":
                raise _malformed()  # TE+CL is a smuggling shape; other codings unasked for
            body, leftover = await self._read_chunked(conn, buf)
        elif length is not None:
            if not length.isdigit() or len(length) > 18:
                raise _malformed()
            n = int(length)
            if n > self._max_body:
                raise ResponseTooLarge(f"response larger than {self._max_body} bytes")
            while len(buf) < n:
                buf += await self._receive(conn)
            body = bytes(buf[:n])
            leftover = len(buf) > n
        else:  # delimited by the server closing the connection
            while True:
                if len(buf) > self._max_body:
                    raise ResponseTooLarge(f"response larger than {self._max_body} bytes")
                try:
                    chunk = await conn.stream.receive_some(_RECV_BYTES)
                except (trio.BrokenResourceError, OSError):
                    raise _error("ReadError") from None
                if not chunk:
                    break
                buf += chunk
            return Response(status, bytes(buf)), False
        # Bytes after the answer were never asked for: the connection is not clean.
        return Response(status, body), keep and not leftover

    async def _read_chunked(self, conn: _Conn, buf: bytearray) -> tuple[bytes, bool]:
        body = bytearray()
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            while eol < 0:
                if len(buf) - pos > 1024:
                    raise _malformed()
                buf += await self._receive(conn)
                eol = buf.find(b"\r\n", pos)
            size_field = bytes(buf[pos:eol]).split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_field):
                raise _malformed()
            size = int(size_field, 16)
            pos = eol + 2
            if size == 0:
                break
            if len(body) + size > self._max_body:
                raise ResponseTooLarge(f"response larger than {self._max_body} bytes")
            while len(buf) < pos + size + 2:
                buf += await self._receive(conn)
            if buf[pos + size : pos + size + 2] != b"\r\n":
                raise _malformed()
            body += buf[pos : pos + size]
            pos += size + 2
        while True:  # trailer fields, up to the empty line
            eol = buf.find(b"\r\n", pos)
            while eol < 0:
                if len(buf) - pos > MAX_HEAD_BYTES:
                    raise _malformed()
                buf += await self._receive(conn)
                eol = buf.find(b"\r\n", pos)
            if eol == pos:
                pos += 2
                break
            pos = eol + 2
        return bytes(body), len(buf) > pos


def _parse_head(head: bytes) -> tuple[int, bool, dict[bytes, bytes]]:
    """Status, whether the connection may be kept, and lower-cased header fields."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if (
        version not in (b"HTTP/1.1", b"HTTP/1.0")
        or len(code) != 3
        or not code.isdigit()
        or rest[3:4] not in (b"", b" ")
    ):
        raise _malformed()
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        # An empty or padded name, or a folded continuation line, is not HTTP/1.1.
        if not sep or not name or name[0] in b" \t" or name[-1] in b" \t":
            raise _malformed()
        key = name.lower()
        value = value.strip(b" \t")
        seen = headers.get(key)
        if seen is None:
            headers[key] = value
        elif key == b"content-length":
            if seen != value:
                raise _malformed()
        else:
            headers[key] = seen + b", " + value
    tokens = {t.strip().lower() for t in headers.get(b"connection", b"").split(b",")}
    if version == b"HTTP/1.1":
        keep = b"close" not in tokens
    else:
        keep = b"keep-alive" in tokens and b"close" not in tokens
    return int(code), keep, headers
