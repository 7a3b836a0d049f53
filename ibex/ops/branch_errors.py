"""Branch errors and timeouts of real calls, counted and logged as a rate-limited summary.

A directive or memory branch that fails does not fail the call (the answer is
degraded), so one log line per failed branch would flood the log exactly when a
dependency is down. Instead each failure is counted by source (directive, hot,
cold) and reason (the outcome's status and its detail: `error: redis: connection
failed`, `timeout: no answer within 5ms`), and every `interval` seconds one
`branch_errors` line per source with failures in that window is logged at
warning: the counts by reason, the window, and how many calls of that source
succeeded meanwhile. Details are SourceError texts and fixed timeout messages
(no secret, no memory text); at most `MAX_REASONS` distinct reasons are kept
per source and window, the rest counted as `other`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

import trio

from ibex.assembly.structs import BranchOutcome

__all__ = ["BranchErrors"]

log = logging.getLogger(__name__)

MAX_REASONS: Final = 16
_REASON_CHARS: Final = 120


class _Window:
    __slots__ = ("errors", "reasons", "successes", "timeouts")

    def __init__(self) -> None:
        self.reasons: dict[str, int] = {}
        self.successes = self.errors = self.timeouts = 0


class BranchErrors:
    """Counts failed branches by source and reason; `flush` logs and resets them."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._since = clock()

    def observe(self, branches: Iterable[BranchOutcome]) -> None:
        """One answered call's branches (cheap: a dict update per failed branch)."""
        for b in branches:
            if b.status == "skipped":
                continue
            window = self._windows.get(b.source)
            if window is None:
                window = self._windows[b.source] = _Window()
            if b.status == "success":
                window.successes += 1
                continue
            if b.status == "timeout":
                window.timeouts += 1
            else:
                window.errors += 1
            reason = f"{b.status}: {b.detail}"[:_REASON_CHARS]
            reasons = window.reasons
            if reason not in reasons and len(reasons) >= MAX_REASONS:
                reason = "other"
            reasons[reason] = reasons.get(reason, 0) + 1

    def flush(self) -> int:
        """Log one `branch_errors` line per source that failed since the last flush; how many."""
        now = self._clock()
        window_s = round(now - self._since, 3)
        self._since = now
        windows, self._windows = self._windows, {}
        lines = 0
        for source, window in sorted(windows.items()):
            if not window.reasons:
                continue
            log.warning(
                "branch_errors",
                extra={
                    "source": source,
                    "window_s": window_s,
                    "errors": window.errors,
                    "timeouts": window.timeouts,
                    "successes": window.successes,
                    "reasons": dict(sorted(window.reasons.items(), key=lambda kv: -kv[1])),
                },
            )
            lines += 1
        return lines

    async def run(self) -> None:
        """Flush every `interval` seconds, for ever (a task in the daemon's nursery)."""
        while True:
            await trio.sleep(self.interval)
            self.flush()
