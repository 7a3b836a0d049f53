"""Redis Cluster for the directive source: GETs routed by slot, topology kept off the request path.

Cluster routes each GET by its key's slot (MOVED/ASK are redis-py's); topology
refreshes run off the request path (`_IsolatedCluster`, `ClusterReader`), so a
dead master fails only the keys it holds. Its node connections are pooled
inside `ClusterNode`, out of reach of a lease, so every connection it makes is
a `_CloseOnInterrupt` subclass: a read or write that ends without a whole reply
(cancellation, timeout, I/O error) closes the connection before the exception
leaves it, and `ClusterNode` reconnects it on its next use. The key stays
`<org_id>:directive:<agent_id>` (no hash tag): every read is one single-key
GET, so keys may live on any master. Runs on the asyncio side of trio-asyncio,
like the rest of the Redis I/O (`ibex.sources.redis_directive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, Final, cast

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection
from redis.cluster import get_node_name
from redis.exceptions import (
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ibex.errors import SourceError

__all__ = ["REFRESH_INTERVAL", "REFRESH_TIMEOUT", "ClusterReader"]

# At most one topology refresh (CLUSTER SLOTS) per this many seconds, each
# bounded by REFRESH_TIMEOUT; a dead master keeps asking for them.
REFRESH_INTERVAL: Final = 1.0
REFRESH_TIMEOUT: Final = 5.0


class ClusterReader:
    """GETs on a Redis Cluster, and the one task that re-reads its topology.

    Made from the seed node's URL and the client options; a GET that fails,
    times out or is cancelled is an error of that read only and asks for a
    refresh, which this reader runs at most once per `REFRESH_INTERVAL`, never on
    a GET's path. asyncio side: call inside the trio-asyncio loop.
    """

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        # from_url builds the class it is called on (annotated as the base class).
        self.client = cast(_IsolatedCluster, _IsolatedCluster.from_url(url, **options))
        _guard_cluster_connections(self.client)
        # The task reading the topology (owned here, cancelled by close) and when
        # the last one started.
        self._refresh: asyncio.Future[Any] | None = None
        self._refresh_started = -math.inf

    async def get(self, key: str) -> object:
        """The GET's reply, as redis-py gives it; Redis errors raised as redis-py's."""
        cluster = self.client
        if not cluster.ready:
            await self._first_topology()
        else:
            self._maybe_refresh()
        nodes = cluster.nodes_manager.slots_cache.get(cluster.keyslot(key))
        if not nodes:
            # redis-py would answer an uncovered slot by closing every connection and
            # sleeping 250 ms; it is this key's error alone.
            cluster.want_refresh(None)
            raise SourceError("redis cluster: slot not covered")
        node = nodes[0].name
        try:
            reply = await cluster.get(key)
        except (RedisConnectionError, RedisTimeoutError, ClusterError, OSError):
            cluster.want_refresh(node)
            raise
        except (RedisError, RedisClusterException):
            raise  # a whole reply (e.g. WRONGTYPE) or a client-side error: no topology news
        except asyncio.CancelledError:
            # The caller's deadline cut the read off: a stopped master looks like this
            # (its socket timeout is longer than a directive branch), and only a
            # topology read can learn that a replica replaced it.
            cluster.want_refresh(node)
            raise
        except Exception as exc:
            # Anything else redis-py raises on a connection closed under it (e.g.
            # AttributeError on a closed writer) is an error of this read, never a
            # reply, so it stays inside the directive branch like any Redis failure.
            cluster.want_refresh(node)
            raise SourceError(f"redis cluster: {type(exc).__name__}") from None
        return reply

    async def warm(self, connections: int = 1) -> None:
        """Read the topology (if not yet read) and PING every master once, so the
        first GETs find a slot map and a connection to each master. `connections`
        is per master and only 1 is made: a node's connections are redis-py's.
        Raises redis-py's errors; the caller bounds the time."""
        cluster = self.client
        if not cluster.ready:
            await self._first_topology()
        for node in cluster.get_primaries():
            await node.execute_command("PING")

    async def _first_topology(self) -> None:
        """The first topology read: nothing can be routed without it. Shielded: a
        caller cancelled here stops waiting; the read goes on for the next one."""
        task = self._refresh
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = self._refresh = asyncio.ensure_future(self.client.initialize())
        await asyncio.shield(task)

    async def get_many(self, keys: list[str]) -> list[object]:
        """Each key's GET (`get`), concurrently: keys live on any master, so a stopped
        one fails only its own keys. A key's failure is its place's exception."""
        return list(await asyncio.gather(*(self.get(key) for key in keys), return_exceptions=True))

    async def close(self) -> None:
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
            with contextlib.suppress(BaseException):
                await self._refresh
        await self.client.shut_down()

    def _maybe_refresh(self) -> None:
        """Start a topology refresh if one is wanted, none runs and the last started
        at least REFRESH_INTERVAL ago. Never waited for by a GET."""
        cluster = self.client
        if not cluster.refresh_wanted:
            return
        if self._refresh is not None and not self._refresh.done():
            return
        now = time.monotonic()
        if now - self._refresh_started < REFRESH_INTERVAL:
            return
        self._refresh_started = now
        suspects = cluster.take_refresh_request()
        self._refresh = asyncio.ensure_future(_refresh_topology(cluster, suspects))


