"""Cancellation storm: the memory HTTP client must survive being cancelled anywhere.

The daemon cancels in-flight memory calls by design (branch timeouts, the
wall), so over a day one process cancels millions of requests at every point:
queued for a pool slot, connecting, sending, waiting for the answer, reading
the body. Stock httpx/httpcore could leak a pool slot when a request was
cancelled at the wrong moment (encode/httpcore#1093); each leak permanently
shrinks the pool until every call waits for a slot that never frees, which
looks like a memory service outage.

Why our own pool (ibex.sources.http_pool) and not httpx2: httpx2/httpcore2
was evaluated and does fix #1093 (its pool removes a cancelled request and
its half-built connection under a shield), but it cost about 480 us of CPU
per call against about 125 us for the small pool, both including the ~36 us
msgspec decode (benchmarks/memory_client.py, loopback, 20 memories, 1 or 8
callers). At two calls per answer httpx2 alone took most of the daemon's
budget of 1.5 ms per answer. The small pool's whole
cancellation story is a semaphore permit held with `async with` and a
connection that is pooled again only from the `finally` of a complete
exchange (or of the drain of a cancelled call's answer, which holds the
call's permit until it ends), closed synchronously otherwise. This test holds
it to that: >=
10,000 real cancellations on a 4-connection pool with many more callers than
slots and a server adding latency, then plain calls must work, no slot may be
held, no waiter left, and the server must see exactly the pool's connections.

The server runs as a child process (tests/server.py's
`memory_server_process`): the storm keeps this process's CPU busy, and a
server thread here would get the GIL only every switch interval (5 ms), which
would turn a 1 ms server into a 5-10 ms one and starve every call.

Figures (calls, cancellations, duration) are printed; run with `-s` to see.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import trio

from ibex.sources.base import SourceError
from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.memory_server import (
    DEMO_AGENT,
    DEMO_ORG,
    MemoryServerProcess,
    memory_server_process,
)

TARGET_CANCELLATIONS = 10_000
MAX_CALLS = 40_000  # bound on the loop whatever the timing
POOL_SIZE = 4
CALLERS = 12  # 3x the pool: most calls queue for a slot
# Short deadlines cancel calls queued or connecting; long ones cancel them in
# flight (server latency is 1-2 ms +- 1 ms) or while reading the body.
SHORT_DEADLINE_S = 0.002
LONG_DEADLINE_S = 0.015


def _deadline(rng: random.Random) -> float:
    return rng.uniform(0.0, SHORT_DEADLINE_S if rng.random() < 0.5 else LONG_DEADLINE_S)


async def _settle_to_pool(
    server: MemoryServerProcess, source: MemoryHttpSource, patience: float = 10.0
) -> tuple[int, int]:
    """(server's open connections, pool's idle + draining), polled until they agree.

    Both counts are read afresh on every poll: a drain that ends may close its
    connection, so the pool's count falls after any snapshot of it, and the
    server counts a close only once it reads the FIN. A pool count read once
    and compared with a later server count fails whenever a drain ends in
    between, which a busy machine makes likely.
    """
    server_open, pool_open = -1, -2
    with trio.move_on_after(patience):
        while True:
            now = source.pool_stats()
            pool_open = now.idle + now.draining
            server_open = int((await server.astats())["open_connections"])
            if server_open == pool_open:
                break
            await trio.sleep(0.01)
    return server_open, pool_open


async def test_cancel_storm_leaves_a_clean_working_pool() -> None:
    with memory_server_process(hot_latency_ms=1.0, cold_latency_ms=2.0, jitter_ms=1.0) as server:
        await _storm(server)


async def _storm(server: MemoryServerProcess) -> None:
    rng = random.Random(20251021)
    stats: Counter[str] = Counter()

    async with server.source(pool_size=POOL_SIZE) as source:

        async def caller() -> None:
            while stats["cancelled"] < TARGET_CANCELLATIONS and stats["calls"] < MAX_CALLS:
                stats["calls"] += 1
                hot = rng.random() < 0.5
                with trio.move_on_after(_deadline(rng)) as scope:
                    try:
                        if hot:
                            await source.hot(DEMO_ORG, DEMO_AGENT, limit=20, min_confidence=0.0)
                        else:
                            await source.cold(
                                DEMO_ORG, DEMO_AGENT, "deploy", limit=20, min_confidence=0.0
                            )
                    except SourceError:
                        stats["errors"] += 1
                stats["cancelled" if scope.cancelled_caught else "completed"] += 1
                for branch in ("hot", "cold"):  # a pool per branch, each bounded
                    now = source.pool_stats(branch)
                    stats["max_connections"] = max(stats["max_connections"], now.connections)
                    stats["max_leases"] = max(stats["max_leases"], now.leases)

        started = time.monotonic()
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(CALLERS):
                    nursery.start_soon(caller)
        storm_s = time.monotonic() - started
        server_stats = await server.astats()
        sent = sum(server_stats["requests"].values())
        after = source.pool_stats()
        print(
            f"\nstorm: {stats['calls']} calls, {stats['cancelled']} cancelled, "
            f"{stats['completed']} completed, {stats['errors']} errors, "
            f"{sent} reached the server, {server_stats['accepted_connections']} connections "
            f"opened (pool: {after.opened}, {after.draining} draining at the end), {storm_s:.1f} s"
        )

        assert stats["cancelled"] >= TARGET_CANCELLATIONS
        assert stats["errors"] == 0
        # cancellations landed both before the request left (queued / connecting)
        # and after the server had it (waiting / reading)
        assert sent < stats["calls"]
        assert sent > stats["completed"]

        # nothing orphaned: no slot held but by a drain, no waiter parked, no connection leased
        assert (after.in_use, after.waiters) == (0, 0)
        assert after.leases == after.draining
        assert after.connections == after.idle + after.draining <= 2 * POOL_SIZE
        assert stats["max_connections"] <= POOL_SIZE
        assert stats["max_leases"] <= POOL_SIZE
        # every connection a cancelled call touched was closed or is being drained:
        # the server holds exactly the pool's idle and draining ones...
        server_open, pool_open = await _settle_to_pool(server, source)
        assert server_open == pool_open
        # ...and once the drains end (answer read, or closed at a cap), only the idle ones
        with trio.fail_after(10):
            while source.pool_stats().draining:  # noqa: ASYNC110 (a drain is no event)
                await trio.sleep(0.01)
        after = source.pool_stats()
        assert (after.in_use, after.leases, after.waiters) == (0, 0, 0)
        assert after.connections == after.idle <= 2 * POOL_SIZE
        server_open, pool_open = await _settle_to_pool(server, source)
        assert server_open == pool_open == after.idle

        # and the pool still works at full width
        results: list[int] = []

        async def plain_call() -> None:
            hits = await source.cold(DEMO_ORG, DEMO_AGENT, "q", limit=20, min_confidence=0.0)
            results.append(len(hits))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(64):
                    nursery.start_soon(plain_call)
        assert results == [20] * 64
        final = source.pool_stats()
        assert (final.in_use, final.leases, final.waiters) == (0, 0, 0)
        # a leaked slot would leave fewer than POOL_SIZE usable connections here
        cold = source.pool_stats("cold")
        assert cold.connections == cold.idle == POOL_SIZE
        # the server agrees: exactly the pools' live connections remain open
        server_open, pool_open = await _settle_to_pool(server, source)
        assert server_open == pool_open == final.idle

    assert await server.settle_open_connections(0) == 0
