"""trio-asyncio's loop, one Trio step per batch of ready callbacks instead of one per callback.

grpclib and h2 run as asyncio callbacks on trio-asyncio's loop. Its main loop
takes one callback per Trio step: a memory-channel receive (a yield and a pass
of the scheduler, i.e. an epoll call) and a cancel scope for each. An answer
cost about 9 of those steps (`python -m benchmarks.wakeups`). asyncio's own
loop runs every callback that is ready when an iteration starts, then polls;
`batch_ready_callbacks` makes trio-asyncio do the same. After the callback it
waited for, the loop runs as many more as were queued at that moment (so
callbacks that keep scheduling callbacks still let Trio run between rounds),
each through the original's own no-wait form (due timers first, as before;
a Trio task start, e.g. a crossing into Trio, still waits for the task to
begin).

The same loop also drops cancelled timers before it waits (see
`drop_cancelled_timers`): trio-asyncio woke for each of them.

This is the only module that touches trio-asyncio internals; it checks them at
install and leaves the loop as it is (logging why) when they have changed.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

import trio
import trio_asyncio._base as _base

from ibex.versions import require

require("trio-asyncio")
log = logging.getLogger(__name__)

_Loop = _base.BaseTrioEventLoop
_original = _Loop._main_loop_one
# What the replacement relies on: the queue it sizes a batch by, the original's no-wait
# form, which takes one object from that queue with receive_nowait, and the timer heap.
_NEEDS = frozenset({"_q_recv", "receive_nowait", "_timers"})
_REBUILD_MIN = 256  # the smallest heap that is ever swept whole


def drop_cancelled_timers(timers: list[Any], state: list[int]) -> None:
    """Take cancelled timers off the heap's head, and rebuild it when they pile up behind.

    trio-asyncio keeps a cancelled timer in its heap until the timer's time comes
    and then wakes just to discard it: every call's read timeout (5 s) and
    deadline timer (the caller's deadline), cancelled when the call ends, each
    cost a later wakeup of an otherwise idle loop. asyncio's own loop discards
    them as this does. `state[0]` is the heap size that triggers a full rebuild:
    twice the live timers after the last one, so the scan is amortised O(1).
    """
    while timers and timers[0]._cancelled:
        heapq.heappop(timers)
    if len(timers) >= state[0]:
        timers[:] = [t for t in timers if not t._cancelled]
        heapq.heapify(timers)
        state[0] = max(_REBUILD_MIN, 2 * len(timers))


def _rebuild_at(loop: Any) -> list[int]:
    state: list[int] | None = loop.__dict__.get("_ibex_timer_rebuild")
    if state is None:
        state = loop._ibex_timer_rebuild = [_REBUILD_MIN]
    return state


async def _main_loop_one(self: Any, no_wait: bool = False) -> None:
    timers = self._timers
    if timers:
        drop_cancelled_timers(timers, _rebuild_at(self))
    await _original(self, no_wait)
    if no_wait:
        return
    # The original's own no-wait form takes one queued object (or a due timer)
    # without yielding; only a Trio task start waits, for the task to begin.
    for _ in range(self._q_recv.statistics().current_buffer_used):
        if self._stopped.is_set():
            return
        try:
            await _original(self, True)
        except trio.WouldBlock:
            return


_main_loop_one.batched = True  # type: ignore[attr-defined]


def batch_ready_callbacks() -> bool:
    """Install the batching main loop (idempotent); False if trio-asyncio's internals moved."""
    if getattr(_Loop._main_loop_one, "batched", False):
        return True
    code = getattr(_original, "__code__", None)
    if code is None or "no_wait" not in code.co_varnames or not set(code.co_names) >= _NEEDS:
        log.warning("aio_batching_off", extra={"detail": "trio_asyncio main loop changed"})
        return False
    _Loop._main_loop_one = _main_loop_one
    return True
