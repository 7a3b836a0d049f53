"""Connection bookkeeping for the gRPC port: caps, idle close, age rotation, a polite drain.

grpclib keeps every accepted connection until the peer leaves and never says
goodbye, so idle sockets pile up (each an fd: past RLIMIT_NOFILE `accept`
fails) and a long-lived HTTP/2 connection never moves to a new replica. This
module decides *what* happens to each connection; `protocol` does the
HTTP/2 part on grpclib's protocol objects (the `Conn` methods below).

Fair to callers: a connection counts from accept (before any TLS handshake),
against the process cap and its peer's (by IP) cap. A connection that has made
no authenticated call within `auth_timeout` of accept is closed. When a cap is
reached a new connection evicts an unauthenticated one, else an idle one (see
`_evict` for the order), and is refused when there is none: a peer that only
holds sockets cannot keep a caller with credentials out. At the process cap an
unauthenticated connection of another peer is evicted only once it has had
`first_call_grace` to make its first call, or when its peer holds clearly more
connections than the newcomer's: a storm of new connections from other
addresses cannot evict a caller before its first call. A peer opening
connections faster than `peer_rate` per second (a burst of twice that) has its
new ones refused at once, before any TLS or HTTP/2 work.

Goodbye follows grpc-go's `MaxConnectionAge` convention, with one more PING: a
first GOAWAY with last-stream-id 2^31-1 and a PING (the client stops opening
streams once it has read them); when that PING is answered, a second PING;
when that one is answered, the final GOAWAY names the last stream the server
took. The second round trip is what makes the final last-stream-id cover every
stream the client started before it read the first GOAWAY: a client may write
those streams' HEADERS after its first PING ack (grpc-core writes PING acks
ahead of new streams' frames in one write, which the network may split across
reads), but never after its ack of a PING it received later. A stream the
final GOAWAY excluded would fail at a client without retries ("Stream removed
(GOAWAY received ...)"), although the caller did nothing wrong. Without acks
the final GOAWAY goes out after `goaway_ack_timeout` or when the grace ends,
whichever is first. Streams up to it finish (within the grace); later ones are
refused (REFUSED_STREAM, which clients retry elsewhere); the connection closes
when its last stream ends.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Protocol

import trio

from ibex.service.edge.connections_config import ConnectionsConfig

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL = 10.0  # seconds between two `connections_refused` lines during a flood
PEER_RATES_KEPT = 4096  # peers whose connection rate is remembered (least recent dropped)
#: Why connections are closed before their peer leaves (`ibex_connections_closed_total`),
#: besides the HTTP/2 floods (`ibex.service.edge.frame_guard.FLOOD_REASONS`).
CLOSE_REASONS = ("refused_cap", "refused_rate", "evicted", "auth_timeout", "idle")


class Conn(Protocol):
    """One HTTP/2 connection as the shim exposes it."""

    def open_streams(self) -> int:
        """Calls in progress (a Health/Watch stream is not one: it keeps nothing busy)."""

    def goaway_heads_up(self) -> None:
        """GOAWAY(last-stream-id 2^31-1) then a PING whose ack calls `Connections.acked`."""

    def goaway_confirm(self) -> None:
        """A second PING, whose ack calls `Connections.confirmed`."""

    def goaway_final(self) -> None:
        """GOAWAY(highest stream taken); streams opened after it are refused."""

    def close_idle(self) -> None:
        """GOAWAY (h2 close_connection) and close; before HTTP/2 (a TLS handshake), close."""

    def close(self) -> None:
        """Close the transport (pending writes are flushed first)."""


class _Phase:
    OPEN = 0
    HEADS_UP = 1  # first GOAWAY + PING sent, waiting for the ack
    CONFIRM = 2  # the first PING answered; the second sent, waiting for its ack
    FINAL = 3  # final GOAWAY sent, waiting for the last stream


class _State:
    __slots__ = (
        "accepted",
        "age_deadline",
        "authenticated",
        "grace_deadline",
        "heads_up_at",
        "last_active",
        "peer",
        "phase",
        "reason",
    )

    def __init__(self, now: float, age_deadline: float | None, peer: str | None) -> None:
        self.accepted = now
        self.peer = peer
        self.authenticated = False
        self.last_active = now
        self.age_deadline = age_deadline
        self.phase = _Phase.OPEN
        self.heads_up_at = 0.0
        self.grace_deadline = 0.0
        self.reason = ""


class _LoggedCount:
    """A count of one kind of closing, with a warning line at most every
    `REFUSAL_LOG_INTERVAL` saying how many since the last line: a flood makes one
    line an interval, not one a connection."""

    __slots__ = ("_key", "_logged", "_logged_at", "count", "event")

    def __init__(self, event: str, key: str) -> None:
        self.event = event
        self._key = key  # the line's field that holds the count since the last line
        self.count = 0
        self._logged = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL

    def add(self, now: float, **fields: object) -> None:
        self.count += 1
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL:
            log.warning(self.event, extra={self._key: self.count - self._logged, **fields})
            self._logged_at = now
            self._logged = self.count


class Connections:
    """The open connections of one server and what is due for each."""

    def __init__(
        self,
        config: ConnectionsConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        closed_for: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._jitter = jitter
        self._closed_for = closed_for  # told why a connection was closed (a metric)
        self._conns: dict[Conn, _State] = {}
        self._peers: dict[str, int] = {}  # open connections per peer address
        self._rates: dict[str, tuple[float, float]] = {}  # peer -> (tokens, at): new conns
        self.flooded: dict[str, int] = {}  # connections closed for an HTTP/2 flood, by reason
        self._floods = _LoggedCount("connection_flood_closed", "closed")
        # Connections closed at once because the cap was reached.
        self._refusals = _LoggedCount("connections_refused", "refused")
        # Idle or unauthenticated connections closed to make room.
        self._evictions = _LoggedCount("connections_evicted", "evicted")
        self.closed_unauthenticated = 0
        self.closed_idle = 0
        self.rotated = 0
        self._draining = False
        self._wake = trio.Event()

    @property
    def count(self) -> int:
        return len(self._conns)

    # -- called by the shim from the asyncio loop's callbacks ------------------------------

    def admit(self, conn: Conn, peer: str | None = None) -> bool:
        """Count a just-accepted connection from `peer` (its IP), making room if a cap is
        reached; False when there is none (or draining): the shim closes the socket at once.
        """
        now = self._clock()
        cfg = self.config
        room = not self._draining
        reason = "refused_cap"
        if room and peer is not None and not self._within_rate(peer, now):
            room, reason = False, "refused_rate"
        limit = cfg.max_per_peer
        if room and peer is not None and limit is not None and self._peers.get(peer, 0) >= limit:
            room = self._evict(now, peer)
        if room and len(self._conns) >= cfg.max_connections:
            room = self._evict(now, None, peer)
        if not room:
            self._report(reason)
            self._refusals.add(
                now,
                open=len(self._conns),
                max_connections=cfg.max_connections,
                max_per_peer=cfg.max_per_peer,
                draining=self._draining,
                reason=reason,
            )
            return False
        age = cfg.max_age
        # +-10% jitter, as grpc-go, so connections opened together do not all rotate together.
        deadline = None if age is None else now + age * (0.9 + 0.2 * self._jitter())
        self._conns[conn] = _State(now, deadline, peer)
        if peer is not None:
            self._peers[peer] = self._peers.get(peer, 0) + 1
        return True

    def _within_rate(self, peer: str, now: float) -> bool:
        """Take one of `peer`'s new-connection tokens (`peer_rate` per second, a burst of
        twice that); False when it has none left."""
        rate = self.config.peer_rate
        if rate is None:
            return True
        burst = max(1.0, 2 * rate)
        tokens, at = self._rates.pop(peer, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        ok = tokens >= 1.0
        self._rates[peer] = (tokens - 1.0 if ok else tokens, now)  # most recent last
        if len(self._rates) > PEER_RATES_KEPT:
            del self._rates[next(iter(self._rates))]  # least recent: it starts full again
        return ok

    def _report(self, reason: str) -> None:
        if self._closed_for is not None:
            self._closed_for(reason)

    def _evict(self, now: float, peer: str | None, newcomer: str | None = None) -> bool:
        """Make room for a connection from `newcomer`. At `peer`'s cap: close that peer's
        oldest unauthenticated connection, else its oldest idle one (a peer's own new
        connections push out its old ones). At the process cap: close the oldest
        unauthenticated connection that has had `first_call_grace`; else the oldest
        unauthenticated one of the peer holding the most connections, when that is more
        than the newcomer's peer holds plus one (a storm from a few addresses cannot keep
        a quieter peer out); else the oldest idle one. False when there is none."""
        victim: Conn | None = None
        idle: Conn | None = None
        # A peer's own connections have no grace among themselves.
        young = now - self.config.first_call_grace if peer is None else math.inf
        for conn, state in self._conns.items():  # in accept order: the oldest first
            if peer is not None and state.peer != peer:
                continue
            if not state.authenticated:
                if state.accepted <= young:
                    victim = conn
                    break
            elif idle is None and state.phase == _Phase.OPEN and not conn.open_streams():
                idle = conn
        if victim is None and peer is None and newcomer is not None and self._peers:
            heaviest = max(self._peers, key=self._peers.__getitem__)
            if self._peers[heaviest] > self._peers.get(newcomer, 0) + 1:
                victim = next(
                    (
                        c
                        for c, st in self._conns.items()
                        if st.peer == heaviest and not st.authenticated
                    ),
                    None,
                )
        if victim is None:
            victim = idle
        if victim is None:
            return False
        self._report("evicted")
        self._evictions.add(
            now, open=len(self._conns), cap="per_peer" if peer is not None else "process"
        )
        self._forget(victim)
        victim.close_idle()
        return True

    def _forget(self, conn: Conn) -> None:
        state = self._conns.pop(conn, None)
        if state is not None and state.peer is not None:
            left = self._peers.get(state.peer, 0) - 1
            if left > 0:
                self._peers[state.peer] = left
            else:
                self._peers.pop(state.peer, None)

    def authenticated(self, conn: Conn) -> None:
        """A call on `conn` passed authentication: it is a caller's, not a socket holder's."""
        state = self._conns.get(conn)
        if state is not None:
            state.authenticated = True

    def is_authenticated(self, conn: Conn) -> bool:
        state = self._conns.get(conn)
        return state is not None and state.authenticated

    def flood_closed(self, conn: Conn, reason: str) -> None:
        """`conn` is being closed for an HTTP/2 flood (`ibex.service.edge.frame_guard`)."""
        self.flooded[reason] = self.flooded.get(reason, 0) + 1
        self._report(reason)
        state = self._conns.get(conn)
        self._floods.add(
            self._clock(),
            reason=reason,
            peer=state.peer if state is not None else None,
            authenticated=state is not None and state.authenticated,
        )

    @property
    def refused(self) -> int:
        """Connections closed at once because a cap was reached (or while draining)."""
        return self._refusals.count

    @property
    def evicted(self) -> int:
        """Idle or unauthenticated connections closed to make room for a new one."""
        return self._evictions.count

    def peer_count(self, peer: str) -> int:
        return self._peers.get(peer, 0)

    def active(self, conn: Conn) -> None:
        """Data arrived: a stream may have started."""
        state = self._conns.get(conn)
        if state is not None and conn.open_streams():
            state.last_active = self._clock()

    def acked(self, conn: Conn) -> None:
        """The heads-up PING came back: the client has read the first GOAWAY and starts no
        stream on this connection any more; the ones it started before may still follow."""
        state = self._conns.get(conn)
        if state is not None and state.phase == _Phase.HEADS_UP:
            state.phase = _Phase.CONFIRM
            conn.goaway_confirm()

    def confirmed(self, conn: Conn) -> None:
        """The second PING came back: every stream the client started has arrived before
        its ack, so the final GOAWAY's last-stream-id covers them all."""
        state = self._conns.get(conn)
        if state is not None and state.phase == _Phase.CONFIRM:
            self._final(conn, state)

    def closed(self, conn: Conn) -> None:
        self._forget(conn)

    # -- policy ------------------------------------------------------------------------------

    def goaway_all(self, grace: float) -> None:
        """Drain: every connection gets the two-step GOAWAY; new ones are refused."""
        self._draining = True
        now = self._clock()
        for conn, state in list(self._conns.items()):
            if state.phase == _Phase.OPEN:
                self._heads_up(conn, state, now, grace, "drain")
            else:
                state.grace_deadline = min(state.grace_deadline, now + grace)
        self._wake.set()

    def sweep(self) -> None:
        """Apply what is due to every connection; cheap enough to run often."""
        now = self._clock()
        cfg = self.config
        for conn, state in list(self._conns.items()):
            if (
                not state.authenticated
                and cfg.auth_timeout is not None
                and now - state.accepted >= cfg.auth_timeout
            ):
                self.closed_unauthenticated += 1
                self._report("auth_timeout")
                self._forget(conn)
                conn.close_idle()
                continue
            if state.phase == _Phase.OPEN:
                if conn.open_streams():
                    state.last_active = now
                elif cfg.idle_timeout is not None and now - state.last_active >= cfg.idle_timeout:
                    self.closed_idle += 1
                    self._report("idle")
                    self._forget(conn)
                    conn.close_idle()
                    continue
                if state.age_deadline is not None and now >= state.age_deadline:
                    self.rotated += 1
                    self._heads_up(conn, state, now, cfg.age_grace, "max_age")
            elif state.phase in (_Phase.HEADS_UP, _Phase.CONFIRM) and (
                now - state.heads_up_at >= cfg.goaway_ack_timeout or now >= state.grace_deadline
            ):
                self._final(conn, state)
            if state.phase == _Phase.FINAL:
                if not conn.open_streams():
                    self._forget(conn)
                    conn.close()
                elif now >= state.grace_deadline:
                    log.warning(
                        "connection_grace_expired",
                        extra={"reason": state.reason, "streams": conn.open_streams()},
                    )
                    self._forget(conn)
                    conn.close()

    def _heads_up(self, conn: Conn, state: _State, now: float, grace: float, reason: str) -> None:
        state.phase = _Phase.HEADS_UP
        state.heads_up_at = now
        state.grace_deadline = now + grace
        state.reason = reason
        conn.goaway_heads_up()

    def _final(self, conn: Conn, state: _State) -> None:
        state.phase = _Phase.FINAL
        conn.goaway_final()

    def _tick(self) -> float:
        """How long until the next sweep is worth doing."""
        if any(s.phase != _Phase.OPEN for s in self._conns.values()):
            return 0.01
        cfg = self.config
        tick = 1.0
        if cfg.idle_timeout is not None:
            tick = min(tick, cfg.idle_timeout / 10)
        if cfg.auth_timeout is not None:
            tick = min(tick, cfg.auth_timeout / 10)
        if cfg.max_age is not None:
            tick = min(tick, cfg.max_age / 20)
        return max(tick, 0.01)

    async def run(self) -> None:
        """Sweep for the serving life (a task in the daemon's nursery)."""
        while True:
            with trio.move_on_after(self._tick()):
                await self._wake.wait()
            self._wake = trio.Event()
            self.sweep()

    async def wait_closed(self) -> None:
        """Until every connection has gone (after `goaway_all`)."""
        while self._conns:
            self.sweep()
            await trio.sleep(0.01)
