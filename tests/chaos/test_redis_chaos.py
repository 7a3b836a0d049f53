"""RedisDirectiveSource when Redis sleeps, stops, dies and comes back.

Real redis-server, real clocks; bounds are generous because sockets are
involved (speed belongs to the benchmarks). The pool is capped at one
connection, so a cancelled GET whose connection went back to the pool unread
would be handed to the very next request, and a lease that leaked would make
the next request fail.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
import trio
import trio_asyncio

from ibex.sources.base import SourceError
from ibex.sources.redis_directive import (
    PoolReader,
    RedisDirectiveSource,
    RedisOptions,
    directive_key,
)
from ibex.testing.redis_server import RedisServer

TENANTS = {
    "a": ("0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d", "7c9e6679-7425-40de-944b-e07fc1f90ae7"),
    "b": ("9d2c6a0e-1f7b-4c8e-8a3d-5e4f6a7b8c9d", "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d"),
}
# How long DEBUG SLEEP blocks the server: long enough that the cancelled GETs are
# sent while it still sleeps when the machine is busy (a stall of tens of ms between
# the sleep starting and a GET leaving is common on a loaded 2-core host). The GETs
# sent during the sleep wait for it, so those tests use socket timeouts above it.
SLEEP = 0.25
SLEEPY = RedisOptions(max_connections=1, connect_timeout=4 * SLEEP, socket_timeout=4 * SLEEP)
CANCEL_AFTER = 0.005  # the directive branch's budget
PROMPT = 0.5  # generous bound for "promptly" on a loaded 2-core machine


def seed(server: RedisServer) -> None:
    for name, (org, agent) in TENANTS.items():
        value = {"v": 1, "content": f"directive of tenant {name}", "version_id": None}
        server.set(directive_key(org, agent), json.dumps(value))


async def content_of(source: RedisDirectiveSource, tenant: str) -> str | None:
    got = await source.get_directive(*TENANTS[tenant])
    return None if got is None else got.content


@pytest.fixture
async def source(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> AsyncIterator[RedisDirectiveSource]:
    seed(redis_server)
    src = RedisDirectiveSource(redis_server.url, RedisOptions(max_connections=1))
    try:
        yield src
    finally:
        await src.aclose()


@pytest.fixture
async def sleepy_source(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> AsyncIterator[RedisDirectiveSource]:
    """One pooled connection, with timeouts that outlast a DEBUG SLEEP of `SLEEP`."""
    seed(redis_server)
    src = RedisDirectiveSource(redis_server.url, SLEEPY)
    try:
        yield src
    finally:
        await src.aclose()


async def cancelled_get(source: RedisDirectiveSource, tenant: str) -> None:
    """A GET cut off by the branch's cancel scope while the server is asleep."""
    start = time.monotonic()
    with trio.move_on_after(CANCEL_AFTER) as scope:
        await content_of(source, tenant)
    assert scope.cancelled_caught, "the GET finished although the server was asleep"
    assert time.monotonic() - start < PROMPT


@pytest.mark.parametrize("wait_for_wakeup", [True, False], ids=["after-sleep", "during-sleep"])
async def test_cancelled_get_never_poisons_the_pool(
    redis_server: RedisServer, sleepy_source: RedisDirectiveSource, wait_for_wakeup: bool
) -> None:
    """The next GET, for the other tenant, must read its own reply.

    "during-sleep" is the sharp case: the next GET is sent while the cancelled
    GET's reply is still to come, so a reused connection would read it first.
    """
    assert await content_of(sleepy_source, "a") == "directive of tenant a"  # warm the pool
    for i in range(12):
        victim, other = ("a", "b") if i % 2 == 0 else ("b", "a")
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(redis_server.debug_sleep, SLEEP)
                await cancelled_get(sleepy_source, victim)
                if not wait_for_wakeup:
                    assert await content_of(sleepy_source, other) == f"directive of tenant {other}"
            if wait_for_wakeup:
                assert await content_of(sleepy_source, other) == f"directive of tenant {other}"
            assert await content_of(sleepy_source, victim) == f"directive of tenant {victim}"