class _CloseOnInterrupt(AbstractConnection):
    """A connection that closes itself when a command's write or read ends early.

    A reply left unread on the wire would be read by the connection's next
    user: another tenant's GET. A whole error reply (`ResponseError`: MOVED,
    ASK, WRONGTYPE, ...) leaves the connection in step and keeps it open.
    """

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().send_packed_command(*args, **kwargs)
        except BaseException:
            await self.disconnect(nowait=True)
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError:
            raise
        except BaseException:
            await self.disconnect(nowait=True)
            raise


class _GuardedConnection(_CloseOnInterrupt, Connection):
    pass


class _GuardedSSLConnection(_CloseOnInterrupt, SSLConnection):
    pass


_GUARDED: Final[dict[type[AbstractConnection], type[Connection]]] = {
    Connection: _GuardedConnection,
    SSLConnection: _GuardedSSLConnection,
}


def _guard_cluster_connections(client: RedisCluster) -> None:
    """Make every node connection the cluster opens a `_CloseOnInterrupt` one.

    RedisCluster picks Connection or SSLConnection itself and keeps the choice in
    `connection_kwargs`, which its NodesManager shares for every node it creates
    (startup nodes were created already and are patched too). Checked, so a
    redis-py change fails loudly instead of silently losing the guard.
    """
    kwargs = client.connection_kwargs
    if client.nodes_manager.connection_kwargs is not kwargs:
        raise RuntimeError("redis-py's RedisCluster layout changed; cannot guard connections")
    guarded = _GUARDED.get(kwargs["connection_class"])
    if guarded is None:
        raise RuntimeError(f"unexpected cluster connection class {kwargs['connection_class']}")
    kwargs["connection_class"] = guarded
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = guarded


class _GetKeys:
    """The key of a GET, in place of redis-py's `AsyncCommandsParser`.

    That parser learns key positions from `COMMAND`, whose reply (a few hundred
    commands with nested maps) redis-py decodes in pure Python on the loop, tens
    of milliseconds of CPU (docs/performance.md), on the first GET and again at
    every full topology re-read. This source only routes GETs.
    """

    async def initialize(self, node: Any = None) -> None:
        return None

    async def get_keys(self, *args: Any) -> tuple[Any, ...]:
        if len(args) == 2 and str(args[0]).upper() == "GET":
            return (args[1],)
        raise RedisClusterException(f"{str(args[0])[:20]}: only GET is routed here")


