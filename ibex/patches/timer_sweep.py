"""The timer-heap sweep of the batching trio-asyncio main loop (`trio_asyncio_loop`).

trio-asyncio keeps cancelled timers in its heap and wakes for each of them;
the patched main loop drops them before it waits, with `drop_cancelled_timers`.
Pure (a heap of objects with `_cancelled`), so it is tested apart from the loop.
"""

from __future__ import annotations

import heapq
from typing import Any

REBUILD_MIN = 256  # the smallest heap that is ever swept whole


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
        state[0] = max(REBUILD_MIN, 2 * len(timers))
