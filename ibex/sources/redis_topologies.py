"""The Redis topologies a directive source reads from, built by redis-py from one set of
options (`RedisOptions`).

Three readers (`ibex.sources.redis_directive.RedisDirectiveSource` reads through
one): one endpoint (`endpoint_reader`), Redis Sentinel (`sentinel_reader`) and Redis
Cluster (`cluster_reader`), all with redis-py's own asyncio clients. Sentinel uses
redis-py's `SentinelConnectionPool`, a `ConnectionPool` whose connections ask the
sentinels for the master when they connect, so the same lease (and its
close-before-release, `ibex.sources.redis_pool_reader`) applies; after a failover the
sentinels kill the old master's client connections, the pool reconnects to the new
master and directives flow again within seconds. With a `rediss://` URL the
sentinels are asked over TLS too (same CA and client certificate): the sentinel
password never crosses the wire in clear, and only a sentinel with a trusted
certificate can name the master. Cluster is `ibex.sources.redis_cluster` (slot
routing, topology refreshes off the request path, connections that close when a
command ends early).

Time policy: the caller owns the deadline (the directive branch's 5 ms cancel
scope). The socket timeouts below are only a backstop for callers without a
deadline; connects are not retried, so a dead Redis surfaces in well under a
millisecond, and one immediate re-lease after a broken connection picks up a
restarted Redis without operator action.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import redis.asyncio as aredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException

from ibex.errors import SourceError
from ibex.sources.directive_envelope import MAX_VALUE_BYTES
from ibex.sources.redis_cluster import ClusterReader
from ibex.sources.redis_pool_reader import PoolReader

__all__ = [
    "CLIENT_NAME",
    "DEFAULTS",
    "Reader",
    "RedisOptions",
    "cluster_reader",
    "endpoint_reader",
    "malformed_url",
    "sentinel_reader",
]

CLIENT_NAME: Final = "ibex-directive"
# TLS options of the data nodes' URL (or keyword arguments) that the sentinels'
# connections share: one CA, one client certificate, one hostname policy.
_SENTINEL_TLS_OPTIONS: Final = frozenset(
    {
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_ca_path",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
        "ssl_password",
    }
)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """What every topology takes, so the three constructors share one option set;
    URL query options (e.g. `?socket_timeout=0.5`) override these."""

    # Backstop timeouts (seconds). Loopback or same-zone Redis answers in well under
    # a millisecond; anything slower than this is useless to a 5 ms branch anyway.
    connect_timeout: float = 0.1
    socket_timeout: float = 0.1
    # A GET whose *established* pooled connection (one endpoint, Sentinel) breaks
    # mid-command is re-leased this many times, at once, after the pool's idle
    # connections are dropped. That is what makes a restarted server work on the
    # very next call: pooled sockets still point at the old process, and asyncio
    # may not have seen their FIN yet, so the pool's own stale-connection check can
    # miss them. A failed connect is not retried, nor is a timeout: a refused or
    # stuck server stays so within a 5 ms branch, and a backoff sleep alone costs
    # ~1.5 ms under trio-asyncio. (redis-py's client default is 3 retries up to
    # 10 s apart with 5 s socket timeouts: seconds before a dead Redis surfaces.)
    # Cluster nodes reconnect on their own next use instead.
    retries: int = 1
    # PING a connection that sat idle this long before reusing it (seconds).
    health_check_interval: float = 30.0
    max_connections: int = 64
    max_value_bytes: int = MAX_VALUE_BYTES

    def connection(self, health_check_interval: float | None = None) -> dict[str, Any]:
        """redis-py's connection options (see the time policy above)."""
        if health_check_interval is None:
            health_check_interval = self.health_check_interval
        return {
            "socket_connect_timeout": self.connect_timeout,
            "socket_timeout": self.socket_timeout,
            "health_check_interval": health_check_interval,
            # Named in CLIENT LIST for operators; CLIENT SETINFO skipped (one less
            # round trip per new connection, and Redis < 7.2 rejects it anyway).
            "client_name": CLIENT_NAME,
            "driver_info": None,
            # No retry inside redis-py: `PoolReader`'s re-lease is the only one (and in a
            # cluster a retry would re-read the topology inline).
            "retry": Retry(NoBackoff(), 0),
        }

    def pool(self, **extra: Any) -> dict[str, Any]:
        """A connection pool's (or cluster client's) options, `extra` on top."""
        return {**self.connection(), "max_connections": self.max_connections, **extra}