class _IsolatedCluster(RedisCluster):
    """A RedisCluster whose request path never re-reads the topology or closes
    connections that other GETs use.

    redis-py answers a node's connection error or timeout by flagging the client
    so that the *next command, whatever its key*, first re-reads the topology
    inline (trying startup nodes in turn, a stopped one until its socket
    timeout), and answers CLUSTERDOWN or an uncovered slot with `aclose()`,
    which drops every node connection. Either way one dead master stalls or
    fails the reads of every other master. Here, after the first topology read,
    both only record that a refresh is wanted; `ClusterReader` runs it off
    the request path (`_refresh_topology`), and `shut_down` is the one real
    close.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = cast(Any, _GetKeys())
        self.ready = False
        self.refresh_wanted = False
        self._suspects: set[str] = set()
        self._shutting_down = False

    def want_refresh(self, suspect: str | None) -> None:
        """Ask for a topology refresh; `suspect` (a node name) is asked last."""
        self.refresh_wanted = True
        if suspect is not None and len(self._suspects) < 64:
            self._suspects.add(suspect)

    def take_refresh_request(self) -> frozenset[str]:
        suspects = frozenset(self._suspects)
        self.refresh_wanted = False
        self._suspects.clear()
        return suspects

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> _IsolatedCluster:
        if self.ready:
            # Called inline by a command after another one failed: not here.
            self._initialize = False
            self.want_refresh(last_failed_node_name)
            return self
        await super().initialize(additional_startup_nodes_info, last_failed_node_name)
        self.ready = True
        return self

    async def aclose(self) -> None:
        if self.ready and not self._shutting_down:
            # redis-py's reaction to CLUSTERDOWN or an uncovered slot, mid-request.
            self.want_refresh(None)
            return
        await super().aclose()

    async def shut_down(self) -> None:
        """Close every node connection (the reader's close)."""
        self._shutting_down = True
        # redis-py's aclose closes nothing while a failed command has flagged the
        # client for re-initialisation, which this class leaves flagged until the
        # next command; the connections are open either way.
        self._initialize = False
        await super().aclose()


async def _refresh_topology(cluster: _IsolatedCluster, suspects: frozenset[str]) -> None:
    """Re-read the slot map; rebuild redis-py's only if it changed.

    A master that died without a replica leaves the slot map as it was, and
    redis-py's rebuild marks every connection of every node for reconnection:
    after each refresh, each healthy master's next GETs would pay a new
    connection inside their 5 ms. So one CLUSTER SLOTS, from a node not under
    suspicion first, is compared with the map in use. Errors end the refresh
    quietly: the next failed GET asks again.
    """
    manager = cluster.nodes_manager
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFRESH_TIMEOUT):
            nodes = sorted(manager.nodes_cache.values(), key=lambda n: n.name in suspects)
            for node in nodes:
                try:
                    slots = await node.execute_command("CLUSTER SLOTS")
                except (RedisError, OSError):
                    continue
                if _same_slot_map(manager, node.host, slots):
                    return
                break
            failed = next(iter(suspects), None)
            await manager.initialize(last_failed_node_name=failed)


def _same_slot_map(manager: Any, host: str, slots: Any) -> bool:
    """Whether a CLUSTER SLOTS reply gives every slot the master the map in use has.

    Each range's end slots are compared and the counts must agree, which costs
    microseconds where a slot-by-slot check would hold the loop for a
    millisecond or more; a change hidden inside a range is still fixed by the
    MOVED its first GET gets.
    """
    cache = manager.slots_cache
    covered = 0
    try:
        for entry in slots:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            node_host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
            name = get_node_name(*manager.remap_host_port(node_host or host, int(primary[1])))
            for slot in (start, end):
                owners = cache.get(slot)
                if not owners or owners[0].name != name:
                    return False
            covered += end - start + 1
    except (TypeError, ValueError, IndexError, AttributeError, UnicodeDecodeError):
        return False
    return covered == len(cache)
