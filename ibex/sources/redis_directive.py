"""Directive source backed by the proxy-filled Redis cache (contract section 3).

The daemon's Trio code calls `get_directive`; the Redis I/O is redis-py's asyncio
client, crossed with `trio_asyncio.aio_as_trio`, so every call must run inside
`trio_asyncio.open_loop()`. The client is built in the constructor (that only
parses the URL) and binds to the running loop on first use: use one source per
process and per loop, and `aclose()` it inside the same loop. The value's format
is `ibex.sources.directive_envelope` (sans-IO); this module only fetches bytes.

Time policy: the caller owns the deadline (the directive branch's 5 ms cancel
scope). The socket timeouts below are only a backstop for callers without a
deadline; connects are not retried, so a dead Redis surfaces in well under a
millisecond, and one immediate re-lease after a broken connection picks up a
restarted Redis without operator action.

Cancellation: a GET cancelled mid-flight leaves its reply on the wire. If that
connection went back to the pool, the next lease would read the previous
tenant's directive. redis-py 8 closes the socket on BaseException inside
`read_response`/`send_packed_command`, but this module does not rely on it: the
lease below closes the connection on any BaseException *before* releasing it.
A cancellation must also stop the GET: redis-py writes every command under
`asyncio.wait_for`, which before Python 3.12 can drop a cancellation (CPython
gh-86296); `ibex.patches.redis_connection`, installed at start-up, fixes that.

Topologies: one source class over a reader, built by three small constructors
sharing one set of options (`RedisOptions`): one endpoint
(`RedisDirectiveSource(url)`), Redis Sentinel (`RedisDirectiveSource.sentinel`)
and Redis Cluster (`RedisDirectiveSource.cluster`), all with redis-py's own
asyncio clients. Sentinel uses redis-py's `SentinelConnectionPool`, a
`ConnectionPool` whose connections ask the sentinels for the master when they
connect, so the same lease (and its close-before-release) applies; after a
failover the sentinels kill the old master's client connections, the pool
reconnects to the new master and directives flow again within seconds. With a
`rediss://` URL the sentinels are asked over TLS too (same CA and client
certificate): the sentinel password never crosses the wire in clear, and only a
sentinel with a trusted certificate can name the master. Cluster is
`ibex.sources.redis_cluster` (slot routing, topology refreshes off the request
path, connections that close when a command ends early).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import redis.asyncio as aredis
import trio_asyncio
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MaxConnectionsError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.directive_envelope import MAX_VALUE_BYTES, decode_directive, directive_key
from ibex.sources.redis_cluster import ClusterReader
from ibex.sources.redis_pool_reader import PoolReader

__all__ = ["RedisDirectiveSource", "RedisOptions", "decode_directive", "directive_key"]

log = logging.getLogger(__name__)

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
            # No retry inside redis-py: the re-lease below is the only one (and in a
            # cluster a retry would re-read the topology inline).
            "retry": Retry(NoBackoff(), 0),
        }

    def pool(self, **extra: Any) -> dict[str, Any]:
        """A connection pool's (or cluster client's) options, `extra` on top."""
        return {**self.connection(), "max_connections": self.max_connections, **extra}


DEFAULTS: Final = RedisOptions()


class _Reader(Protocol):
    """A topology's GET (asyncio side), Redis errors raised as redis-py's."""

    async def get(self, key: str) -> object: ...

    async def warm(self, connections: int) -> None: ...
    async def get_many(self, keys: list[str]) -> list[object]:
        """The keys' values in order; a key's own failure (an exception) in its place."""
        ...

    async def close(self) -> None: ...


# Several agents' answers, in the order asked: a directive, None (no key) or the key's error.
_Answers = list[Directive | SourceError | None]


def _malformed_url() -> SourceError:
    # The URL may hold a password: never echo it.
    return SourceError("redis url: malformed (expected redis://, rediss:// or unix://)")


class RedisDirectiveSource:
    """DirectiveSource over a Redis (or Redis-compatible) server, read-only.

    `url` may be `redis://`, `rediss://` or `unix://`. Extra keyword arguments
    go to `redis.asyncio.ConnectionPool` (e.g. TLS CA files). For Sentinel and
    Cluster use the `sentinel` and `cluster` constructors.
    """

    def __init__(self, url: str, options: RedisOptions = DEFAULTS, **pool_kwargs: Any) -> None:
        try:
            pool = aredis.ConnectionPool.from_url(url, **options.pool(**pool_kwargs))
        except ValueError:
            raise _malformed_url() from None
        self._over(PoolReader(pool, options.retries), options)

    def _over(self, reader: _Reader, options: RedisOptions) -> None:
        self._reader = reader
        # One endpoint or Sentinel's master: `get_directives` is one MGET. A cluster's
        # keys live on any master, one GET each: a cache reads them apart (`batch_reader`).
        self.batch_reads = isinstance(reader, PoolReader)
        self._max_value_bytes = options.max_value_bytes
        self._closed = False

    @classmethod
    def sentinel(
        cls,
        sentinels: Sequence[tuple[str, int]],
        master: str,
        *,
        url: str | None = None,
        sentinel_password: str | None = None,
        options: RedisOptions = DEFAULTS,
        **pool_kwargs: Any,
    ) -> RedisDirectiveSource:
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
                raise _malformed_url() from None
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
        source = cls.__new__(cls)
        source._over(PoolReader(pool, options.retries, manager), options)
        return source

    @classmethod
    def cluster(
        cls, url: str, options: RedisOptions = DEFAULTS, **cluster_kwargs: Any
    ) -> RedisDirectiveSource:
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
            reader = ClusterReader(url, client_options)
        except (ValueError, RedisClusterException):
            raise _malformed_url() from None
        source = cls.__new__(cls)
        source._over(reader, options)
        return source

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        """The directive, or None when the key is missing. Trio-async; cancel freely.

        Always reads the key: `version` (what the caller expects) is not needed here."""
        if self._closed:
            raise SourceError("redis directive source is closed")
        key = directive_key(org_id, agent_id)
        raw = await trio_asyncio.aio_as_trio(self._get)(key)
        return decode_directive(raw, self._max_value_bytes)

    async def warm(self, connections: int = 1) -> None:
        """Make the connections a read needs now, not on a call's path. Trio-async.

        One endpoint and Sentinel: lease `connections` pooled connections at once
        (opening those the pool lacks; Sentinel asks the sentinels for the
        master), PING each and release them. Cluster: read the topology and PING
        every master once. Raises SourceError (no secret in it) when Redis cannot
        be reached; the caller bounds the time. Also the liveness probe: a PING on
        the connection the next GET takes resets its health-check clock, so an
        idle pool never pays redis-py's health-check PING inside a 5 ms branch.
        """
        if self._closed:
            raise SourceError("redis directive source is closed")
        await trio_asyncio.aio_as_trio(self._warm)(connections)

    async def _warm(self, connections: int) -> None:
        try:
            await self._reader.warm(connections)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise _source_error(exc) from None

    async def aclose(self) -> None:
        """Disconnect every pooled connection. Trio-async, inside the same loop."""
        if self._closed:
            return
        self._closed = True
        # A dead or paused server cannot stop the close: the sockets are ours to drop.
        with contextlib.suppress(RedisError, OSError):
            await trio_asyncio.aio_as_trio(self._reader.close)()

    async def get_directives(
        self,
        wanted: Sequence[tuple[str, str, str]],
        on_answers: Callable[[list[Directive | SourceError | None]], None] | None = None,
    ) -> list[Directive | SourceError | None]:
        """Several agents' directives in one round trip (one endpoint, Sentinel: GET for
        one key, else MGET; a cluster: one GET per key, concurrently), in order. A value
        that does not decode is that agent's SourceError; a failed round trip raises one.
        Trio-async; cancel freely. Each (org_id, agent_id, version) is read whatever its
        version.

        `on_answers`, when given, is called with the answers (synchronously, on the
        asyncio side) as soon as the reply is parsed: the two loop passes the answers
        then take to come back to this Trio task are not waited for by whoever the
        callback tells."""
        if self._closed:
            raise SourceError("redis directive source is closed")
        keys = [directive_key(org_id, agent_id) for org_id, agent_id, _ in wanted]
        return await trio_asyncio.aio_as_trio(self._get_many)(keys, on_answers)

    def start_directives(
        self,
        take: Callable[[], list[tuple[str, str, str]]],
        on_answers: Callable[[list[Directive | SourceError | None]], None],
    ) -> Callable[[], Awaitable[list[Directive | SourceError | None]]]:
        """Start `get_directives` now, as an asyncio task, for the keys `take()` returns
        when that task first runs; return the Trio-async wait for its answers. No I/O here.

        Called from the asyncio side (a gRPC handler's step), the task's first step
        is queued on the loop behind that step: every call read from the same socket
        read queues its key before the task takes them (one MGET), and the command is
        sent in the loop's next round of callbacks, before the Trio tasks those calls
        start. The wait owns the task: cancelled (or never awaited past a
        cancellation), it cancels the task, whose lease closes its connection."""
        if self._closed:
            raise SourceError("redis directive source is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise SourceError("redis directive source: no asyncio loop running") from None
        task = loop.create_task(self._take_many(take, on_answers))

        async def wait() -> list[Directive | SourceError | None]:
            try:
                answers: _Answers = await trio_asyncio.run_aio_future(task)
                return answers
            finally:
                task.cancel()  # a no-op once it is done

        return wait

    async def _take_many(
        self,
        take: Callable[[], list[tuple[str, str, str]]],
        on_answers: Callable[[list[Directive | SourceError | None]], None],
    ) -> list[Directive | SourceError | None]:
        wanted = take()
        if not wanted:
            return []
        keys = [directive_key(org_id, agent_id) for org_id, agent_id, _ in wanted]
        return await self._get_many(keys, on_answers)

    def _decode(self, raw: bytes | SourceError | None) -> Directive | SourceError | None:
        if isinstance(raw, SourceError):
            return raw
        try:
            return decode_directive(raw, self._max_value_bytes)
        except SourceError as exc:
            return exc

    async def _get(self, key: str) -> bytes | None:
        """asyncio side: one GET through the reader, errors mapped to SourceError."""
        try:
            reply = await self._reader.get(key)
        except (RedisError, OSError) as exc:
            raise _source_error(exc) from None
        return _value(reply)

    async def _get_many(
        self,
        keys: list[str],
        on_answers: Callable[[list[Directive | SourceError | None]], None] | None,
    ) -> list[Directive | SourceError | None]:
        """asyncio side: every key through the reader (`get` for one, `get_many`),
        errors mapped to SourceError (a whole round trip's raised, a key's own in its
        place), values decoded; `on_answers` told before they are returned, on one
        endpoint or Sentinel as soon as the reply's bytes arrive (`PoolReader.get_early`)."""
        told = False

        def early(raws: list[bytes | None]) -> None:
            nonlocal told
            assert on_answers is not None
            on_answers([self._decode(raw) for raw in raws])
            told = True

        reader = self._reader
        try:
            if on_answers is not None and isinstance(reader, PoolReader):
                replies: list[object] = await reader.get_early(keys, early, self._max_value_bytes)
            elif len(keys) == 1:
                replies = [await reader.get(keys[0])]
            else:
                replies = await reader.get_many(keys)
        except (RedisError, OSError) as exc:
            raise _source_error(exc) from None
        if len(replies) != len(keys):
            raise SourceError(f"redis: {len(replies)} values for {len(keys)} keys")
        out: list[bytes | SourceError | None] = []
        for reply in replies:
            if isinstance(reply, SourceError):
                out.append(reply)
            elif isinstance(reply, (RedisError, OSError)):
                out.append(_source_error(reply))
            elif isinstance(reply, BaseException):
                out.append(SourceError(f"redis: {type(reply).__name__}"))
            else:
                try:
                    out.append(_value(reply))
                except SourceError as exc:
                    out.append(exc)
        answers = [self._decode(raw) for raw in out]
        if on_answers is not None and not told:
            on_answers(answers)
        return answers


def _value(reply: object) -> bytes | None:
    if reply is not None and not isinstance(reply, bytes):
        raise SourceError(f"redis: unexpected reply type {type(reply).__name__}")
    return reply


def _source_error(exc: BaseException) -> SourceError:
    """A redis-py failure as the branch's short SourceError (no value, no secret)."""
    if isinstance(exc, SourceError):
        return exc
    if isinstance(exc, RedisTimeoutError):
        return SourceError("redis: timed out")
    if isinstance(exc, MaxConnectionsError):
        return SourceError("redis: connection pool exhausted")
    if isinstance(exc, MasterNotFoundError):
        return SourceError("redis: no master found by the sentinels")
    if isinstance(exc, RedisConnectionError):
        return SourceError("redis: connection failed")
    if isinstance(exc, ResponseError):
        # The server's error prefix (e.g. WRONGTYPE) says enough; the rest may echo input.
        prefix = str(exc).split(" ", 1)[0][:32]
        return SourceError(f"redis: error reply {prefix}")
    if isinstance(exc, RedisClusterException):
        return SourceError(f"redis cluster: {type(exc).__name__}")
    return SourceError(f"redis: {type(exc).__name__}")
