"""Whole assemblies while Redis and the memory service misbehave.

Real redis-server, real loopback HTTP fake, real clocks. The branch timeouts
are scaled up (about 20x) from the defaults (directive 100 ms, hot 300 ms,
cold 600 ms, wall 800 ms) and every injected delay is relative to them: "just
below" is 0.3x the branch's timeout, "just above" 2x. Time bounds are generous
(wall + 1 s): they tell "cut off by the wall" from "waited for the transport
timeout (2 s) or forever", nothing finer.

The test process stalls now and then: a full garbage collection of pytest's
heap takes 50-130 ms here (measured with gc.callbacks), and the 2-core machine
is shared. A stall turns an expected outcome into `timeout`, which is the
daemon behaving correctly; `expect` repeats such an attempt (bounded, printed)
and fails at once on any other mismatch.

Every request is followed by a leak check (no Trio task, no asyncio task, no
Redis lease, no HTTP pool slot, waiter or busy connection, the server holding
no more connections than the pool has), and every case ends with
`assert_recovered`: the next plain request is fully correct (L0, the
tenant's directive and expected memory ids in the text).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Literal

import pytest
import trio
import trio_asyncio

from ibex.assembly.structs import AssemblyResult
from ibex.service.root import Assembler
from ibex.sources.memory_http import MemoryHttpSource
from ibex.sources.redis_directive import PoolReader, RedisDirectiveSource
from ibex.testing.memory_server import (
    FakeMemoryServer,
    Fault,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.redis_server import RedisServer
from tests.integration.test_assemble_real import (
    POOL_SIZE,
    TENANTS,
    Dataset,
    assert_full,
    directive_text,
    has_directive,
    history_present,
    ids_in_text,
    make_request,
    open_stack,
    seed_directive,
    seed_tenant,
    statuses,
)

DIRECTIVE_S, HOT_S, COLD_S, WALL_S = 0.1, 0.3, 0.6, 0.8
CHAOS_TIMEOUTS = {
    "DIRECTIVE_TIMEOUT_MS": "100",
    "HOT_TIMEOUT_MS": "300",
    "COLD_TIMEOUT_MS": "600",
    "TIMEOUT": "800ms",
    "DEADLINE_MS": "800",
}
BRANCH_TIMEOUT_S = {"directive": DIRECTIVE_S, "hot": HOT_S, "cold": COLD_S}
JUST_BELOW, JUST_ABOVE = 0.3, 2.0
SLACK_S = 1.0  # real clock on a shared 2-core machine: generous on purpose
SETTLE_S = 0.01  # how long debug_sleep waits for Redis to be asleep before reporting
ATTEMPTS = 3  # per expectation; only an unexpected timeout (a stall) earns another

Branch = Literal["directive", "hot", "cold"]
Outcome = tuple[AssemblyResult, float]
ALL_SUCCESS: dict[str, str] = {"directive": "success", "hot": "success", "cold": "success"}


async def expect(attempt: Callable[[], Awaitable[Outcome]], expected: Mapping[str, str]) -> Outcome:
    """Run `attempt` until its statuses are `expected`; retry only unexpected timeouts.

    A stall (GC, a busy neighbour) can push any branch past its deadline; it
    cannot make one fail differently, so every other mismatch fails at once,
    and a branch that is slow every time still fails after ATTEMPTS.
    """
    got: dict[str, str] = {}
    for n in range(ATTEMPTS):
        result, elapsed = await attempt()
        got = statuses(result)
        if got == expected:
            return result, elapsed
        mismatched = {s for s in got if got[s] != expected[s]}
        stalled = {s for s in mismatched if got[s] == "timeout"}
        assert mismatched == stalled, f"statuses {got}, expected {expected}"
        print(f"stall: {sorted(stalled)} timed out on attempt {n + 1}, retrying")
    raise AssertionError(f"statuses {got} after {ATTEMPTS} attempts, expected {expected}")


class Chaos:
    """One assembler over real servers, plus the leak and recovery checks."""

    def __init__(
        self,
        assembler: Assembler,
        redis: RedisServer,
        memory: FakeMemoryServer,
        data: dict[str, Dataset],
    ) -> None:
        self.assembler = assembler
        self.redis = redis
        self.memory = memory
        self.data = data
        self.baseline_tasks = -1

    @property
    def http(self) -> MemoryHttpSource:
        source = self.assembler.memory_source
        assert isinstance(source, MemoryHttpSource)
        return source

    @property
    def directive_source(self) -> RedisDirectiveSource:
        source = self.assembler.directive_source
        assert isinstance(source, RedisDirectiveSource)
        return source

    async def request(self, tenant: str = "a", *, deadline: float | None = None) -> Outcome:
        """One assembly and its real duration; it may start no task that outlives it
        (but the pool's drain of a cut call's answer, which the pool owns)."""
        before = request_tasks()
        started = time.monotonic()
        result = await self.assembler.assemble(make_request(tenant), deadline=deadline)
        elapsed = time.monotonic() - started
        # <=, not ==: a debug_sleep helper started by the test may end meanwhile.
        assert request_tasks() <= before
        await self.assert_no_leaks()  # also right after a chaos request, mid-fault
        return result, elapsed

    async def assert_recovered(self) -> None:
        """The next normal request is fully correct, and nothing is left behind."""
        with trio.fail_after(10):
            result, _ = await expect(self.request, ALL_SUCCESS)
            assert_full(result, "a", self.data["a"])
            # drains of cut calls end within their time cap: then nothing is left at all
            while self.http.pool_stats().draining:  # noqa: ASYNC110 (a drain is no event)
                await trio.sleep(0.005)
            await self.assert_no_leaks()
            assert drain_tasks() == 0
        if self.baseline_tasks < 0:
            self.baseline_tasks = request_tasks()
        assert request_tasks() == self.baseline_tasks

    async def assert_no_leaks(self) -> None:
        pool = self.http.pool_stats()
        # no slot held but by a drain (a cut call's answer being read off its connection)
        assert (pool.in_use, pool.waiters) == (0, 0)
        assert pool.leases == pool.draining
        assert pool.connections == pool.idle + pool.draining <= 2 * POOL_SIZE  # a pool per branch
        live = pool.idle + pool.draining
        # The server may have closed a connection the pool has not noticed yet
        # (reset), so its count may be lower, never higher.
        assert await self.memory.settle_open_connections(live) <= live
        reader = self.directive_source._reader
        assert isinstance(reader, PoolReader)
        redis_pool = reader.pool
        assert not redis_pool._in_use_connections
        assert not asyncio.all_tasks(trio_asyncio.current_loop.get())
        # Each loop socket watcher belongs to a pooled Redis socket that is still open.
        connected = sum(c.is_connected for c in redis_pool._available_connections)
        with trio.move_on_after(1):
            while io_watchers() > connected:  # noqa: ASYNC110 (a watcher ends on its next turn)
                await trio.sleep(0.005)
        assert io_watchers() <= connected


def _living() -> list[trio.lowlevel.Task]:
    tasks: list[trio.lowlevel.Task] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None:
            continue
        tasks.append(task)
        todo += (child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return tasks


def io_watchers() -> int:
    """trio-asyncio's per-socket reader/writer tasks, owned by the loop, not a request.

    asyncio's add_reader becomes one Trio task per watched socket; it lives as
    long as the pooled Redis connection does, like the socket itself.
    """
    return sum(
        t.name.startswith("trio_asyncio.") and t.name.endswith("._io_task") for t in _living()
    )


def drain_tasks() -> int:
    """The memory pools' drains of cut calls' answers: each owned by its pool, one per
    draining connection, ended at its time cap at the latest."""
    return sum(t.name.endswith("HttpPool._drain_task") for t in _living())


def request_tasks() -> int:
    """trio's tasks_living less the loop's socket watchers and the pools' drains: what a
    request could leak."""
    living = trio.lowlevel.current_statistics().tasks_living
    assert living == len(_living())  # the walk sees every task the run counts
    return living - io_watchers() - drain_tasks()


@asynccontextmanager
async def chaos_stack(redis: RedisServer, memory: FakeMemoryServer) -> AsyncIterator[Chaos]:
    for tenant in TENANTS:
        seed_directive(redis, tenant)
    data = {tenant: seed_tenant(memory, tenant, seed=100 + i) for i, tenant in enumerate(TENANTS)}
    # A full collection now makes one during the case (a 50-130 ms stall) unlikely.
    gc.collect()
    async with open_stack(redis, memory, CHAOS_TIMEOUTS) as assembler:
        chaos = Chaos(assembler, redis, memory, data)
        await chaos.assert_recovered()  # warms both pools and fixes the task baseline
        yield chaos


def assert_kept(result: AssemblyResult, chaos: Chaos, failed: set[Branch]) -> None:
    """Branches that finished keep their output; failed ones contribute nothing."""
    data = chaos.data["a"]
    for branch, ids in (("hot", data.hot_ids), ("cold", data.cold_ids)):
        assert ids_in_text(result, ids) == (set() if branch in failed else ids)
    assert has_directive(result, "a") == ("directive" not in failed)
    assert history_present(result)
    missing = len(failed - {"directive"})
    assert result.degradation_level == ("L0", "L1", "L2")[missing]


def set_latency(memory: FakeMemoryServer, branch: Branch, seconds: float) -> None:
    endpoint = memory.hot if branch == "hot" else memory.cold
    endpoint.latency_ms = seconds * 1000.0


def set_fault(memory: FakeMemoryServer, branch: Branch, fault: Fault) -> None:
    endpoint = memory.hot if branch == "hot" else memory.cold
    endpoint.fault = fault


# -- latency around each branch's timeout --------------------------------------


@pytest.mark.parametrize("factor", [JUST_BELOW, JUST_ABOVE], ids=["below", "above"])
@pytest.mark.parametrize("branch", ["directive", "hot", "cold"])
async def test_latency_around_branch_timeout(
    redis_server: RedisServer, memory_server: FakeMemoryServer, branch: Branch, factor: float
) -> None:
    delay = BRANCH_TIMEOUT_S[branch] * factor
    expected = "success" if factor < 1 else "timeout"

    async def attempt() -> Outcome:
        if branch == "directive":  # the whole server sleeps, only the directive reads it
            async with trio.open_nursery() as nursery:
                sleep = partial(redis_server.debug_sleep, settle=SETTLE_S)
                await nursery.start(sleep, SETTLE_S + delay)
                return await chaos.request()
        set_latency(memory_server, branch, delay)
        try:
            return await chaos.request()
        finally:
            set_latency(memory_server, branch, 0.0)

    async with chaos_stack(redis_server, memory_server) as chaos:
        with trio.fail_after(10):
            result, elapsed = await expect(attempt, {**ALL_SUCCESS, branch: expected})
        assert elapsed < WALL_S + SLACK_S
        if expected == "timeout":
            outcome = next(b for b in result.branches if b.source == branch)
            assert outcome.latency_ms >= BRANCH_TIMEOUT_S[branch] * 1000 - 1
            assert_kept(result, chaos, {branch})
        else:
            assert_full(result, "a", chaos.data["a"])
        await chaos.assert_recovered()


# -- a branch that never answers ------------------------------------------------


@pytest.mark.parametrize("branch", ["directive", "hot", "cold"])
async def test_hanging_branch_times_out_within_the_wall(
    redis_server: RedisServer, memory_server: FakeMemoryServer, branch: Branch
) -> None:
    async with chaos_stack(redis_server, memory_server) as chaos:
        if branch == "directive":
            redis_server.pause()  # SIGSTOP: the kernel accepts connections, nothing answers
        else:
            set_fault(memory_server, branch, "hang")
        try:
            with trio.fail_after(10):
                for _ in range(2):  # the second request meets whatever the first left
                    result, elapsed = await expect(
                        chaos.request, {**ALL_SUCCESS, branch: "timeout"}
                    )
                    assert elapsed < WALL_S + SLACK_S
                    assert_kept(result, chaos, {branch})
        finally:
            if branch == "directive":
                redis_server.resume()
            else:
                set_fault(memory_server, branch, "none")
        await chaos.assert_recovered()


async def test_all_three_slow_is_l2_within_the_wall(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    caller_budget = 0.2  # shorter than the hot and cold timeouts, longer than the directive's
    all_timeout = dict.fromkeys(ALL_SUCCESS, "timeout")
    async with chaos_stack(redis_server, memory_server) as chaos:
        redis_server.pause()
        set_fault(memory_server, "hot", "hang")
        set_fault(memory_server, "cold", "hang")
        try:
            with trio.fail_after(10):
                result, elapsed = await expect(chaos.request, all_timeout)
                # With a caller deadline, the wall (deadline less pipeline headroom)
                # cuts hot and cold; the directive's own scope fires first.
                deadline = trio.current_time() + caller_budget
                cut, cut_elapsed = await expect(
                    partial(chaos.request, deadline=deadline), all_timeout
                )
        finally:
            redis_server.resume()
            set_fault(memory_server, "hot", "none")
            set_fault(memory_server, "cold", "none")
        for res, took, bound in ((result, elapsed, WALL_S), (cut, cut_elapsed, caller_budget)):
            assert res.degradation_level == "L2"
            assert res.memories_used == ()
            assert not has_directive(res, "a")
            assert history_present(res)
            assert took < bound + SLACK_S
        assert "request wall" not in cut.branches[0].detail
        assert "request wall" in cut.branches[1].detail
        assert "request wall" in cut.branches[2].detail
        await chaos.assert_recovered()


# -- Redis dies and comes back ---------------------------------------------------


async def test_killed_redis_is_a_fast_error_and_restart_recovers(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    async with chaos_stack(redis_server, memory_server) as chaos:
        redis_server.kill()
        with trio.fail_after(10):
            for _ in range(2):  # the first meets a stale pooled socket, the second a refusal
                # "error", not "timeout": the failure surfaced inside the directive's budget.
                result, elapsed = await expect(chaos.request, {**ALL_SUCCESS, "directive": "error"})
                assert result.branches[0].detail == "redis: connection failed"
                assert elapsed < WALL_S + SLACK_S
                assert_kept(result, chaos, {"directive"})
        redis_server.restart()
        for tenant in TENANTS:  # a restarted cache is empty until the proxy fills it
            seed_directive(redis_server, tenant)
        await chaos.assert_recovered()  # no operator action in between


# -- the memory service answers garbage or drops the connection ------------------


@pytest.mark.parametrize("fault", ["reset", "malformed"])
@pytest.mark.parametrize("branch", ["hot", "cold"])
async def test_memory_fault_is_a_branch_error(
    redis_server: RedisServer, memory_server: FakeMemoryServer, branch: Branch, fault: Fault
) -> None:
    async with chaos_stack(redis_server, memory_server) as chaos:
        set_fault(memory_server, branch, fault)
        with trio.fail_after(10):
            for _ in range(2):
                result, elapsed = await expect(chaos.request, {**ALL_SUCCESS, branch: "error"})
                assert elapsed < WALL_S + SLACK_S
                assert_kept(result, chaos, {branch})
        set_fault(memory_server, branch, "none")
        await chaos.assert_recovered()


# -- tenants never see each other's directive --------------------------------------


async def test_cancelled_directive_gets_never_cross_tenants(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    """Alternate tenants while Redis sleeps, so GETs are cut off with replies still due.

    A cancelled GET's connection going back to the pool unread would hand its
    reply (one tenant's directive) to the next lease (the other tenant). Sleeps
    straddle the directive timeout, so some GETs are cut off and some answered late.
    """
    rng = random.Random(3)
    during: dict[str, int] = {"success": 0, "timeout": 0, "error": 0}
    async with chaos_stack(redis_server, memory_server) as chaos:
        with trio.fail_after(30):
            for i in range(10):
                tenants = ["a", "b", "a"] if i % 2 == 0 else ["b", "a", "b"]
                async with trio.open_nursery() as nursery:
                    sleep = rng.uniform(DIRECTIVE_S * 0.6, DIRECTIVE_S * 3)
                    await nursery.start(partial(redis_server.debug_sleep, settle=0.002), sleep)
                    for tenant in tenants:
                        result, _ = await chaos.request(tenant)
                        check_own_directive_only(result, tenant, chaos)
                        during[statuses(result)["directive"]] += 1
                for tenant in tenants[:2]:  # awake again: each reads its own
                    result, _ = await expect(partial(chaos.request, tenant), ALL_SUCCESS)
                    check_own_directive_only(result, tenant, chaos)
        print(f"directive outcomes while Redis slept: {during}")
        assert during["timeout"] > 0  # GETs were cut off mid-flight
        assert during["error"] == 0
        await chaos.assert_recovered()


def check_own_directive_only(result: AssemblyResult, tenant: str, chaos: Chaos) -> None:
    other = "b" if tenant == "a" else "a"
    assert directive_text(other) not in result.assembled_context
    assert not ids_in_text(result, chaos.data[other].expected_ids)
    if statuses(result)["directive"] == "success":
        assert has_directive(result, tenant)
