"""`ConnectionsConfig`: the gRPC port's connection limits, each setting declared on its field.

Apart from `ibex.service.edge.connections` (what is done with the limits) so the
settings table (`ibex.config`) reads the declarations without loading Trio.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env

__all__ = [
    "MAX_CONNECTIONS_CEILING",
    "NOFILE_HEADROOM",
    "ConnectionsConfig",
    "default_max_connections",
]

NOFILE_HEADROOM = 64  # fds kept for listeners, Redis, the memory pool, logs, /metrics
MAX_CONNECTIONS_CEILING = 1024


def default_max_connections(soft_limit: int | None = None) -> int:
    """min(1024, RLIMIT_NOFILE soft limit - 64), at least 1: room for every other fd."""
    if soft_limit is None:
        import resource

        soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft_limit == resource.RLIM_INFINITY:
            return MAX_CONNECTIONS_CEILING
    return max(1, min(MAX_CONNECTIONS_CEILING, soft_limit - NOFILE_HEADROOM))


class ConnectionsConfig(msgspec.Struct, frozen=True):
    """Connection limits (seconds). None turns the per-peer cap, the idle close, the close of
    unauthenticated connections or the age rotation off."""

    max_connections: int = MAX_CONNECTIONS_CEILING
    max_per_peer: int | None = None
    auth_timeout: Annotated[float | None, env("IBEX_CONTEXT_CONNECTION_AUTH_TIMEOUT", unit="s")] = (
        10.0
    )
    first_call_grace: Annotated[
        float, env("IBEX_CONTEXT_CONNECTION_FIRST_CALL_GRACE", unit="s")
    ] = 2.0  # an unauthenticated connection this young is not evicted
    peer_rate: Annotated[
        float | None, env("IBEX_CONTEXT_CONNECTION_RATE_PER_PEER", bounds=(0.1, 1_000_000.0))
    ] = 20.0  # new connections per second per peer IP (burst: twice)
    tls_handshake_timeout: Annotated[float, env("IBEX_CONTEXT_TLS_HANDSHAKE_TIMEOUT", unit="s")] = (
        5.0
    )
    idle_timeout: Annotated[float | None, env("IBEX_CONTEXT_CONNECTION_IDLE_TIMEOUT", unit="s")] = (
        300.0
    )
    max_age: Annotated[float | None, env("IBEX_CONTEXT_MAX_CONNECTION_AGE", unit="s")] = None
    age_grace: float = 10.0
    # A client answers a PING within a round trip; one that has not after this long is
    # not reading (or ignores PINGs), and its streams get the final GOAWAY anyway. Well
    # above a loaded host's stalls: a final GOAWAY sent before the client has read the
    # first one excludes the streams it is still starting.
    goaway_ack_timeout: float = 5.0
