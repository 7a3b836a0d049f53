"""Directives from Redis Sentinel and Redis Cluster, real processes on loopback, under traffic.

Many tenants' directives are read concurrently while some reads are cut off by
tiny cancel scopes (a reply left mid-wire on a reused connection would be read
by the next tenant). Through a Sentinel failover, a cluster resharding and a
failed cluster master, no read ever returns another tenant's directive, and the
branch recovers by itself.
"""

from __future__ import annotations

import collections
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.lowlevel
import trio_asyncio

from ibex.config import load_settings
from ibex.service.root import redis_directive_source
from ibex.sources.base import SourceError
from ibex.sources.redis_directive import (
    RedisDirectiveSource,
    _CloseOnInterrupt,
    _GuardedConnection,
    directive_key,
)
from ibex.testing.redis_server import RedisServer
from ibex.testing.redis_topology import MASTER_NAME, ClusterSetup, SentinelSetup, admin, wait_until

TENANTS = [
    (str(uuid.UUID(int=0x1000 + i, version=4)), str(uuid.UUID(int=0x2000 + i, version=4)))
    for i in range(48)
]
KEYS = [directive_key(org, agent) for org, agent in TENANTS]
READERS = 8
# Loopback on a loaded 2-core machine: the source's 0.1 s backstops are for production.
TIMEOUTS = {"connect_timeout": 2.0, "socket_timeout": 2.0}
# A liveness guard, not a speed assertion: "recovers by itself within a few seconds".
RECOVERY = 20.0


def content(i: int) -> str:
    # Every fourth directive spans many TCP segments, so cancellations land mid-reply.
    filler = "x" * (60_000 if i % 4 == 0 else 40)
    return f"directive of tenant {i}: {filler}"


def envelope(i: int) -> str:
    return msgspec.json.encode({"v": 1, "content": content(i)}).decode()


@dataclass
class Tally:
    ok: collections.Counter[int] = field(default_factory=collections.Counter)
    errors: collections.Counter[int] = field(default_factory=collections.Counter)
    cancelled: int = 0
    wrong: list[tuple[int, str]] = field(default_factory=list)

    @property
    def total_ok(self) -> int:
        return sum(self.ok.values())

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


async def reader(source: RedisDirectiveSource, tally: Tally, tenants: list[int], seed: int) -> None:
    rng = random.Random(seed)
    while True:
        i = rng.choice(tenants)
        budget = rng.choice([None, None, None, 0.0002, 0.001, 0.003])
        with trio.move_on_after(budget or 30.0) as scope:
            try:
                got = await source.get_directive(*TENANTS[i])
            except SourceError:
                tally.errors[i] += 1
                await trio.sleep(0.002)
                continue
        if scope.cancelled_caught:
            tally.cancelled += 1
            continue
        if got is None or got.content != content(i):
            tally.wrong.append((i, "<missing>" if got is None else got.content[:40]))
        else:
            tally.ok[i] += 1
        await trio.lowlevel.checkpoint()


async def until(predicate: Callable[[], bool], tally: Tally, what: str) -> None:
    """Poll the readers' tally (they update it between reads) until `predicate` holds."""
    with trio.move_on_after(RECOVERY):
        while not predicate():  # noqa: ASYNC110  (a tally, not an event)
            await trio.sleep(0.01)
        return
    raise AssertionError(
        f"no {what} within {RECOVERY}s: ok={tally.total_ok} errors={dict(tally.errors)} "
        f"cancelled={tally.cancelled} wrong={tally.wrong[:3]}"
    )


async def more_ok(tally: Tally, n: int, what: str) -> None:
    target = tally.total_ok + n
    await until(lambda: tally.total_ok >= target, tally, what)


# -- Sentinel ----------------------------------------------------------------------------------


async def test_sentinel_failover_during_traffic(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path)
    try:
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.set, key, envelope(i))
        source = RedisDirectiveSource.sentinel(setup.sentinels, MASTER_NAME, **TIMEOUTS)
        tally = Tally()
        try:
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, tally, list(range(len(TENANTS))), k)
                await more_ok(tally, 100, "answers before the failover")

                old = setup.master
                await trio.to_thread.run_sync(setup.failover)  # during traffic
                # The demoted master now replicates from the promoted one; kill it, so
                # only the new master (found through the sentinels) can answer.
                await trio.to_thread.run_sync(
                    wait_until,
                    lambda: admin(old.port).role()[0] == "slave",
                    "the old master to become a replica",
                )
                old.kill()
                await more_ok(tally, 100, "recovery after the failover")

                steady_errors = tally.total_errors
                await more_ok(tally, 300, "steady answers after the failover")
                assert tally.total_errors == steady_errors
                nursery.cancel_scope.cancel()
        finally:
            await source.aclose()
        assert setup.master_port() == setup.replica.port
        assert tally.wrong == []
        assert tally.cancelled > 0  # the cancellation path was exercised
    finally:
        setup.stop()


