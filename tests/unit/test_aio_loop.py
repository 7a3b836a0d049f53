"""The batching trio-asyncio main loop (`ibex.service.aio_loop`).

Pinned: callbacks queued together run in one Trio step of the loop's task (the
saving), in FIFO order, with a callback scheduled by one of them running after
those queued before it (asyncio's order); timers still fire in time order; and
crossings both ways still work (a Trio task start inside a batch waits for the task).
"""

from __future__ import annotations

import asyncio

import trio
import trio.lowlevel
import trio_asyncio

from ibex.service.aio_loop import batch_ready_callbacks


class LoopSteps(trio.abc.Instrument):
    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


def test_install_is_idempotent() -> None:
    assert batch_ready_callbacks()
    assert batch_ready_callbacks()


async def test_callbacks_queued_together_run_in_one_step_in_order() -> None:
    assert batch_ready_callbacks()
    ran: list[int] = []
    async with trio_asyncio.open_loop() as loop:
        await loop.synchronize()
        steps = LoopSteps(loop._task)
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
