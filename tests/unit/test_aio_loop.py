"""The batching trio-asyncio main loop (`patches.batch_ready_callbacks`, `aio_loop`).

Pinned: callbacks queued together run in one Trio step of the loop's task (the
saving), in FIFO order, with a callback scheduled by one of them running after
those queued before it (asyncio's order); timers still fire in time order; and
crossings both ways still work (a Trio task start inside a batch waits for the task).
Cancelled timers are dropped rather than waited for, and the heap stays bounded.
"""

from __future__ import annotations

import asyncio
import heapq

import pytest
import trio
import trio.lowlevel
import trio_asyncio

from ibex.patches import batch_ready_callbacks
from ibex.patches import timer_sweep as aio_loop


class LoopSteps(trio.abc.Instrument):
    """Counts the steps of the loop's main-loop task (`loop._task` is the task that
    opened the loop, not this one, so it is told by its name)."""

    def __init__(self, loop: object) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("BaseTrioEventLoop._main_loop"):
            self.count += 1


def test_install_is_idempotent() -> None:
    assert batch_ready_callbacks()
    assert batch_ready_callbacks()


async def test_callbacks_queued_together_run_in_one_step_in_order() -> None:
    assert batch_ready_callbacks()
    ran: list[int] = []
    async with trio_asyncio.open_loop() as loop:
        await loop.synchronize()
        steps = LoopSteps(loop)
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(50):
                loop.call_soon(ran.append, i)
            await loop.synchronize()
        finally:
            trio.lowlevel.remove_instrument(steps)
    assert ran == list(range(50))
    assert steps.count <= 2  # one callback per step would be 51


async def test_a_callback_scheduled_by_a_callback_runs_after_those_queued_before() -> None:
    assert batch_ready_callbacks()
    ran: list[str] = []
    async with trio_asyncio.open_loop() as loop:

        def first() -> None:
            ran.append("first")
            loop.call_soon(ran.append, "child")

        loop.call_soon(first)
        loop.call_soon(ran.append, "second")
        loop.call_soon(ran.append, "third")
        await loop.synchronize()
        await loop.synchronize()
    assert ran == ["first", "second", "third", "child"]


async def test_timers_fire_in_time_order_among_batches() -> None:
    assert batch_ready_callbacks()
    ran: list[str] = []
    async with trio_asyncio.open_loop() as loop:
        done = trio.Event()
        loop.call_later(0.03, lambda: (ran.append("late"), done.set()))
        loop.call_later(0.01, ran.append, "early")
        loop.call_soon(ran.append, "now")
        with trio.fail_after(5):
            await done.wait()
    assert ran == ["now", "early", "late"]


async def test_crossings_both_ways_still_work() -> None:
    assert batch_ready_callbacks()

    async def in_trio(x: int) -> int:
        await trio.lowlevel.checkpoint()
        return x + 1

    async def in_asyncio(x: int) -> int:
        await asyncio.sleep(0)
        return await trio_asyncio.trio_as_aio(in_trio)(x) * 10

    async with trio_asyncio.open_loop():
        results = [await trio_asyncio.aio_as_trio(in_asyncio)(i) for i in range(20)]
    assert results == [(i + 1) * 10 for i in range(20)]


async def test_callbacks_that_keep_queueing_callbacks_still_let_trio_run() -> None:
    assert batch_ready_callbacks()
    spins = 0
    stop = False
    gaps: list[int] = []
    async with trio_asyncio.open_loop() as loop:

        def spin() -> None:
            nonlocal spins
            spins += 1
            # An unbounded batch would never yield to Trio: end the chain at some point.
            if not stop and spins < 10_000:
                loop.call_soon(spin)

        loop.call_soon(spin)
        seen = 0
        for _ in range(20):
            await trio.lowlevel.checkpoint()
            gaps.append(spins - seen)
            seen = spins
        stop = True
    assert seen < 10_000
    assert max(gaps) <= 6  # a few rounds per pass of the loop, then Trio runs


class IoWaits(trio.abc.Instrument):
    """The timeouts of the run loop's epoll waits: a wakeup for a timer shows as a wait
    that ends at that timer."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def before_io_wait(self, timeout: float) -> None:
        self.timeouts.append(timeout)


async def test_a_cancelled_timer_wakes_nothing() -> None:
    """asyncio's order: a cancelled timer is dropped, not waited for (trio-asyncio waits)."""
    assert batch_ready_callbacks()
    async with trio_asyncio.open_loop() as loop:
        handles = [
            loop.call_later(0.05 + i * 0.01, pytest.fail, "a cancelled timer ran") for i in range(5)
        ]
        await loop.synchronize()
        for h in handles:
            h.cancel()
        waits = IoWaits()
        trio.lowlevel.add_instrument(waits)
        try:
            await loop.synchronize()  # one pass of the loop after the cancels
            await trio.sleep(0.2)
        finally:
            trio.lowlevel.remove_instrument(waits)
        assert loop._timers == []
    # Our sleep is one wait of about 0.2 s; the loop waking for each dead timer would
    # add waits that end at 0.05-0.09 s.
    assert [t for t in waits.timeouts if 0.001 < t < 0.15] == []


