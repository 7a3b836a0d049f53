"""The cluster client's request path never re-reads the topology or closes other GETs'
connections, and a refresh rebuilds the slot map only when CLUSTER SLOTS changed.

No server: the client is built (it connects lazily) and its slot map set by hand.
The behaviour under a real stopped master is in
tests/integration/test_redis_topologies.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio.cluster import ClusterNode
from redis.exceptions import RedisClusterException

from ibex.sources.redis_directive import (
    RedisDirectiveSource,
    _GetKeys,
    _IsolatedCluster,
    _same_slot_map,
)

A, B, C = ("127.0.0.1", 7000), ("127.0.0.1", 7001), ("127.0.0.1", 7002)


_made: list[_IsolatedCluster] = []


def cluster() -> _IsolatedCluster:
    source = RedisDirectiveSource.cluster("redis://127.0.0.1:7000")
    client = source._cluster
    assert isinstance(client, _IsolatedCluster)
    _made.append(client)
    return client


@pytest.fixture(autouse=True)
def _unflag_clients() -> Iterator[None]:
    """A client left flagged as initialised warns when collected, through whatever
    asyncio loop runs then: a later test's. These never connected; say so."""
    yield
    for client in _made:
        client._initialize = True
    _made.clear()


def set_map(client: _IsolatedCluster, ranges: list[tuple[int, int, tuple[str, int]]]) -> None:
    manager = client.nodes_manager
    nodes = {f"{h}:{p}": ClusterNode(h, p) for _, _, (h, p) in ranges}
    manager.nodes_cache = nodes
    manager.slots_cache = {
        slot: [nodes[f"{h}:{p}"]] for lo, hi, (h, p) in ranges for slot in range(lo, hi + 1)
    }


def reply(ranges: list[tuple[int, int, tuple[str, int]]]) -> list[Any]:
    """CLUSTER SLOTS as redis-py returns it unparsed (hosts as bytes)."""
    return [[lo, hi, [h.encode(), p, b"id"]] for lo, hi, (h, p) in ranges]


THREE = [(0, 5460, A), (5461, 10922, B), (10923, 16383, C)]


def test_the_same_map_is_recognised_and_any_owner_change_is_not() -> None:
    client = cluster()
    set_map(client, THREE)
    manager = client.nodes_manager
    assert _same_slot_map(manager, "127.0.0.1", reply(THREE))
    assert _same_slot_map(manager, "127.0.0.1", reply(list(reversed(THREE))))
    # A replica promoted in C's place: the slots' master has another address.
    promoted = [(0, 5460, A), (5461, 10922, B), (10923, 16383, ("127.0.0.1", 7005))]
    assert not _same_slot_map(manager, "127.0.0.1", reply(promoted))
    # Slots moved between masters (a resharding).
    moved = [(0, 5000, A), (5001, 10922, B), (10923, 16383, C)]
    assert not _same_slot_map(manager, "127.0.0.1", reply(moved))
    # Slots no longer served.
    assert not _same_slot_map(manager, "127.0.0.1", reply(THREE[:2]))
    # An empty host means the node that answered.
    empty_host = [[lo, hi, [b"", p, b"id"]] for lo, hi, (_, p) in THREE]
    assert _same_slot_map(manager, "127.0.0.1", empty_host)
    assert not _same_slot_map(manager, "10.0.0.1", empty_host)
    # Garbage is "changed" (the full re-read decides), never an exception.
    assert not _same_slot_map(manager, "127.0.0.1", [[0, "x", None]])
    assert not _same_slot_map(manager, "127.0.0.1", None)


def test_after_the_first_topology_read_a_command_never_re_reads_it_inline() -> None:
    """redis-py flags the client after a node's connection error so that the next
    command, whatever its key, re-reads the topology first; here that only asks the
    source for an off-path refresh, with the failed node to be asked last."""
    client = cluster()
    set_map(client, THREE)
    client.ready = True
    client._initialize = True  # as redis-py leaves it after a connection error

    async def main() -> None:
        assert await client.initialize(last_failed_node_name="127.0.0.1:7002") is client

    asyncio.run(main())
    assert client._initialize is False
    assert client.refresh_wanted
    assert client.take_refresh_request() == {"127.0.0.1:7002"}
    assert not client.refresh_wanted


def test_redis_pys_mid_request_aclose_closes_nothing_but_shut_down_does() -> None:
    client = cluster()
    set_map(client, THREE)
    client.ready = True
    client._initialize = False
    closed: list[str] = []

    async def disconnect(self: ClusterNode) -> None:
        closed.append(self.name)

    async def main() -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ClusterNode, "disconnect", disconnect)
            await client.aclose()  # what redis-py calls on CLUSTERDOWN or an uncovered slot
            assert closed == [] and client.refresh_wanted
            client._initialize = True  # flagged by a failed GET: the close must still happen
            await client.shut_down()
            assert set(closed) == {"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"}

    asyncio.run(main())


def test_a_get_is_routed_without_asking_the_server_for_its_command_table() -> None:
    async def main() -> None:
        keys = _GetKeys()
        await keys.initialize(None)  # no COMMAND round trip
        assert await keys.get_keys("GET", "org:directive:agent") == ("org:directive:agent",)
        with pytest.raises(RedisClusterException):
            await keys.get_keys("MGET", "a", "b")

    asyncio.run(main())
    assert isinstance(cluster().commands_parser, _GetKeys)