async def test_sentinel_passwords_and_db_from_the_settings(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """REDIS_URL gives the data nodes' password and db (its host is ignored); the
    sentinels get their own password."""
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path, "data-pw", "sentinel-pw")
    try:
        await trio.to_thread.run_sync(setup.set, KEYS[1], envelope(1), 3)
        url = "redis://:data-pw@192.0.2.1:1/3"  # TEST-NET host: never dialled

        async def read(**kw: Any) -> str | None:
            source = RedisDirectiveSource.sentinel(setup.sentinels, MASTER_NAME, **TIMEOUTS, **kw)
            try:
                got = await source.get_directive(*TENANTS[1])
                return None if got is None else got.content
            finally:
                await source.aclose()

        assert await read(url=url, sentinel_password="sentinel-pw") == content(1)
        # The same through the settings and the composition root.
        settings = load_settings(
            {
                "IBEX_CONTEXT_REDIS_SENTINELS": ",".join(f"{h}:{p}" for h, p in setup.sentinels),
                "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": MASTER_NAME,
                "IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
                "IBEX_CONTEXT_REDIS_URL": url,
            }
        )
        source, kind = redis_directive_source(settings)
        try:
            got = await source.get_directive(*TENANTS[1])
            assert kind == "redis-sentinel" and got is not None and got.content == content(1)
        finally:
            await source.aclose()
        # db 0 of the same master has no such key: the db came from the URL.
        assert await read(url=url.replace("/3", "/0"), sentinel_password="sentinel-pw") is None
        for wrong in (
            {"url": url},  # the sentinels refuse to name the master
            {"url": url.replace("data-pw", "nope"), "sentinel_password": "sentinel-pw"},
        ):
            with pytest.raises(SourceError):
                await read(**wrong)
    finally:
        setup.stop()


# -- Cluster -----------------------------------------------------------------------------------


@pytest.mark.slow  # ~20-40 s: cluster creation, a 1000-slot resharding, a node failure
async def test_cluster_tenants_resharding_and_a_failed_master(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path)
    try:
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.client.set, key, envelope(i))
        owners = await trio.to_thread.run_sync(setup.owners, KEYS)
        assert len({n.port for n in owners.values()}) == 3  # keys on every master
        source = RedisDirectiveSource.cluster(setup.seed_url, **TIMEOUTS)
        everyone = list(range(len(TENANTS)))
        tally = Tally()
        try:
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, tally, everyone, k)
                await more_ok(tally, 200, "answers from the cluster")
                # Node connections are the guarded kind (the cancel-safety of this module).
                cluster = source._cluster
                assert cluster is not None
                conns = [c for n in cluster.get_nodes() for c in n._connections]
                assert conns and all(isinstance(c, _CloseOnInterrupt) for c in conns)

                # Resharding during traffic: MOVED and ASK, keys migrating under the reads.
                a, b, c = setup.nodes
                await trio.to_thread.run_sync(setup.reshard, a, b, 1000)
                await more_ok(tally, 200, "answers after the resharding")
                steady_errors = tally.total_errors
                await more_ok(tally, 300, "steady answers after the resharding")
                assert tally.total_errors == steady_errors
                nursery.cancel_scope.cancel()

            # A failed master (no replica): its tenants get errors, everyone else answers.
            owners = await trio.to_thread.run_sync(setup.owners, KEYS)
            victims = [i for i, key in enumerate(KEYS) if owners[key] is c]
            healthy = [i for i in everyone if i not in victims]
            assert victims and healthy
            await trio.to_thread.run_sync(setup.kill, c)
            during = Tally()
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, during, everyone, 100 + k)
                await until(
                    lambda: all(during.ok[i] >= 2 for i in healthy), during, "healthy answers"
                )
                mark = {i: during.errors[i] for i in healthy}
                await more_ok(during, 300, "steady healthy answers")
                nursery.cancel_scope.cancel()
            # Healthy tenants recovered and stay served; the victims never got an answer.
            assert {i: during.errors[i] for i in healthy} == mark
            assert all(during.ok[i] == 0 for i in victims)
            assert sum(during.errors[i] for i in victims) > 0
            tally.wrong += during.wrong
        finally:
            await source.aclose()
        assert tally.wrong == []
        assert tally.cancelled > 0
    finally:
        setup.stop()


async def test_guarded_connection_closes_on_a_cancelled_read_without_redis_py_help(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """The cluster's connection class closes a connection whose reply was cut off,
    even when redis-py's own close-on-error is turned off for the read."""
    redis_server.set(KEYS[0], envelope(0))
    conn = _GuardedConnection(host="127.0.0.1", port=redis_server.port, socket_timeout=5)

    async def get_cut_off() -> None:
        await conn.send_command("GET", KEYS[0])
        await conn.read_response(disable_decoding=True, disconnect_on_error=False)

    await trio_asyncio.aio_as_trio(conn.connect)()
    async with trio.open_nursery() as nursery:
        await nursery.start(redis_server.debug_sleep, 0.3)
        with trio.move_on_after(0.05) as scope:
            await trio_asyncio.aio_as_trio(get_cut_off)()
    assert scope.cancelled_caught
    assert not conn.is_connected  # the unread reply went with the socket
