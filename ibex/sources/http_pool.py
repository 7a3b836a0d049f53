"""A bounded keep-alive HTTP/1.1 pool for one origin on Trio, made for the memory service.

The memory service contract needs far less than a general client: two fixed
requests, JSON bodies read whole into memory, keep-alive, optional TLS. So:
no redirects, no proxies, no cookies, no compression (no Accept-Encoding is
sent). Anything the server says that is not clean HTTP/1.x is a
`TransportError`, never a guess. The jobs around the pool live beside it:
the stream (`raw_socket_stream`), connecting (`http_connect`), one request
and its answer (`http_exchange`), the bytes of an answer (`http_framing`).

The daemon cancels in-flight calls by design (branch timeouts, the retrieval
wall), so the pool's invariants are about cancellation; each is stated beside
the code that keeps it.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Final, NamedTuple

import trio

from ibex.sources.http_connect import Connect, settle, tcp_connect
from ibex.sources.http_exchange import (
    Connection,
    RequestEncoder,
    StaleConnection,
    discard_rest,
    read_response,
    send_request,
    split_base_url,
)
from ibex.sources.http_framing import (
    Response,
    ResponseParser,
    TransportError,
    TransportTimeout,
    transport_error,
)

__all__ = ["DRAIN_BYTES", "DRAIN_SECONDS", "HttpPool", "PoolStats"]

# Drain caps for a cancelled call's answer: past either, reconnecting is the cheaper way.
DRAIN_BYTES: Final = 64 * 1024
DRAIN_SECONDS: Final = 1.0
# How long a warmed TLS 1.3 connection waits for the server's session tickets (`settle`),
# when new, and when an idle one turns readable later.
SETTLE_SECONDS: Final = 0.25
SETTLE_AGAIN_SECONDS: Final = 0.02


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


class _Lease:
    """One request's hold on its slot: which step it is in, and whether a drain took the slot."""

    __slots__ = ("detached", "stage")

    def __init__(self) -> None:
        self.stage = "PoolTimeout"  # which step the safety-net timeout interrupted
        self.detached = False


