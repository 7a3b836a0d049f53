"""Cut calls keep their memory-service connections (the pool drains the answer).

The daemon cuts slow cold calls at the wall by design. Closing each cut call's
connection costs the next call a new connection (and the memory service an
accept); the pool instead reads the rest of the answer in a task of its own,
under a byte and a time cap, and pools the connection again if the answer
ended cleanly. Real sockets and the memory stand-in (ibex/testing/memory_server.py),
so real clocks: every test is capped with trio.fail_after, and the stand-in's
counters say whether a connection was reused or opened anew.
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Iterator

import pytest
import trio
import trustme

from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.memory_server import (
    DEMO_AGENT,
    DEMO_ORG,
    Endpoint,
    FakeMemoryServer,
    make_memories,
)

CAP = 10.0
CUT_S = 0.03  # the caller's cancel scope: well before the stand-in answers


@pytest.fixture(name="server", params=["http", "https"])
def server_fixture(request: pytest.FixtureRequest) -> Iterator[FakeMemoryServer]:
    ctx = None
    if request.param == "https":
        ca = trustme.CA()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(ctx)
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
    with FakeMemoryServer(ssl_context=ctx) as server:
        server.add_memories(DEMO_ORG, DEMO_AGENT, make_memories(DEMO_ORG, DEMO_AGENT, 20))
        server.client_ctx = client_ctx if ctx else None  # type: ignore[attr-defined]
        yield server


def _source(server: FakeMemoryServer, **kw: object) -> MemoryHttpSource:
    return server.source(client_ssl_context=server.client_ctx, **kw)  # type: ignore[attr-defined]


async def _cold(source: MemoryHttpSource) -> int:
    return len(await source.cold(DEMO_ORG, DEMO_AGENT, "deploy", limit=20, min_confidence=0.0))


async def _cut_cold(source: MemoryHttpSource) -> None:
    with trio.move_on_after(CUT_S) as scope:
        await _cold(source)
    assert scope.cancelled_caught


async def _settled(source: MemoryHttpSource) -> None:
    while source.pool_stats().draining:  # noqa: ASYNC110 (a drain is no event)
        await trio.sleep(0.005)


async def test_a_cut_cold_call_keeps_its_connection_for_the_next_call(
    server: FakeMemoryServer,
) -> None:
    async with _source(server, pool_size=2) as source:
        with trio.fail_after(CAP):
            assert await _cold(source) == 20
            assert server.accepted_connections == 1
            server.cold.then.append(Endpoint(latency_ms=200))  # still sleeping at the cut
            await _cut_cold(source)
            cold = source.pool_stats("cold")
            assert (cold.draining, cold.leases, cold.connections, cold.idle) == (1, 1, 1, 0)
            # the server's open connections are the pools' idle + draining ones
            assert server.open_connections == 1
            await _settled(source)  # the stand-in answers; the drain reads it
            cold = source.pool_stats("cold")
            assert (cold.draining, cold.leases, cold.connections, cold.idle) == (0, 0, 1, 1)
            for _ in range(3):
                assert await _cold(source) == 20
        assert server.accepted_connections == 1  # never reconnected
        assert server.requests["cold"] == 5


async def test_an_answer_over_the_drain_byte_cap_closes_the_connection(
    server: FakeMemoryServer,
) -> None:
    big = b'{"data": {"results": []}, "pad": "' + b"x" * (64 * 1024) + b'"}'
    async with _source(server) as source:
        with trio.fail_after(CAP):
            assert await _cold(source) == 20
            server.cold.then.append(Endpoint(latency_ms=100, body=big))
            await _cut_cold(source)
            await _settled(source)
            assert source.pool_stats("cold").connections == 0
            assert await server.settle_open_connections(0) == 0
            assert await _cold(source) == 20
        assert server.accepted_connections == 2


async def test_an_answer_slower_than_the_drain_time_cap_closes_the_connection(
    server: FakeMemoryServer,
) -> None:
    # the time cap is never longer than the idle timeout: 0.1 s here
    async with _source(server, keepalive_expiry=0.1) as source:
        with trio.fail_after(CAP):
            assert await _cold(source) == 20
            server.cold.then.append(Endpoint(latency_ms=600))
            await _cut_cold(source)
            assert source.pool_stats("cold").draining == 1
            await _settled(source)
            assert source.pool_stats("cold").connections == 0
            assert await server.settle_open_connections(0) == 0
            assert await _cold(source) == 20
        assert server.accepted_connections == 2


async def test_leaving_the_block_ends_drains(server: FakeMemoryServer) -> None:
    server.cold.fault = "hang"
    with trio.fail_after(CAP):
        async with _source(server, keepalive_expiry=60.0) as source:
            await _cut_cold(source)
            pool = source._open_pool("cold")
            assert pool.stats().draining == 1
        # nothing is left behind (that aclose cancels drains rather than waiting for
        # their time cap is pinned without clocks in tests/unit/test_http_pool_memory.py)
        stats = pool.stats()
        assert (stats.draining, stats.connections, stats.leases, stats.in_use) == (0, 0, 0, 0)
        if server.ssl_context is None:  # over TLS the stand-in cannot see a hang-up
            assert await server.settle_open_connections(0) == 0


async def test_cut_calls_never_exceed_the_pool_bounds(server: FakeMemoryServer) -> None:
    """Many callers cut at random points on a small pool: draining connections count."""
    pool_size = 2
    rng = random.Random(7)
    server.cold.latency_ms, server.cold.jitter_ms = 20.0, 15.0
    peak = {"connections": 0, "leases": 0, "server": 0}
    cut = 0
    async with _source(server, pool_size=pool_size) as source:

        def look() -> None:
            cold = source.pool_stats("cold")
            peak["connections"] = max(peak["connections"], cold.connections)
            peak["leases"] = max(peak["leases"], cold.leases)
            peak["server"] = max(peak["server"], server.open_connections)

        async def caller() -> None:
            nonlocal cut
            for _ in range(12):
                with trio.move_on_after(rng.uniform(0.0, 0.045)) as scope:
                    await _cold(source)
                cut += scope.cancelled_caught
                look()

        async def watcher() -> None:
            while True:
                look()
                await trio.sleep(0.002)

        with trio.fail_after(CAP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watcher)
                async with trio.open_nursery() as callers:
                    for _ in range(6):
                        callers.start_soon(caller)
                nursery.cancel_scope.cancel()
            await _settled(source)
        cold = source.pool_stats("cold")
        assert (cold.in_use, cold.leases, cold.waiters) == (0, 0, 0)
        assert cold.connections == cold.idle <= pool_size
        assert await server.settle_open_connections(cold.idle) == cold.idle
    assert cut > 0
    assert peak["connections"] <= pool_size
    assert peak["leases"] <= pool_size
    assert peak["server"] <= pool_size


async def test_the_blocks_own_exception_leaves_unwrapped() -> None:
    """`async with` opens a nursery for the drains; the block's error is not grouped by it."""
    with pytest.raises(KeyError):
        async with MemoryHttpSource("http://127.0.0.1:1", "t0ken"):
            raise KeyError("mine")
    with trio.move_on_after(0.01) as scope:
        async with MemoryHttpSource("http://127.0.0.1:1", "t0ken"):
            await trio.sleep_forever()
    assert scope.cancelled_caught
