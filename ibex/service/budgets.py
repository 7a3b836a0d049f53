"""Request bytes in flight, by share: each caller and each connection holds at most its
own part of `MAX_IN_FLIGHT_BYTES`, and unauthenticated reads draw on a pool of their own.

One process-wide byte cap lets a single holder take all of it: a caller that
declares large messages and sends them slowly keeps every other caller's calls
out. grpc-go and Envoy bound request buffering per stream and per connection;
here each request's bytes are counted against three budgets at once:

- the process's `max_in_flight_bytes` (the `BytesCap` policy);
- its connection's share and, once authenticated, its caller's share
  (`max_caller_bytes` each; the caller is the token identity or mTLS principal
  `Authenticator.authenticate` returns, so one caller's many connections share
  one budget);
- or, for Health, reflection and any read before authentication, the separate
  `max_unauthenticated_bytes` pool, of which one connection holds at most a quarter.

A reservation beyond a share is refused (RESOURCE_EXHAUSTED, reason
`in_flight`) for that holder only. Like the process cap, a share always fits one
message when its holder has nothing else in flight. Bytes are reserved as they are
read (`ibex.service.edge.stream_reads.recv_next`: what has arrived plus one look-ahead
step), not by the declared length alone, so a prefix declaring 4 MiB holds one step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ibex.errors import Overloaded

#: The share of the unauthenticated pool one connection may hold (a quarter).
UNAUTHENTICATED_CONNECTION_SHARE = 4


class Shares:
    """Bytes held per key (a caller, a connection), each at most `limit`."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[Hashable, int] = {}

    def over(self, key: Hashable, own: int, size: int) -> int | None:
        """The bytes `key` holds when `size` more would pass its share (else None).

        `own` is what the asking request holds already: a holder with nothing but that
        request in flight may always grow it (one message always fits)."""
        held = self.held.get(key, 0)
        if held - own > 0 and held + size > self.limit:
            return held
        return None

    def add(self, key: Hashable, size: int) -> None:
        held = self.held.get(key, 0) + size
        if held > 0:
            self.held[key] = held
        else:
            self.held.pop(key, None)


class Pool:
    """One budget of request bytes (a total) with its per-key shares."""

    __slots__ = ("held", "limit", "shares")

    def __init__(self, limit: int, share: int) -> None:
        self.limit = limit
        self.held = 0
        self.shares = Shares(share)


class Reservation:
    """One request's bytes in flight: grown before each part is read, released once."""

    __slots__ = ("_grow", "_release", "held")

    def __init__(
        self,
        grow: Callable[[Reservation, int], None],
        release: Callable[[Reservation], None],
    ) -> None:
        self._grow = grow
        self._release = release
        self.held = 0

    def grow(self, size: int) -> None:
        """Count `size` more bytes (raises `Overloaded` to refuse them)."""
        self._grow(self, size)
        self.held += size

    def release(self) -> None:
        """Give back everything held (idempotent)."""
        if self.held:
            self._release(self)
            self.held = 0


class UnauthenticatedBytes:
    """The pool Health, reflection and reads before authentication draw on."""

    def __init__(self, limit: int, refused: Callable[[str], None] = lambda reason: None) -> None:
        self.pool = Pool(limit, max(1, limit // UNAUTHENTICATED_CONNECTION_SHARE))
        self._refused = refused  # told the reason of each refusal (the shed metric)

    @property
    def held(self) -> int:
        return self.pool.held

    def reservation(self, connection: Hashable) -> Reservation:
        pool = self.pool
        refused = self._refused

        def grow(r: Reservation, size: int) -> None:
            if pool.held - r.held > 0 and pool.held + size > pool.limit:
                refused("in_flight")
                raise Overloaded(
                    "in_flight",
                    f"overloaded: {pool.held} unauthenticated request bytes in flight, {size} more",
                )
            if pool.shares.over(connection, r.held, size) is not None:
                refused("in_flight")
                raise Overloaded(
                    "in_flight",
                    "overloaded: this connection holds its share of the unauthenticated "
                    "request bytes",
                )
            pool.held += size
            pool.shares.add(connection, size)

        def release(r: Reservation) -> None:
            pool.held -= r.held
            pool.shares.add(connection, -r.held)

        return Reservation(grow, release)