class HttpPool:
    """Bounded keep-alive pool for one origin; use from Trio tasks only.

    `base_url` may carry a path prefix that every request target is appended
    to. `headers` are sent with every request (e.g. Authorization); they are
    never logged or put in an error message. `timeout` bounds a whole request
    (queueing included) for callers that set no deadline of their own.
    `connect` opens one connection (default `tcp_connect` to the origin, with
    `ssl_context` or the system trust for https); tests pass in-memory ones.
    `background` is where cancelled calls' answers are drained (see `_drain`);
    it must outlive `aclose()`. Without it such connections are closed. The
    drain caps are clamped to `max_response_bytes` and `keepalive_expiry`.
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
        self._encoder = RequestEncoder(origin, headers)
        self._max_connections = max_connections
        # A slot is a permit released in a `finally` on every exit, cancellation
        # included, and handed FIFO to the longest waiter (trio's parking lot). A
        # request cancelled while it waits for or opens a connection must not leak
        # its slot: a pool that leaks slots ends up serving nothing
        # (encode/httpcore#1093). A drain holds its cancelled call's slot.
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[Connection] = []  # oldest first; reuse takes the newest
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
        and the server's session tickets read, see `settle`) instead of connecting
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
                    clean = await settle(conn.stream, conn.link, SETTLE_SECONDS)
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
            self._pool_again(conn)
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
                clean = await settle(conn.stream, conn.link, SETTLE_AGAIN_SECONDS)
            except BaseException:
                conn.close()
                raise
            if clean and not self._closed:
                self._idle.append(conn)
                self._idle.sort(key=lambda c: c.idle_since)  # oldest first
            else:
                conn.close()

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
        data = self._encoder.encode(method, target, body, content_type, headers)
        lease = _Lease()
        deadline = trio.current_time() + self._timeout
        if trio.current_effective_deadline() < deadline:
            # The caller's own deadline comes first, so the safety net could never fire:
            # no cancel scope of its own (each costs a timer entry and its bookkeeping,
            # twice per answer).
            return await self._slotted(data, lease)
        with trio.CancelScope(deadline=deadline):
            return await self._slotted(data, lease)
        raise TransportTimeout(f"transport timeout ({lease.stage})")

    async def _slotted(self, data: bytes, lease: _Lease) -> Response:
        """The request once a slot is held; the slot is released on every exit unless a
        drain took it."""
        try:  # a free slot is taken without a trip through the scheduler
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            return await self._leased(data, lease)
        finally:
            if not lease.detached:  # else the drain holds the slot and releases it
                self._slots.release()

    async def _leased(self, data: bytes, lease: _Lease) -> Response:
        """The request on an idle connection, or on a fresh one.

        A reused connection that fails before a single answer byte was closed
        by the server under us: the request goes once more on a fresh
        connection. That is connection housekeeping, not a retry of a failed
        call (the reads are idempotent; the feedback write carries an
        Idempotency-Key); a fresh connection that fails is an error at once.
        """
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, data, lease)
            except StaleConnection:
                pass  # closed by _exchange; go again on a fresh connection
        lease.stage = "ConnectTimeout"
        conn = await self._connect()
        try:
            return await self._exchange(conn, data, lease)
        except StaleConnection:
            raise transport_error("ReadError") from None

    def _take_idle(self) -> Connection | None:
        """The newest idle connection still usable; expired ones, and ones the server
        closed or wrote to (seen by a zero-timeout readability check, which over TLS
        also looks inside the TLS layer, `SocketLink.unusable`), are closed instead."""
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

    async def _connect(self) -> Connection:
        try:
            stream, link = await self._connect_fn()
        except (OSError, trio.BrokenResourceError):
            raise transport_error("ConnectError") from None
        self._opened += 1
        return Connection(stream, link)

    def _pool_again(self, conn: Connection) -> None:
        """Put a connection whose state is known clean on the idle list."""
        conn.reused = True
        conn.idle_since = trio.current_time()
        self._idle.append(conn)

    async def _exchange(self, conn: Connection, data: bytes, lease: _Lease) -> Response:
        """Send and read one answer; the connection is pooled again only if it all went well,
        or drained if the call was cancelled while waiting for it.

        The connection goes back to the idle list only from the `finally` of a
        complete, well-formed exchange. Failed anywhere, or cancelled before
        the whole request was written, it is closed: its state is unknown.
        Closing is synchronous (`Link.close`), so no second cancellation can
        skip it and no shielded scope is needed.
        """
        self._in_use += 1
        keep = False
        parser: ResponseParser | None = None  # set once the whole request is written
        try:
            lease.stage = "WriteTimeout"
            await send_request(conn, data)
            lease.stage = "ReadTimeout"
            parser = ResponseParser(self._max_body)
            response, keep = await read_response(conn, parser)
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
                self._pool_again(conn)
            else:
                conn.close()

    def _drain(self, conn: Connection, parser: ResponseParser) -> bool:
        """Hand a cancelled call's connection, and its slot, to a drain; False if there is none.

        Cancelled after the whole request was written, the connection is in a
        known state, and closing it would cost the next call a new connection
        (the daemon cuts slow calls at the wall by design). So the rest of the
        answer is read and discarded in `background`, at most `drain_bytes`
        and `drain_seconds`. The slot goes with the connection and is released
        only when the drain ends: a draining connection counts against
        `max_connections` and no waiter is handed it. `aclose()` cancels every
        drain.
        """
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
        self, conn: Connection, parser: ResponseParser, scope: trio.CancelScope
    ) -> None:
        """Read and discard the rest of the answer; pool the connection only if the
        answer ended cleanly (complete, keep-alive, nothing after it), else close it."""
        keep = False
        try:
            with scope:
                keep = await discard_rest(conn, parser, self._drain_bytes)
        except (TransportError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            keep = False
        finally:
            self._drains.discard(scope)
            if keep and not self._closed:
                self._pool_again(conn)  # before the slot is freed, so its next holder finds it
            else:
                conn.close()
            self._slots.release()
