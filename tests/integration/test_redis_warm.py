"""`RedisDirectiveSource.warm` on real redis-server topologies: one endpoint, Sentinel, Cluster.

Warming makes the connections a read needs before any read: after it, the
server (each master, for a cluster) lists the daemon's named connection
(`ibex-directive`) and a GET opens no other. Redis refusing is a SourceError
that names the failure and holds no URL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio_asyncio

from ibex.sources.base import SourceError
from ibex.sources.redis_directive import RedisDirectiveSource, RedisOptions
from ibex.sources.redis_topologies import CLIENT_NAME
from ibex.testing.redis_server import RedisServer
from ibex.testing.redis_topology import MASTER_NAME, ClusterSetup, SentinelSetup, admin
from ibex.testing.samples import AGENT, ORG

CAP = 30.0
TIMEOUTS = RedisOptions(connect_timeout=2.0, socket_timeout=2.0)


def named(port: int, password: str | None = None) -> int:
    """How many of the source's connections the server at `port` lists."""
    return sum(1 for c in admin(port, password).client_list() if c.get("name") == CLIENT_NAME)


async def test_one_endpoint_warms_the_connections_a_read_then_uses(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    source = RedisDirectiveSource(redis_server.url, TIMEOUTS)
    try:
        with trio.fail_after(CAP):
            assert named(redis_server.port) == 0
            await source.warm(2)
            warmed = named(redis_server.port)
            await source.get_directive(ORG, AGENT)
            after_read = named(redis_server.port)
    finally:
        await source.aclose()
    assert (warmed, after_read) == (2, 2)


async def test_a_refusing_redis_is_a_source_error_without_the_url(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    url = f"redis://:hunter2@127.0.0.1:{redis_server.port}/0"
    redis_server.kill()
    source = RedisDirectiveSource(url, TIMEOUTS)
    try:
        with trio.fail_after(CAP), pytest.raises(SourceError) as info:
            await source.warm()
    finally:
        await source.aclose()
    assert str(info.value) == "redis: connection failed"
    assert "hunter2" not in repr(info.value.__context__)


async def test_sentinel_warm_finds_the_master_and_connects_to_it(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path)
    try:
        source = RedisDirectiveSource.sentinel(setup.sentinels, MASTER_NAME, options=TIMEOUTS)
        try:
            with trio.fail_after(CAP):
                await source.warm()
                on_master = await trio.to_thread.run_sync(named, setup.master.port)
        finally:
            await source.aclose()
    finally:
        setup.stop()
    assert on_master == 1


async def test_cluster_warm_reads_the_topology_and_connects_to_every_master(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path)
    try:
        source = RedisDirectiveSource.cluster(setup.seed_url, TIMEOUTS)
        try:
            with trio.fail_after(CAP):
                await source.warm()
                per_master = [
                    await trio.to_thread.run_sync(named, node.port) for node in setup.nodes[:3]
                ]
        finally:
            await source.aclose()
    finally:
        setup.stop()
    # At least one each (the seed node may also keep the topology read's connection).
    assert len(per_master) == 3 and min(per_master) >= 1, per_master
