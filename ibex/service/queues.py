"""Fair waiting lines for a counted resource: assembly slots and worker threads.

A `FairQueue` hands out `capacity` units. Waiters stand in three lines, each
first come, first served, and a freed unit goes to the first line that has
an eligible waiter:

- `URGENT`: calls that already hold another resource (an assembly slot) and
  need this one to finish; serving them first frees what they hold.
- `TIMED`: calls with a deadline.
- `UNTIMED`: calls without one. They are served only when no call with a
  deadline is eligible, so any number of them never delays a call that has a
  deadline (each waits at most its caller's maximum wait, then is refused).

With `per_key`, no key (an org) holds more than that many units at once; a
waiter whose key is at its cap is passed over, so one tenant's queue never
stands in front of another's. Units are handed to a waiter directly on
release (no thundering herd, no barging past the lines).

`WorkerThreads` is a `FairQueue` over the worker threads that run large
pipelines, with an estimate of how long a new call would wait for one.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import trio

from ibex.sources.cpu import niced

URGENT: Final = 0
TIMED: Final = 1
UNTIMED: Final = 2

_EWMA: Final = 0.2  # weight of the newest sample in the service-time estimate
# How long the loop thread waits at most for the GIL while a worker thread runs Python
# (CPython's default is 5 ms: a call needing a few loop wake-ups then lost tens of ms).
SWITCH_INTERVAL: Final = 0.001
T = TypeVar("T")


def default_threads() -> int:
    """Worker threads for large pipelines: one core less than the process may use, at
    most two, at least one.

    The counts run outside the GIL at full speed, so as many busy threads as cores
    leave the loop thread none of its own: on 2 cores, a second thread took the
    share of another tenant's 45 ms calls that were OK from 68 % to 18 % (CJK
    schemas saturating the threads), and finished fewer large calls too.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores - 1))


def share_the_gil() -> None:
    """Make a worker thread running Python hand the GIL to the loop within SWITCH_INTERVAL.

    Worker threads run the Python parts of large pipelines (escaping, formatting)
    between the GIL-free counts; with the default interval every wake-up of the
    loop could wait 5 ms for them. Never raises an interval set lower already.
    """
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))


@dataclass(slots=True, eq=False)  # eq=False: a line removes a waiter by identity
class _Waiter:
    key: str
    event: trio.Event = field(init=False, default_factory=trio.Event)
    granted: bool = field(init=False, default=False)


class FairQueue:
    """`capacity` units, three FIFO lines (urgent, timed, untimed), an optional per-key cap."""

    def __init__(self, capacity: int, per_key: int | None = None) -> None:
        if capacity < 1 or (per_key is not None and per_key < 1):
            raise ValueError("capacity and per_key must be >= 1")
        self.capacity = capacity
        self.per_key = per_key
        self.held = 0
        self.by_key: dict[str, int] = {}
        self._lines: tuple[deque[_Waiter], ...] = (deque(), deque(), deque())

    def waiting(self, upto: int = UNTIMED) -> int:
        """Waiters in the lines served before or with `upto` (all lines by default)."""
        return sum(len(line) for line in self._lines[: upto + 1])

    def key_full(self, key: str) -> bool:
        """True when `key` holds as many units as its cap allows."""
        return self.per_key is not None and self.by_key.get(key, 0) >= self.per_key

    def _eligible(self, key: str) -> bool:
        return self.held < self.capacity and not self.key_full(key)

    def try_acquire(self, key: str = "") -> bool:
        """Take a unit now if one is free for `key` (no checkpoint, no waiting).

        Free units never coexist with eligible waiters (a release hands its unit
        on at once), so taking one here jumps no line.
        """
        if not self._eligible(key):
            return False
        self._take(key)
        return True

    async def acquire(self, key: str, line: int, limit: float) -> bool:
        """Wait at most `limit` seconds in `line`; True when a unit is held (release it)."""
        if self.try_acquire(key):
            return True
        waiter = _Waiter(key)
        self._lines[line].append(waiter)
        try:
            with trio.move_on_after(max(0.0, limit)):
                await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # handed a unit as it was cancelled: give it back
                self.release(key)
            else:
                self._lines[line].remove(waiter)
            raise
        if not waiter.granted:
            self._lines[line].remove(waiter)
        return waiter.granted

    def release(self, key: str = "") -> None:
        self.held -= 1
        left = self.by_key[key] - 1
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]
        self._dispatch()

    def _take(self, key: str) -> None:
        self.held += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1

    def _dispatch(self) -> None:
        while self.held < self.capacity:
            waiter = self._first_eligible()
            if waiter is None:
                return
            self._take(waiter.key)
            waiter.granted = True
            waiter.event.set()

    def _first_eligible(self) -> _Waiter | None:
        for line in self._lines:
            for waiter in line:
                if not self.key_full(waiter.key):
                    line.remove(waiter)
                    return waiter
        return None


class WorkerThreads:
    """The worker threads large pipelines run in, as a `FairQueue`, and their service time.

    Work in a thread never holds the event loop, but the threads are few: a call
    that needs one queues for it, and `expected_wait` says for about how long.
    """

    def __init__(self, threads: int) -> None:
        self.queue = FairQueue(threads)
        self.service = 0.0  # smoothed seconds one pipeline holds a thread

    @property
    def threads(self) -> int:
        return self.queue.capacity

    def expected_wait(self, line: int) -> float:
        """Seconds a new call in `line` would wait for a thread: 0 while one is free."""
        if self.queue.held < self.queue.capacity:
            return 0.0
        ahead = self.queue.waiting(line)
        return (ahead + 1) / self.queue.capacity * self.service

    async def run(self, fn: Callable[[], T], *, held: bool = False) -> T:
        """Run `fn` in a worker thread; `held`: the caller already holds a thread unit.

        Without one, the call waits in the urgent line: it holds an assembly slot.
        """
        if not held:
            await self.queue.acquire("", URGENT, float("inf"))
        try:
            return await self.run_held(fn)
        finally:
            if not held:
                self.queue.release()

    async def run_held(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a thread under a unit the caller holds (the queue already bounds
        the threads, so trio's own limiter is a private one per call)."""
        t0 = time.monotonic()
        try:
            return await trio.to_thread.run_sync(
                functools.partial(niced, fn), limiter=trio.CapacityLimiter(1)
            )
        finally:
            self.service += _EWMA * (time.monotonic() - t0 - self.service)
