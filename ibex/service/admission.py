"""Admission by deadline: serve every call that can still be answered in its time.

A call is in flight from the moment its request message has arrived. It then
waits (the crossing into Trio and, when all are busy, an assembly slot) and
is served with whatever time its deadline leaves. What is refused, and why:

- `DEADLINE_EXCEEDED`: less than `min_answer` of the caller's deadline is
  left, on arrival or when a slot frees. Even a degraded answer could not
  leave in time. Not an overload signal: an idle daemon says the same.
- `RESOURCE_EXHAUSTED` (`in_flight`): the hard cap of calls in flight.
- `RESOURCE_EXHAUSTED` (`queue`): a *standing* queue, CoDel's signal. The
  wait from arrival to the start of an assembly (the sojourn) is measured
  where it happens; the queue is standing once every sojourn for `interval`
  has stayed above `target` (a burst drains within an interval and never
  trips it). While it stands, a new call is refused at once if the expected
  wait would leave it less than `min_useful` of its deadline: the time
  retrieval and the pipeline need to produce an answer worth having. Calls
  with room (a 1 s deadline behind a closed loop of 32 callers) are queued,
  never refused.

Refusing costs microseconds; a call that cannot be served in time would cost
the core and delay every admitted call behind it. The event loop's timer
lateness is not used: bursts, a GC, one big call or another process on the
core all raise it, and shedding on it refused calls that would have made
their deadlines.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import msgspec
import trio

from ibex.errors import DeadlineError, Overloaded, Unavailable
from ibex.ops.metrics import Metrics

_EWMA = 0.2  # weight of the newest sample in the wait and service estimates


class AdmissionConfig(msgspec.Struct, frozen=True):
    """Admission limits (seconds); defaults live here only."""

    max_in_flight: int = 64
    max_concurrent: int = 16
    min_answer: float = 0.002
    min_useful: float = 0.020
    queue_target: float = 0.005
    queue_interval: float = 0.100
    read_timeout: float = 5.0


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


class Ticket:
    """One admitted call: when it arrived and by when it must be answered (monotonic)."""

    __slots__ = ("arrived", "deadline", "started")

    def __init__(self, arrived: float, deadline: float | None) -> None:
        self.arrived = arrived
        self.deadline = deadline
        self.started = False

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


class Admission:
    """Counts calls in flight (feeding the gauge) and decides which are served."""

    def __init__(self, config: AdmissionConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.in_flight = 0
        self.pending = 0  # arrived, not yet assembling
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.queue = QueueDelay(config.queue_target, config.queue_interval)
        self._slots = trio.Semaphore(config.max_concurrent)

    def check_open(self) -> None:
        """Before the request is read: refuse at once while draining or at the hard cap."""
        if self.draining:
            raise Unavailable("server is draining; retry elsewhere")
        if self.in_flight >= self.config.max_in_flight:
            self._shed("in_flight", f"overloaded: {self.in_flight} requests in flight")

    def standing_queue_refuses(self, remaining: float | None) -> str | None:
        """The refusal message for a call with `remaining` seconds left, or None to admit.

        Only while the queue stands and calls are waiting in front: the expected
        wait would leave this one less than `min_useful`.
        """
        if (
            remaining is not None
            and self.queue.standing
            and self.pending > 0
            and remaining - self.queue.estimate < self.config.min_useful
        ):
            return (
                f"overloaded: about {self.queue.estimate * 1000:.0f}ms of queue "
                f"before a call with {remaining * 1000:.0f}ms left"
            )
        return None

    def gate(self, method: str, remaining: float | None) -> str | None:
        """Asked as a call's HEADERS arrive, before any per-call work (`grpc_shim`)."""
        message = self.standing_queue_refuses(remaining)
        if message is not None:
            self.metrics.shed("queue")
            self.metrics.observe_request(method.rsplit("/", 1)[-1], "RESOURCE_EXHAUSTED", 0.0)
        return message

    @contextmanager
    def admitted(self, arrived: float, remaining: float | None) -> Iterator[Ticket]:
        """The request has arrived: count it in flight until it ends; refuse what cannot fit.

        `arrived` is when the call reached the process (`time.monotonic()`), the start
        of its sojourn; `remaining` the caller's time left now (None without a deadline).
        """
        now = time.monotonic()
        self.check_open()
        if remaining is not None and remaining < self.config.min_answer:
            raise DeadlineError(
                f"{max(0.0, remaining) * 1000:.1f}ms of the deadline left: too little to answer in"
            )
        message = self.standing_queue_refuses(remaining)
        if message is not None:
            self._shed("queue", message)
        self.in_flight += 1
        self.pending += 1
        self.idle.clear()
        ticket = Ticket(min(arrived, now), None if remaining is None else now + remaining)
        try:
            with self.metrics.in_flight():
                yield ticket
        finally:
            if not ticket.started:  # refused or failed before its assembly began
                self.pending -= 1
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    @asynccontextmanager
    async def slot(self, ticket: Ticket) -> AsyncIterator[None]:
        """Trio side: wait for an assembly slot within the deadline, then hold it.

        The sojourn (arrival to here, crossing included) feeds the queue detector.
        """
        if ticket.started:
            raise RuntimeError("a ticket takes one slot")
        ticket.started = True
        self.pending -= 1
        remaining = ticket.remaining(time.monotonic())
        limit = math.inf if remaining is None else remaining - self.config.min_answer
        acquired = False
        try:  # a free slot is taken without a pass through the scheduler
            self._slots.acquire_nowait()
            acquired = True
        except trio.WouldBlock:
            with trio.move_on_after(max(0.0, limit)):
                await self._slots.acquire()
                acquired = True
        if not acquired:
            if self.queue.standing:
                self._shed("queue", "overloaded: no assembly slot within the deadline")
            raise DeadlineError("no assembly slot free within the deadline")
        try:
            now = time.monotonic()
            self.queue.observe(now - ticket.arrived, now)
            yield
        finally:
            self._slots.release()

    def _shed(self, reason: str, message: str) -> None:
        self.metrics.shed(reason)
        raise Overloaded(reason, message)
