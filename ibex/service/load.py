"""How loaded the daemon is, as admission reads it: CoDel's standing-queue detector over
the sojourns of calls, and the loop thread's utilisation and CPU per finished call.

Both are fed where the work happens (`Admission.slot` observes each sojourn, every
finished call samples the CPU) and read by the policies (`ibex.service.policies`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CpuLoad", "QueueDelay"]

_EWMA = 0.2  # weight of the newest sample in the wait and service estimates
_CPU_WINDOW = 0.025  # seconds of loop-thread CPU accounting per utilisation sample
_CPU_CALLS = 8  # finished calls a CPU-per-call sample spans at least
_CPU_EWMA = 0.5  # weight of the newest window in the utilisation and CPU-per-call estimates


class QueueDelay:
    """CoDel's standing-queue detector over sojourn times (monotonic seconds)."""

    def __init__(self, target: float, interval: float) -> None:
        self.target = target
        self.interval = interval
        self.standing = False
        self.estimate = 0.0  # smoothed sojourn, the expected wait of a new call
        self._above_since: float | None = None

    def observe(self, sojourn: float, now: float) -> None:
        self.estimate += _EWMA * (sojourn - self.estimate)
        if sojourn < self.target:
            self._above_since = None
            self.standing = False
        elif self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= self.interval:
            self.standing = True


class CpuLoad:
    """The loop thread's utilisation and CPU per finished call, over short windows.

    `time.thread_time` counts this thread only: worker threads (large counts)
    neither raise the estimate nor make the loop look busy, and neither does
    another process taking the core. A CPU-per-call sample spans at least
    `_CPU_CALLS` finished calls: one long stretch of work (a GC, a burst of
    intake) ending in a single finished call would otherwise read as one very
    expensive call, and the gate would turn away calls with plenty of time.
    """

    def __init__(
        self,
        window: float = _CPU_WINDOW,
        cpu_clock: Callable[[], float] = time.thread_time,
        now: float | None = None,
    ) -> None:
        self.window = window
        self.utilisation = 0.0
        self.per_call = 0.0
        self._cpu_clock = cpu_clock
        self._t0 = time.monotonic() if now is None else now
        self._cpu0 = cpu_clock()
        self._calls_cpu0 = self._cpu0
        self._calls = 0

    def finished(self, now: float) -> None:
        """One call ended (any outcome after it passed the gate)."""
        self._calls += 1
        self.sample(now)

    def sample(self, now: float) -> None:
        elapsed = now - self._t0
        if elapsed < self.window:
            return
        cpu = self._cpu_clock()
        used = cpu - self._cpu0
        self.utilisation += _CPU_EWMA * (min(1.0, used / elapsed) - self.utilisation)
        self._t0, self._cpu0 = now, cpu
        if self._calls >= _CPU_CALLS:
            sample = (cpu - self._calls_cpu0) / self._calls
            self.per_call += _CPU_EWMA * (sample - self.per_call)
            self._calls_cpu0, self._calls = cpu, 0

    def latency(self, ahead: float, saturated: float) -> float:
        """A new call's expected time to finish behind `ahead` calls, when CPU-bound.

        0 while the loop is less than `saturated` busy: then calls wait on I/O, not
        on each other, and no estimate from CPU applies.
        """
        if self.utilisation < saturated:
            return 0.0
        return (ahead + 1) * self.per_call