async def test_cancellation_while_reconnecting_leaves_no_stale_reply(
    redis_server: RedisServer, sleepy_source: RedisDirectiveSource
) -> None:
    """The second cancel lands in the connect handshake of the replacement connection."""
    assert await content_of(sleepy_source, "a") == "directive of tenant a"
    for i in range(6):
        victim, other = ("a", "b") if i % 2 == 0 else ("b", "a")
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(redis_server.debug_sleep, SLEEP)
                await cancelled_get(sleepy_source, victim)
                await cancelled_get(sleepy_source, victim)
                assert await content_of(sleepy_source, other) == f"directive of tenant {other}"


async def test_paused_redis_fails_fast_and_recovers_after_resume(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    assert await content_of(source, "a") == "directive of tenant a"
    redis_server.pause()
    try:
        # Under the branch's deadline: cancelled on time.
        for _ in range(3):
            await cancelled_get(source, "a")
        # Without a deadline, the source's own socket timeout ends the call.
        start = time.monotonic()
        with pytest.raises(SourceError, match="timed out"):
            await content_of(source, "b")
        assert time.monotonic() - start < 1.0
    finally:
        redis_server.resume()
    with trio.fail_after(2):
        assert await content_of(source, "b") == "directive of tenant b"
        assert await content_of(source, "a") == "directive of tenant a"


async def test_killed_redis_fails_fast_and_restart_recovers(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    assert await content_of(source, "a") == "directive of tenant a"
    redis_server.kill()
    for _ in range(3):
        start = time.monotonic()
        with pytest.raises(SourceError, match="connection failed"):
            await content_of(source, "a")
        assert time.monotonic() - start < 1.0
    redis_server.restart()
    seed(redis_server)  # a restarted cache is empty until the proxy fills it
    with trio.fail_after(2):
        assert await content_of(source, "a") == "directive of tenant a"
        assert await content_of(source, "b") == "directive of tenant b"


async def test_restart_between_calls_needs_no_operator_action(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    """The pooled connection points at the dead server; the very next call still works."""
    assert await content_of(source, "a") == "directive of tenant a"
    redis_server.restart()
    seed(redis_server)
    with trio.fail_after(2):
        assert await content_of(source, "b") == "directive of tenant b"


async def test_kill_during_an_in_flight_get_fails_fast(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """A reset mid-reply ends the call at once, not at the (here long) socket timeout."""
    seed(redis_server)
    source = RedisDirectiveSource(
        redis_server.url, RedisOptions(socket_timeout=10.0, max_connections=1)
    )
    errors: list[SourceError] = []

    async def in_flight() -> None:
        try:
            await content_of(source, "a")
        except SourceError as exc:
            errors.append(exc)

    try:
        assert await content_of(source, "a") == "directive of tenant a"
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(redis_server.debug_sleep, 5.0)
                async with trio.open_nursery() as inner:
                    inner.start_soon(in_flight)
                    await trio.sleep(0.02)
                    start = time.monotonic()
                    redis_server.kill()
                assert time.monotonic() - start < 1.0
        assert [str(e) for e in errors] == ["redis: connection failed"]
        redis_server.start()
        seed(redis_server)
        with trio.fail_after(2):
            assert await content_of(source, "b") == "directive of tenant b"
    finally:
        await source.aclose()


async def test_a_stray_cancellation_from_dropping_stale_connections_stays_inside(
    redis_server: RedisServer, source: RedisDirectiveSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart the GET drops the pool's stale idle connections. redis-py re-raises
    any failure of those disconnects, including an asyncio.CancelledError belonging to one
    of them (seen in a sentinel failover); it must not leave the GET as a cancellation."""
    assert await content_of(source, "a") == "directive of tenant a"
    reader = source._reader
    assert isinstance(reader, PoolReader)
    pool = reader.pool
    real = pool.disconnect
    calls: list[bool] = []

    async def disconnect(inuse_connections: bool = True) -> None:
        calls.append(inuse_connections)
        await real(inuse_connections=inuse_connections)
        if not inuse_connections:  # the GET's clean-up (aclose disconnects them all)
            raise asyncio.CancelledError  # as redis-py's gather re-raises a connection's

    monkeypatch.setattr(pool, "disconnect", disconnect)
    redis_server.restart()
    seed(redis_server)
    with trio.fail_after(2):
        assert await content_of(source, "b") == "directive of tenant b"
    assert calls == [False]  # the stale idle connections were dropped, once
