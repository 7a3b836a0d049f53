"""trio-asyncio's main loop, batching: one Trio step per batch of ready asyncio callbacks.

trio-asyncio's main loop takes one callback per Trio step, with a
memory-channel receive (a yield and a pass of the scheduler, i.e. an epoll
call) and a cancel scope for each. asyncio's own loop runs every callback that
is ready when an iteration starts, then polls; `batch_ready_callbacks` makes
trio-asyncio do the same. After the callback it waited for, the loop runs as
many more as were queued at that moment (so callbacks that keep scheduling
callbacks still let Trio run between rounds), due timers first. A Trio task
start (a crossing into Trio: every call's `in_trio`) is handed to the nursery
and the loop goes on. trio-asyncio's own loop waits for each such task's first
step, a whole pass of the Trio scheduler with every other runnable task's step
in it, which holds every callback queued behind a burst of calls' crossings (a
Redis reply, another call's request) for one pass per call. A task cancelled
before its first step still resolves its future as cancelled (trio-asyncio's
`AsyncHandle` checks that when it starts). Cancelled timers are dropped before
the loop waits (`timer_sweep.drop_cancelled_timers`).

It checks trio-asyncio's version (`ibex.versions`) and its internals at install,
and leaves the loop as it is (logging why) when they have changed. What it
saves: docs/performance.md (`python -m benchmarks.wakeups`).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import weakref
from typing import Any

import trio
import trio_asyncio._base as _base
from sniffio import thread_local as sniffio_library
from trio_asyncio._handles import AsyncHandle as _AsyncHandle

from ibex.patches.timer_sweep import REBUILD_MIN, drop_cancelled_timers
from ibex.versions import require

__all__ = ["batch_ready_callbacks"]

log = logging.getLogger(__name__)

_Loop = _base.BaseTrioEventLoop
_original = _Loop._main_loop_one
# What the replacement relies on: the queue it takes callbacks from (and sizes a batch
# by), the nursery it starts Trio tasks in, the timer heap, and the handle classes.
_NEEDS = frozenset({"_q_recv", "receive_nowait", "_timers", "_nursery", "_started"})


#: Each loop's heap size that triggers a full sweep (`drop_cancelled_timers`), kept beside
#: the loop rather than on it.
_REBUILD_AT: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _rebuild_at(loop: Any) -> list[int]:
    state = _REBUILD_AT.get(loop)
    if state is None:
        state = _REBUILD_AT[loop] = [REBUILD_MIN]
    return state


def _due_timer(loop: Any) -> Any:
    """The timer heap's head when its time has come (popped), else None."""
    timers = loop._timers
    if timers and timers[0]._when <= loop.time():
        return heapq.heappop(timers)
    return None


def _dispatch(loop: Any, obj: Any, due: bool) -> None:
    """Run one object as trio-asyncio's main loop does (`due`: a timer off the heap, not a
    new one from the queue), without waiting for a Trio task it starts to take its first
    step (see `batch_ready_callbacks`)."""
    if not due and isinstance(obj, asyncio.TimerHandle):
        heapq.heappush(loop._timers, obj)
    elif isinstance(obj, _AsyncHandle):
        obj._context.run(loop._nursery.start_soon, obj._run, name=obj._callback)
    elif not obj._cancelled:
        previous, sniffio_library.name = sniffio_library.name, "asyncio"
        try:
            obj._run()
        finally:
            sniffio_library.name = previous


async def _main_loop_one(self: Any, no_wait: bool = False) -> None:
    timers = self._timers
    if timers:
        drop_cancelled_timers(timers, _rebuild_at(self))
    obj = _due_timer(self)
    due = obj is not None
    if due:
        pass
    elif no_wait:
        obj = self._q_recv.receive_nowait()
    else:
        # Not due a moment ago may be due now: the clock moves between the two reads.
        timeout = max(0.0, timers[0]._when - self.time()) if timers else math.inf
        with trio.move_on_after(timeout):
            obj = await self._q_recv.receive()
        if obj is None:
            return  # a timer is due: the next call runs it
    _dispatch(self, obj, due)
    if no_wait:
        return
    # As many more as were queued at this moment, each without a yield.
    for _ in range(self._q_recv.statistics().current_buffer_used):
        if self._stopped.is_set():
            return
        obj = _due_timer(self)
        due = obj is not None
        if not due:
            try:
                obj = self._q_recv.receive_nowait()
            except trio.WouldBlock:
                return
        _dispatch(self, obj, due)


_main_loop_one.batched = True  # type: ignore[attr-defined]


def batch_ready_callbacks() -> bool:
    """Install the batching main loop (idempotent); False if trio-asyncio's internals moved."""
    require("trio-asyncio")
    if getattr(_Loop._main_loop_one, "batched", False):
        return True
    code = getattr(_original, "__code__", None)
    if code is None or "no_wait" not in code.co_varnames or not set(code.co_names) >= _NEEDS:
        log.warning("aio_batching_off", extra={"detail": "trio_asyncio main loop changed"})
        return False
    _Loop._main_loop_one = _main_loop_one
    return True