async def test_a_live_timer_behind_cancelled_ones_still_fires_on_time() -> None:
    assert batch_ready_callbacks()
    async with trio_asyncio.open_loop() as loop:
        fired = trio.Event()
        dead = [loop.call_later(0.01, pytest.fail, "cancelled") for _ in range(10)]
        live = loop.call_later(0.03, fired.set)
        await loop.synchronize()
        for h in dead:
            h.cancel()
        t0 = trio.current_time()
        with trio.fail_after(5):
            await fired.wait()
        assert trio.current_time() - t0 >= 0.015
        assert not live.cancelled()


def test_the_heap_is_rebuilt_when_cancelled_timers_pile_up_behind_its_head() -> None:
    """Cancelled timers behind a live head are swept once they are half the heap."""

    class Timer:
        def __init__(self, when: float, cancelled: bool) -> None:
            self._when, self._cancelled = when, cancelled

        def __lt__(self, other: Timer) -> bool:
            return self._when < other._when

    state = [aio_loop.REBUILD_MIN]
    head = Timer(0.0, False)
    timers = [head] + [Timer(1.0 + i, i % 10 != 0) for i in range(aio_loop.REBUILD_MIN - 2)]
    heapq.heapify(timers)
    aio_loop.drop_cancelled_timers(timers, state)
    assert len(timers) == aio_loop.REBUILD_MIN - 1  # under the threshold: head kept, no sweep
    timers.append(Timer(1000.0, True))
    aio_loop.drop_cancelled_timers(timers, state)
    live = 1 + len(range(0, aio_loop.REBUILD_MIN - 2, 10))
    assert len(timers) == live
    assert all(not t._cancelled for t in timers)
    assert timers[0] is head
    assert state == [aio_loop.REBUILD_MIN]  # 2 x live is below the floor
    head._cancelled = True
    aio_loop.drop_cancelled_timers(timers, state)
    assert timers[0]._when == 1.0  # the next live one
    assert len(timers) == live - 1
    # Many live timers: the next sweep waits until the heap is twice their number.
    big = [Timer(float(i), i % 2 == 1) for i in range(800)]
    heapq.heapify(big)
    aio_loop.drop_cancelled_timers(big, state)
    assert len(big) == 400
    assert state == [800]
    big.extend(Timer(2000.0 + i, True) for i in range(399))
    aio_loop.drop_cancelled_timers(big, state)
    assert len(big) == 799  # below 800: left alone


async def test_trio_task_starts_queued_together_take_one_step_of_the_loop() -> None:
    """Crossings into Trio (a burst of calls) do not hold the loop for a pass each: the
    callbacks queued behind them (a reply to read) run in the same step."""
    assert batch_ready_callbacks()
    ran: list[str] = []

    async def in_trio(i: int) -> int:
        return i

    async with trio_asyncio.open_loop() as loop:
        await loop.synchronize()
        steps = LoopSteps(loop)
        trio.lowlevel.add_instrument(steps)
        try:
            futures = [loop.trio_as_future(in_trio, i) for i in range(20)]
            loop.call_soon(ran.append, "behind the crossings")
            await loop.synchronize()
            assert ran == ["behind the crossings"]
            assert steps.count <= 2  # waiting for each task's start would be 20 or more
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert [await trio_asyncio.run_aio_future(f) for f in futures] == list(range(20))


async def test_a_crossing_cancelled_before_its_task_starts_is_cancelled_and_never_runs() -> None:
    assert batch_ready_callbacks()
    ran: list[int] = []

    async def in_trio(i: int) -> None:
        ran.append(i)

    async with trio_asyncio.open_loop() as loop:
        await loop.synchronize()
        future = loop.trio_as_future(in_trio, 1)
        kept = loop.trio_as_future(in_trio, 2)
        assert future.cancel()
        await loop.synchronize()
        await trio_asyncio.run_aio_future(kept)
        await loop.synchronize()
        assert future.cancelled()
    assert ran == [2]


class _Timer:
    _cancelled = False

    def __init__(self, when: float) -> None:
        self._when = when


class _TickingLoop:
    """The attributes `_main_loop_one` reads, with a clock that has moved past the timer's
    time between the due check and the wait (a busy machine: one read, then the next)."""

    def __init__(self, receive: trio.MemoryReceiveChannel[object]) -> None:
        self._timers = [_Timer(1.0)]
        self._q_recv = receive
        self._reads = iter([0.999, 1.001, 1.001])

    def time(self) -> float:
        return next(self._reads)


async def test_a_timer_that_falls_due_between_the_check_and_the_wait_ends_the_wait() -> None:
    """The wait for the next callback is bounded by the head timer; when the clock passes
    that timer after the due check, the bound is zero, never negative (a ValueError from
    `move_on_after` there ends the worker's loop)."""
    from ibex.patches.trio_asyncio_loop import _main_loop_one

    send, receive = trio.open_memory_channel[object](1)
    loop = _TickingLoop(receive)
    with trio.fail_after(5):
        await _main_loop_one(loop)
    assert [t._when for t in loop._timers] == [1.0]  # left for the next pass to run
    send.close()
