"""Admission: which calls the process takes on, and the count of those in flight.

Refusing costs microseconds; taking a call that cannot be served in time
costs the core and delays every admitted call behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

from ibex.errors import Overloaded, Unavailable
from ibex.ops.metrics import Metrics


class AdmissionConfig(msgspec.Struct, frozen=True):
    """Admission limits (seconds); defaults live here only."""

    max_in_flight: int = 64
    shed_remaining: float = 0.010
    shed_lag: float = 0.004


class Admission:
    """Counts calls in flight (feeding the gauge) and refuses what cannot be served."""

    def __init__(self, config: AdmissionConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.in_flight = 0
        self.loop_lag = 0.0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def check(self, remaining: float | None) -> None:
        """Raise Overloaded or Unavailable when a new call must be refused now."""
        if self.draining:
            raise Unavailable("server is draining; retry elsewhere")
        if self.in_flight >= self.config.max_in_flight:
            self._shed("in_flight", f"overloaded: {self.in_flight} requests in flight")
        if self.loop_lag > self.config.shed_lag:
            # The loop is behind: admitted work would wait its turn past the
            # caller's deadline, and new work only deepens the queue.
            self._shed("lag", f"overloaded: event loop {self.loop_lag * 1000:.1f}ms behind")
        if remaining is not None and remaining < self.config.shed_remaining:
            self._shed("deadline", f"overloaded: {remaining * 1000:.1f}ms of the deadline left")

    def _shed(self, reason: str, message: str) -> None:
        self.metrics.shed(reason)
        raise Overloaded(reason, message)

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Count the block as one call in flight (and on the gauge), however it ends."""
        self.in_flight += 1
        self.idle.clear()
        try:
            with self.metrics.in_flight():
                yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
