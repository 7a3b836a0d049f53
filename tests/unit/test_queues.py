"""The fair waiting lines (ibex.service.queues): order, per-key caps, waits, cancellation.

Pure Trio with a MockClock (autojump): the waits are on Trio's clock only.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import pytest
import trio
import trio.testing

import ibex.service.queues as queues
from ibex.service.queues import (
    SWITCH_INTERVAL,
    TIMED,
    UNTIMED,
    URGENT,
    FairQueue,
    WorkerThreads,
    default_threads,
    share_the_gil,
)
from ibex.sources.cpu import WORKER_NICE


async def _waiter(
    q: FairQueue, key: str, line: int, served: list[str], name: str, hold: float = 1.0
) -> None:
    if await q.acquire(key, line, 100.0):
        served.append(name)
        await trio.sleep(hold)
        q.release(key)


async def test_a_freed_unit_goes_to_urgent_then_timed_then_untimed_callers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    q = FairQueue(1)
    assert q.try_acquire("x")
    served: list[str] = []
    async with trio.open_nursery() as nursery:
        for name, line in [("untimed", UNTIMED), ("timed1", TIMED), ("urgent", URGENT)]:
            nursery.start_soon(_waiter, q, "x", line, served, name)
            await trio.sleep(0.001)  # arrival order: untimed first
        nursery.start_soon(_waiter, q, "x", TIMED, served, "timed2")
        await trio.sleep(0.001)
        assert q.waiting() == 4 and q.waiting(TIMED) == 3 and q.waiting(URGENT) == 1
        q.release("x")
    assert served == ["urgent", "timed1", "timed2", "untimed"]
    assert q.held == 0 and q.by_key == {} and q.waiting() == 0


async def test_a_key_at_its_cap_is_passed_over_and_never_holds_every_unit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    q = FairQueue(4, per_key=2)
    served: list[str] = []
    async with trio.open_nursery() as nursery:
        for i in range(5):  # one tenant's burst: two run, three wait for their own units
            nursery.start_soon(_waiter, q, "noisy", TIMED, served, f"noisy{i}", 10.0)
        await trio.sleep(0.001)
        assert q.held == 2 and q.by_key == {"noisy": 2} and q.waiting() == 3
        # Another tenant arriving after the burst is served at once, past the waiting burst.
        assert q.try_acquire("quiet")
        nursery.start_soon(_waiter, q, "quiet", TIMED, served, "quiet2", 1.0)
        await trio.sleep(0.001)
        assert "quiet2" in served and q.by_key["quiet"] == 2
        q.release("quiet")
    assert all(n.startswith("noisy") for n in served[:2]) and served[2] == "quiet2"
    assert sorted(served) == sorted([f"noisy{i}" for i in range(5)] + ["quiet2"])
    assert q.held == 0 and q.by_key == {}


async def test_a_wait_past_its_limit_ends_empty_and_leaves_the_line(
    autojump_clock: trio.testing.MockClock,
) -> None:
    q = FairQueue(1)
    assert q.try_acquire()
    t0 = trio.current_time()
    assert not await q.acquire("", TIMED, 0.25)
    assert trio.current_time() - t0 == pytest.approx(0.25)
    assert q.waiting() == 0 and q.held == 1
    q.release()
    assert q.held == 0


async def test_a_waiter_cancelled_from_outside_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    q = FairQueue(1, per_key=1)
    assert q.try_acquire("a")
    with trio.move_on_after(0.1):
        await q.acquire("b", TIMED, 100.0)
    assert q.waiting() == 0 and q.by_key == {"a": 1}
    # Granted and cancelled in the same step: the unit is handed back, not lost.
    async with trio.open_nursery() as nursery:
        cancel = trio.CancelScope()

        async def grabbed() -> None:
            with cancel:
                await q.acquire("b", TIMED, 100.0)
                await trio.sleep_forever()  # holding it: only the cancel ends this

        nursery.start_soon(grabbed)
        await trio.sleep(0.001)
        q.release("a")  # hands the unit to the waiter...
        cancel.cancel()  # ...which is cancelled before it runs
    assert q.held in (0, 1)
    if q.held:  # it ran and held the unit when cancelled inside its body: not our leak
        q.release("b")
    assert q.held == 0 and q.by_key == {} and q.try_acquire("c")


async def test_worker_threads_estimate_the_wait_only_when_every_thread_is_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    threads = WorkerThreads(2)
    assert await threads.run_held(lambda: 7) == 7
    assert threads.service > 0.0  # every run feeds the estimate
    threads.service = 0.010
    assert threads.expected_wait(TIMED) == 0.0
    assert threads.queue.try_acquire() and threads.queue.try_acquire()
    assert threads.expected_wait(TIMED) == pytest.approx(0.005)  # (0 ahead + 1) / 2 threads


def test_capacity_and_cap_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FairQueue(0)
    with pytest.raises(ValueError):
        FairQueue(2, per_key=0)


def test_worker_threads_leave_the_loop_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, threads in [(1, 1), (2, 1), (3, 2), (16, 2)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert default_threads() == threads


async def test_run_takes_a_thread_unit_for_the_call_unless_the_caller_holds_one() -> None:
    """`run` waits in the urgent line for a unit and gives it back; with `held` it takes
    none (the caller's own unit covers it). Either way `fn` runs niced in a thread."""
    threads = WorkerThreads(1)
    seen: list[tuple[int, bool, int]] = []

    def fn() -> str:
        tid = threading.get_native_id()
        seen.append((threads.queue.held, tid == main, os.getpriority(os.PRIO_PROCESS, tid)))
        return "ok"

    main = threading.get_native_id()
    assert await threads.run(fn) == "ok" and threads.queue.held == 0
    assert threads.queue.try_acquire()
    assert await threads.run(fn, held=True) == "ok" and threads.queue.held == 1
    threads.queue.release()
    assert [(held, in_loop_thread) for held, in_loop_thread, _ in seen] == [
        (1, False),
        (1, False),
    ]
    assert all(nice >= WORKER_NICE for _, _, nice in seen)


async def test_run_waits_for_the_unit_ahead_of_calls_without_a_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call holding a slot (`run`) is served before a timed waiter that came first."""
    threads = WorkerThreads(1)
    assert threads.queue.try_acquire()
    order: list[str] = []

    async def timed() -> None:
        assert await threads.queue.acquire("", TIMED, math.inf)  # the thread runs in real time
        order.append("timed")
        threads.queue.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(timed)
        await trio.sleep(0.01)
        nursery.start_soon(lambda: threads.run(lambda: order.append("urgent")))
        await trio.sleep(0.01)
        threads.queue.release()
    assert order == ["urgent", "timed"]


async def test_the_service_estimate_is_a_moving_average_of_thread_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each run moves the estimate a fifth of the way to what it held the thread for."""
    ticks = iter([10.0, 10.5, 20.0, 20.5])

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return next(ticks)

    monkeypatch.setattr(queues, "time", Clock)
    threads = WorkerThreads(1)
    await threads.run_held(lambda: None)
    assert threads.service == pytest.approx(0.1)  # 0 + 0.2 x (0.5 - 0)
    await threads.run_held(lambda: None)
    assert threads.service == pytest.approx(0.18)  # 0.1 + 0.2 x (0.5 - 0.1)


def test_share_the_gil_lowers_the_switch_interval_and_never_raises_it() -> None:
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        share_the_gil()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
        sys.setswitchinterval(SWITCH_INTERVAL / 2)
        share_the_gil()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL / 2)
    finally:
        sys.setswitchinterval(saved)
