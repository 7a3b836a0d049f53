"""The ``/metrics`` HTTP exposition server: a tiny Trio HTTP/1.1 listener.

Apart from the metric definitions (`ibex.ops.metrics`) because its job is a
hostile-input edge, not recording: it bounds the request head (bytes and time),
checks the optional bearer token against SHA-256 digests, and caps connections
per peer and in all so idle sockets cannot lock a scraper out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ibex.ops.metrics import Metrics

log = logging.getLogger(__name__)

_MAX_HEADER_BYTES: Final = 8192
_TEXT: Final = "text/plain; charset=utf-8"


def token_digest(token: str) -> str:
    """The SHA-256 hex digest IBEX_CONTEXT_METRICS_TOKEN_SHA256 holds for a bearer token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _response(
    status: str, body: bytes, content_type: str, *, head: bool = False, extra: str = ""
) -> bytes:
    header = (
        f"HTTP/1.1 {status}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{extra}"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    return header if head else header + body


async def _read_head(stream: trio.abc.ReceiveStream) -> bytes | None:
    """Bytes up to the blank line ending the request head; None if the peer stops first."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        if len(buf) > _MAX_HEADER_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _authorized(lines: list[bytes], digests: tuple[bytes, ...]) -> bool:
    """True when exactly one `Authorization: Bearer <token>` header carries a token whose
    SHA-256 is one of `digests`. Every digest is compared, in constant time, so neither
    the timing nor which one matched tells a guesser anything."""
    values = [
        v for k, _, v in (line.partition(b":") for line in lines) if k.lower() == b"authorization"
    ]
    if len(values) != 1:
        return False
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return False
    presented = hashlib.sha256(token.strip()).hexdigest().encode("ascii")
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(presented, digest)
    return matched


def _answer(head: bytes, registry: CollectorRegistry, digests: tuple[bytes, ...] = ()) -> bytes:
    """The reply to one request head. With `digests`, every path needs the bearer token
    (401 otherwise), so an unauthenticated peer learns nothing and costs no exposition."""
    request_line, *lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    parts = request_line.decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _response("400 Bad Request", b"bad request\n", _TEXT)
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", b"method not allowed\n", _TEXT)
    head_only = method == "HEAD"
    if digests and not _authorized(lines, digests):
        challenge = 'WWW-Authenticate: Bearer realm="ibex-metrics"\r\n'
        return _response(
            "401 Unauthorized", b"unauthorized\n", _TEXT, head=head_only, extra=challenge
        )
    if target != "/metrics":
        return _response("404 Not Found", b"not found\n", _TEXT, head=head_only)
    return _response("200 OK", generate_latest(registry), CONTENT_TYPE_LATEST, head=head_only)


@dataclass(slots=True, eq=False)  # eq=False: the gate keys its waiting connections by identity
class _Conn:
    """One accepted connection as the gate sees it."""

    peer: str
    scope: trio.CancelScope = field(init=False, default_factory=trio.CancelScope)
    released: bool = field(init=False, default=False)


class _Gate:
    """Who may hold a metrics connection.

    At most `per_peer` connections per peer address and `limit` in all. A new
    connection over either cap closes the oldest one still waiting for its
    request head (of that peer, or of anyone at the process cap): a scraper
    sends its head at once, so only idle sockets wait, and idle sockets, from
    one peer or many, cannot lock the scraper out. It is refused only when
    every connection in its way is busy being answered.
    """

    def __init__(self, limit: int, per_peer: int) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.open = 0
        self.by_peer: dict[str, int] = {}
        self.waiting: dict[_Conn, None] = {}  # insertion order: oldest first
        self.refused = 0
        self.evicted = 0

    def admit(self, peer: str) -> _Conn | None:
        if self.by_peer.get(peer, 0) >= self.per_peer:
            victim = next((c for c in self.waiting if c.peer == peer), None)
            if victim is None:
                self._refuse("per_peer")
                return None
            self._evict(victim)
        elif self.open >= self.limit:
            if not self.waiting:
                self._refuse("limit")
                return None
            self._evict(next(iter(self.waiting)))
        conn = _Conn(peer)
        self.open += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        self.waiting[conn] = None
        return conn

    def _evict(self, conn: _Conn) -> None:
        self.release(conn)
        conn.scope.cancel()
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:
            log.warning("metrics_idle_connections_evicted", extra={"evicted": self.evicted})

    def release(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)
        if conn.released:
            return
        conn.released = True
        self.open -= 1
        left = self.by_peer[conn.peer] - 1
        if left:
            self.by_peer[conn.peer] = left
        else:
            del self.by_peer[conn.peer]

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "metrics_connections_refused", extra={"refused": self.refused, "reason": reason}
            )


def _peer_of(stream: trio.SocketStream) -> str | None:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return None  # already reset by the peer


def _connection_handler(
    registry: CollectorRegistry,
    *,
    gate: _Gate,
    head_timeout: float,
    connection_timeout: float,
    digests: tuple[bytes, ...],
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def handle(stream: trio.SocketStream) -> None:
        peer = _peer_of(stream)
        conn = gate.admit(peer) if peer is not None else None
        if conn is None:
            await trio.aclose_forcefully(stream)
            return
        try:
            with conn.scope, trio.move_on_after(connection_timeout):
                head = None
                with trio.move_on_after(head_timeout):
                    head = await _read_head(stream)
                gate.waiting.pop(conn, None)  # answering now: no longer evictable
                if head is None:
                    return  # silent, too slow, too big or gone: closed unanswered
                try:
                    reply = _answer(head, registry, digests)
                except Exception:
                    log.exception("metrics_scrape_failed")
                    reply = _response("500 Internal Server Error", b"error\n", _TEXT)
                await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper went away; nothing to tell it
        finally:
            gate.release(conn)
            await trio.aclose_forcefully(stream)

    return handle


async def serve_metrics(
    metrics: Metrics | CollectorRegistry,
    host: str,
    port: int,
    *,
    token_sha256: Iterable[str] = (),
    head_timeout: float = 3.0,
    connection_timeout: float = 10.0,
    max_connections: int = 16,
    max_per_peer: int = 4,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` over HTTP/1.1 until cancelled; `task_status` gets the bound port.

    One request per connection, answered from the Trio loop (no threads). The
    request head must arrive within `head_timeout` (a peer that connects and
    sends nothing is closed then) and the whole exchange within
    `connection_timeout`, so a stalled client cannot pin a task. With
    `token_sha256` (SHA-256 hex digests of the accepted bearer tokens) every
    request needs ``Authorization: Bearer <token>``, else 401; the token is
    never logged. Connections are gated per peer and in all (see `_Gate`), so
    idle sockets can neither use up the process's file descriptors nor lock the
    scraper out; should `accept` still fail (EMFILE), trio's `serve_listeners`
    logs it and retries after a pause. Port 0 binds a free port.
    """
    registry = metrics.registry if isinstance(metrics, Metrics) else metrics
    digests = tuple(d.strip().lower().encode("ascii") for d in token_sha256)
    listeners = await trio.open_tcp_listeners(port, host=host.strip("[]"))
    if port == 0:
        # A name resolving to several addresses would get a different free port
        # on each; one listener keeps "the bound port" meaningful.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    bound: int = listeners[0].socket.getsockname()[1]
    log.info("metrics_listening", extra={"host": host, "port": bound, "auth": bool(digests)})
    handler = _connection_handler(
        registry,
        gate=_Gate(max_connections, max_per_peer),
        head_timeout=head_timeout,
        connection_timeout=connection_timeout,
        digests=digests,
    )
    task_status.started(bound)
    await trio.serve_listeners(handler, listeners)