DEFAULTS: Final = RedisOptions()


class Reader(Protocol):
    """A topology's GET (asyncio side), Redis errors raised as redis-py's."""

    async def get(self, key: str) -> object: ...

    async def warm(self, connections: int) -> None: ...
    async def get_many(self, keys: list[str]) -> list[object]:
        """The keys' values in order; a key's own failure (an exception) in its place."""
        ...

    async def close(self) -> None: ...


def malformed_url() -> SourceError:
    # The URL may hold a password: never echo it.
    return SourceError("redis url: malformed (expected redis://, rediss:// or unix://)")


def endpoint_reader(url: str, options: RedisOptions = DEFAULTS, **pool_kwargs: Any) -> PoolReader:
    """One endpoint: `url` is `redis://`, `rediss://` or `unix://`; extra keyword arguments
    go to `redis.asyncio.ConnectionPool` (e.g. TLS CA files)."""
    try:
        pool = aredis.ConnectionPool.from_url(url, **options.pool(**pool_kwargs))
    except ValueError:
        raise malformed_url() from None
    return PoolReader(pool, options.retries)


def sentinel_reader(
    sentinels: Sequence[tuple[str, int]],
    master: str,
    *,
    url: str | None = None,
    sentinel_password: str | None = None,
    options: RedisOptions = DEFAULTS,
    **pool_kwargs: Any,
) -> PoolReader:
    """The master named `master`, found through `sentinels`, followed across failovers.

    `url` (optional, `redis://` or `rediss://`) gives the data nodes'
    username, password, db, TLS and URL options; its host and port are
    ignored. The sentinels are asked with `sentinel_password` (their
    `requirepass`), if any, over TLS when `url` is `rediss://` (with the same
    `ssl_*` options: CA, client certificate, hostname check), else over plain
    TCP. TLS to the data nodes and not to the sentinels would send the
    sentinel password in clear and let anyone who can answer as a sentinel
    name the master.
    """
    if not sentinels:
        raise SourceError("redis sentinel: no sentinel addresses")
    pool_options = options.pool(connection_class=SentinelManagedConnection)
    tls = False
    if url is not None:
        try:
            from_url: dict[str, Any] = dict(parse_url(url))
        except ValueError:
            raise malformed_url() from None
        if from_url.pop("connection_class", None) is SSLConnection:
            pool_options["connection_class"] = SentinelManagedSSLConnection
            tls = True
        for endpoint in ("host", "port", "path"):
            from_url.pop(endpoint, None)
        pool_options.update(from_url)  # URL query options override the defaults
    pool_options.update(pool_kwargs)
    sentinel_options = {**options.connection(0), "password": sentinel_password}
    if tls:
        sentinel_options["ssl"] = True
        for name, value in pool_options.items():
            if name in _SENTINEL_TLS_OPTIONS:
                sentinel_options[name] = value
    manager = Sentinel(list(sentinels), sentinel_kwargs=sentinel_options)
    pool = SentinelConnectionPool(master, manager, **pool_options)
    return PoolReader(pool, options.retries, manager)


def cluster_reader(
    url: str, options: RedisOptions = DEFAULTS, **cluster_kwargs: Any
) -> ClusterReader:
    """A Redis Cluster discovered from the seed node `url` (`redis://` or `rediss://`).

    Slots and MOVED/ASK are redis-py's; topology refreshes are
    `ibex.sources.redis_cluster`'s, never on a GET's path: a stopped master
    (whose CLUSTER SLOTS hangs) cannot hold or fail the reads of keys on the
    other masters. Slots without a live master answer errors (or their
    caller's timeout) while every other slot keeps answering.
    """
    client_options = options.pool(
        # MOVED patches the slot map; a full refresh after N MOVED would close
        # every node connection, in-flight ones included.
        reinitialize_steps=0,
        require_full_coverage=False,
        **cluster_kwargs,
    )
    try:
        return ClusterReader(url, client_options)
    except (ValueError, RedisClusterException):
        raise malformed_url() from None
