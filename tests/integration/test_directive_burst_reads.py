"""A burst of calls for different agents: their directives' read leaves before their work.

Real redis-server, the directive cache over the Redis source, in a trio-asyncio loop
with the daemon's batching main loop. Each gRPC call's handler runs on the asyncio
side: it prefetches its directive, then crosses into Trio (`trio_as_future`), where
its branches are set up. The read must be on the wire when the first of those Trio
tasks runs: a read that starts in a Trio task of its own takes a random place among
the calls' crossings (Trio reverses half its batches), so half the time every
crossing's work runs before it, and the directive branches that start there wait
out their 5 ms for it. Order and round trips are counted; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import traceback
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio_asyncio

from ibex.assembly.structs import Directive
from ibex.patches import batch_ready_callbacks
from ibex.sources.directive_cache import DirectiveCache, DirectiveCacheConfig
from ibex.sources.redis_directive import (
    PoolReader,
    RedisDirectiveSource,
    RedisOptions,
    directive_key,
)
from ibex.testing.redis_server import RedisServer

ORG = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
ROUNDS = 8  # a Trio-task read runs last among six tasks about half the time: 8 rounds catch it
BURST = 5


class Clock:
    """The cache's clock, moved by hand: each round starts with every entry expired."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def directive_clients(redis_server: RedisServer) -> set[str]:
    """The ids of the connections named `ibex-directive` the server holds."""
    listing = redis_server.command("CLIENT", "LIST").decode().splitlines()
    return {line.split()[0] for line in listing if "name=ibex-directive" in line}


def agents(round_: int) -> list[str]:
    return [str(uuid.UUID(int=(round_ << 8) | i, version=4)) for i in range(BURST)]


@pytest.fixture
async def redis_source(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> AsyncIterator[RedisDirectiveSource]:
    batch_ready_callbacks()  # the daemon's main loop (`install_patches`)
    for r in range(ROUNDS):
        for agent in agents(r):
            value = {"v": 1, "content": f"directive of {agent}", "version_id": None}
            redis_server.set(directive_key(ORG, agent), json.dumps(value))
    # Backstop timeouts a busy machine cannot reach: nothing here is timed.
    source = RedisDirectiveSource(
        redis_server.url, RedisOptions(connect_timeout=10, socket_timeout=10)
    )
    try:
        await source.warm(2)
        yield source
    finally:
        await source.aclose()


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each Redis command the pool readers send: (name, keys), appended as it is issued."""
    sent: list[tuple[str, int]] = []
    leased = PoolReader._leased

    async def counted(self: PoolReader, *command: str, **options: Any) -> object:
        sent.append((command[0], len(command) - 1))
        return await leased(self, *command, **options)

    monkeypatch.setattr(PoolReader, "_leased", counted)
    return sent


async def burst(
    cache: DirectiveCache,
    round_: int,
    commands: list[tuple[str, int]],
    reads: int = 1,
) -> tuple[dict[str, list[tuple[str, int]]], list[Any]]:
    """One burst, its calls' handler steps in `reads` rounds of the asyncio loop (as many
    socket reads): each call prefetches, then crosses into Trio, where it notes the
    commands sent so far and reads its directive. Returns the notes (by agent) and the
    answers."""
    seen: dict[str, list[tuple[str, int]]] = {}

    async def crossing(agent: str) -> Any:
        seen[agent] = list(commands)
        return (await cache.fetch(ORG, agent, "")).value

    async def handlers() -> list[Any]:
        loop: Any = asyncio.get_running_loop()  # trio-asyncio's, with `trio_as_future`
        futures: list[asyncio.Future[Any]] = []
        names = agents(round_)
        step = -(-len(names) // reads)
        for i in range(0, len(names), step):
            if i:
                await asyncio.sleep(0)  # the next socket read: a later round of callbacks
            for agent in names[i : i + step]:
                cache.prefetch(ORG, agent, "")
                futures.append(loop.trio_as_future(crossing, agent))
        return list(await asyncio.gather(*futures))

    answers = await trio_asyncio.aio_as_trio(handlers)()
    return seen, answers


async def test_a_bursts_directive_read_is_sent_before_its_calls_cross_into_trio(
    redis_source: RedisDirectiveSource, commands: list[tuple[str, int]]
) -> None:
    clock = Clock()
    config = DirectiveCacheConfig(ttl=1.0)
    async with DirectiveCache(redis_source, config, clock=clock) as cache:
        for r in range(ROUNDS):
            clock.now += 10.0
            commands.clear()
            with trio.fail_after(10):
                seen, answers = await burst(cache, r, commands)
            # One MGET for the five agents, issued before any of the calls' Trio tasks ran.
            assert seen == {a: [("MGET", BURST)] for a in agents(r)}, f"round {r}"
            assert commands == [("MGET", BURST)]
            assert [a.content for a in answers] == [f"directive of {a}" for a in agents(r)]


async def test_a_burst_in_two_socket_reads_costs_one_round_trip_each(
    redis_source: RedisDirectiveSource,
    commands: list[tuple[str, int]],
    redis_server: RedisServer,
) -> None:
    clock = Clock()
    async with DirectiveCache(redis_source, DirectiveCacheConfig(), clock=clock) as cache:
        for r in range(ROUNDS):
            clock.now += 10.0
            commands.clear()
            connections = directive_clients(redis_server)
            with trio.fail_after(10):
                seen, answers = await burst(cache, r, commands, reads=2)
            # Three keys in the first read's MGET, two in the second's; each read's on the
            # wire before its calls' Trio tasks ran, and on a connection the pool held.
            assert commands == [("MGET", 3), ("MGET", 2)], f"round {r}"
            names = agents(r)
            assert all(seen[a][:1] == [("MGET", 3)] for a in names[:3])
            assert all(seen[a] == [("MGET", 3), ("MGET", 2)] for a in names[3:])
            assert directive_clients(redis_server) == connections
            assert [a.content for a in answers] == [f"directive of {a}" for a in agents(r)]


async def test_a_batched_reads_answers_are_told_as_its_reply_arrives(
    redis_source: RedisDirectiveSource,
) -> None:
    """`on_answers` runs in the transport's data callback, where the reply's last bytes
    arrive, not a loop pass later in the task that parses it; the same answers as the
    read returns."""
    told: list[tuple[bool, list[str | None]]] = []

    def on_answers(answers: list[Any]) -> None:
        arriving = any(f.name == "data_received" for f in traceback.extract_stack())
        told.append((arriving, [a.content if isinstance(a, Directive) else None for a in answers]))

    missing = (ORG, str(uuid.uuid4()), "")  # no such key: no directive
    for wanted in ([(ORG, agents(0)[0], "")], [*((ORG, a, "") for a in agents(0)), missing]):
        told.clear()
        with trio.fail_after(10):
            answers = await redis_source.get_directives(wanted, on_answers=on_answers)
        contents = [a.content if isinstance(a, Directive) else None for a in answers]
        assert told == [(True, contents)]
        assert contents == [f"directive of {a}" for _, a, _ in wanted[:BURST]] + [None] * (
            len(wanted) > 1
        )
