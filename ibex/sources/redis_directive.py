"""Directive source backed by the proxy-filled Redis cache (contract section 3).

The daemon's Trio code calls `get_directive`; the Redis I/O is redis-py's asyncio
client, crossed with `trio_asyncio.aio_as_trio`, so every call must run inside
`trio_asyncio.open_loop()`. The client is built in the constructor (that only
parses the URL) and binds to the running loop on first use: use one source per
process and per loop, and `aclose()` it inside the same loop. The value's format
is `ibex.sources.directive_envelope` (sans-IO); this module only fetches bytes.

The caller owns the deadline (the directive branch's 5 ms cancel scope); the
topologies' socket timeouts are only a backstop (`ibex.sources.redis_topologies`).

Cancellation: a GET cancelled mid-flight leaves its reply on the wire. If that
connection went back to the pool, the next lease would read the previous
tenant's directive. redis-py 8 closes the socket on BaseException inside
`read_response`/`send_packed_command`, but this module does not rely on it: the
lease below closes the connection on any BaseException *before* releasing it.
A cancellation must also stop the GET: redis-py writes every command under
`asyncio.wait_for`, which before Python 3.12 can drop a cancellation (CPython
gh-86296); `ibex.patches.redis_connection`, installed at start-up, fixes that.

Topologies: one source class over a reader (`ibex.sources.redis_topologies`),
built by three small constructors sharing one set of options (`RedisOptions`):
one endpoint (`RedisDirectiveSource(url)`), Redis Sentinel
(`RedisDirectiveSource.sentinel`) and Redis Cluster (`RedisDirectiveSource.cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio_asyncio
from redis.asyncio.sentinel import MasterNotFoundError
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
from ibex.sources.directive_envelope import decode_directive, directive_key
from ibex.sources.redis_pool_reader import PoolReader
from ibex.sources.redis_topologies import (
    DEFAULTS,
    Reader,
    RedisOptions,
    cluster_reader,
    endpoint_reader,
    sentinel_reader,
)

__all__ = ["RedisDirectiveSource", "RedisOptions", "decode_directive", "directive_key"]

log = logging.getLogger(__name__)

# Several agents' answers, in the order asked: a directive, None (no key) or the key's error.
_Answers = list[Directive | SourceError | None]


class RedisDirectiveSource:
    """DirectiveSource over a Redis (or Redis-compatible) server, read-only.

    `url` may be `redis://`, `rediss://` or `unix://`. Extra keyword arguments
    go to `redis.asyncio.ConnectionPool` (e.g. TLS CA files). For Sentinel and
    Cluster use the `sentinel` and `cluster` constructors.
    """

    def __init__(self, url: str, options: RedisOptions = DEFAULTS, **pool_kwargs: Any) -> None:
        self._over(endpoint_reader(url, options, **pool_kwargs), options)

    def _over(self, reader: Reader, options: RedisOptions) -> None:
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
        options: RedisOptions = DEFAULTS,
        **kwargs: Any,
    ) -> RedisDirectiveSource:
        """The master named `master`, found through `sentinels`, followed across failovers.

        `kwargs` are `sentinel_reader`'s (`ibex.sources.redis_topologies`): `url` for the
        data nodes' credentials and TLS, which the sentinels share, `sentinel_password`,
        and the pool's own options."""
        source = cls.__new__(cls)
        source._over(sentinel_reader(sentinels, master, options=options, **kwargs), options)
        return source

    @classmethod
    def cluster(
        cls, url: str, options: RedisOptions = DEFAULTS, **cluster_kwargs: Any
    ) -> RedisDirectiveSource:
        """A Redis Cluster discovered from the seed node `url` (`redis://` or `rediss://`),
        its topology refreshed off the read path
        (`ibex.sources.redis_topologies.cluster_reader`)."""
        source = cls.__new__(cls)
        source._over(cluster_reader(url, options, **cluster_kwargs), options)
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
