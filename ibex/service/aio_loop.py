"""trio-asyncio's loop, one Trio step per batch of ready callbacks instead of one per callback.

grpclib and h2 run as asyncio callbacks on trio-asyncio's loop. Its main loop
takes one callback per Trio step: a memory-channel receive (a yield and a pass
of the scheduler, i.e. an epoll call) and a cancel scope for each. An answer
cost about 9 of those steps (`python -m benchmarks.wakeups`). asyncio's own
loop runs every callback that is ready when an iteration starts, then polls;
`batch_ready_callbacks` makes trio-asyncio do the same. After the callback it
waited for, the loop runs as many more as were queued at that moment (so
callbacks that keep scheduling callbacks still let Trio run between rounds),
in the same order, with due timers first as before. It stops at a Trio task
start (`AsyncHandle`, e.g. a crossing into Trio), which keeps the original's
wait for the task to start.

This is the only module that touches trio-asyncio internals; it checks them at
install and leaves the loop as it is (logging why) when they have changed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from typing import Any

import trio
import trio_asyncio._base as _base
from sniffio import thread_local as _sniffio
from trio_asyncio._handles import AsyncHandle

log = logging.getLogger(__name__)

_Loop = _base.BaseTrioEventLoop
_original = _Loop._main_loop_one
# What the replacement relies on, as the original uses it.
_NEEDS = frozenset({"_q_recv", "_timers", "_nursery", "_started", "_context", "_cancelled"})


async def _main_loop_one(self: Any, no_wait: bool = False) -> None:
    await _original(self, no_wait)
    if no_wait:
        return
    queue = self._q_recv
    for _ in range(queue.statistics().current_buffer_used):
        if self._stopped.is_set():
            return
        timers = self._timers
        if timers and timers[0]._when <= self.time():
            obj = heapq.heappop(timers)
        else:
            try:
                obj = queue.receive_nowait()
            except trio.WouldBlock:
                return
            if isinstance(obj, asyncio.TimerHandle):
                heapq.heappush(timers, obj)
                continue
        if isinstance(obj, AsyncHandle):
            obj._context.run(self._nursery.start_soon, obj._run, name=obj._callback)
            await obj._started.wait()
            return
        if not obj._cancelled:
            previous, _sniffio.name = _sniffio.name, "asyncio"
            try:
                obj._run()
            finally:
                _sniffio.name = previous


_main_loop_one.batched = True  # type: ignore[attr-defined]


def batch_ready_callbacks() -> bool:
    """Install the batching main loop (idempotent); False if trio-asyncio's internals moved."""
    if getattr(_Loop._main_loop_one, "batched", False):
        return True
    code = getattr(_original, "__code__", None)
    if code is None or not set(code.co_names) >= _NEEDS:
        log.warning("aio_batching_off", extra={"detail": "trio_asyncio main loop changed"})
        return False
    _Loop._main_loop_one = _main_loop_one
    return True
