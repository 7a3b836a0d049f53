"""Admission by deadline: serve every call that can still be answered in its time.

A call is in flight from the moment its request message has arrived. It then
waits (the crossing into Trio and, when all are busy, an assembly slot) and
is served with whatever time its deadline leaves. What is refused, and why:

- `DEADLINE_EXCEEDED`: less than `min_answer` of the caller's deadline is
  left, on arrival or when a slot frees. Even a degraded answer could not
  leave in time. Not an overload signal: an idle daemon says the same.
- `RESOURCE_EXHAUSTED` (`in_flight`): the hard caps of calls in flight and of
  their request bytes (a memory bound: calls waiting for a slot hold only
  their requests, retrieval runs in the slots). One call always fits the
  byte cap when nothing else is in flight.
- `RESOURCE_EXHAUSTED` (`queue`): a *standing* queue, CoDel's signal. The
  wait from arrival to the start of an assembly (the sojourn) is measured
  where it happens; the queue is standing once every sojourn for `interval`
  has stayed above `target` (a burst drains within an interval and never
  trips it). While it stands, a new call is refused at once if the expected
  wait would leave it less than `min_useful` of its deadline: the time
  retrieval and the pipeline need to produce an answer worth having. Calls
  with room (a 1 s deadline behind a closed loop of 32 callers) are queued,
  never refused.
- `RESOURCE_EXHAUSTED` (`cpu`): the loop is saturated and the calls already
  let in would not leave a new one time to finish. Once the loop is busy,
  admitted calls share it: each one's latency grows with every other one
  let in, and past a point all of them miss their deadlines together while
  no queue for a slot ever forms. By Little's law a saturated loop finishes a
  new call after about (calls ahead + 1) x CPU per finished call; the HEADERS
  gate (before grpclib spends a task on the call) refuses it when that
  exceeds its deadline less `wait_margin`. Calls waiting on a slow dependency
  hold no CPU, so the estimate is used only while the loop thread is busy at
  least `saturated` of the time, and a call whose branches are in flight
  counts as the part of an answer it has left (`retrieving_share`), not a
  whole one; and a call with less than `min_useful` left
  is never refused as overload (an idle daemon could not serve it either).

- `RESOURCE_EXHAUSTED` (`org`): the call's org already runs its limit of
  concurrent assemblies (`max_org_concurrent`, well below the slot count) and
  no slot of its own freed in time. One tenant's calls wait behind each
  other, never in front of another tenant's: the slot queue passes over a
  waiter whose org is at its limit.
- `RESOURCE_EXHAUSTED` (`threads`): the call's own text sends its pipeline to
  a worker thread (`Assembler.needs_thread`) and the thread queue is long: as
  many calls as `max_thread_queue` wait already, or the expected wait would
  leave the call less than `min_useful` of its deadline (for a call without
  a deadline: more than `max_queue_wait`), or no thread freed in time.

The refusals decided from a call's facts alone (the in-flight and byte caps,
`min_answer`, the CPU and standing-queue rules) are policy objects
(`ibex.service.policies`), asked in the order listed there; the waits for a
thread or a slot, with the `org` and `threads` refusals, stay here.

Calls without a deadline wait at most `max_queue_wait` for a thread or a slot
(then RESOURCE_EXHAUSTED), stand behind every call that has a deadline in
both queues, and are not counted as work ahead of one by the gates below:
they can wait, and never make a call with a deadline miss it.

A refusal costs a fraction of an answer (most of it h2 parsing the call's
frames); a call that cannot be served in time would
cost a whole answer's CPU and delay every admitted call behind it. The event
loop's timer lateness is not used: bursts, a GC, one big call or another
process on the core all raise it, and shedding on it refused calls that
would have made their deadlines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Hashable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import NoReturn

from ibex.errors import DeadlineError, IbexError, Overloaded, Unavailable
from ibex.ops.metrics import Metrics
from ibex.service.admission_config import AdmissionConfig as AdmissionConfig
from ibex.service.budgets import Reservation, Shares, UnauthenticatedBytes
from ibex.service.edge.deadline import CallDeadline
from ibex.service.load import CpuLoad, QueueDelay
from ibex.service.policies import (
    GATE_CPU_MESSAGE as GATE_CPU_MESSAGE,  # re-exported: the gate's messages
)
from ibex.service.policies import (
    GATE_QUEUE_MESSAGE as GATE_QUEUE_MESSAGE,
)
from ibex.service.policies import (
    AdmissionPolicy,
    CallFacts,
    Refusal,
    Stage,
    default_policies,
)
from ibex.service.queues import TIMED, UNTIMED, FairQueue, WorkerThreads


class Ticket:
    """One admitted call and its deadline (`CallDeadline`: arrival and due time, monotonic)."""

    __slots__ = ("deadline", "started")

    def __init__(self, deadline: CallDeadline) -> None:
        self.deadline = deadline
        self.started = False

    @property
    def arrived(self) -> float:
        """When the call's HEADERS were read: the start of its sojourn."""
        return self.deadline.arrived

    @property
    def timed(self) -> bool:
        """The caller set a deadline."""
        return self.deadline.at is not None

    @property
    def line(self) -> int:
        """The queue line the call waits in: with a deadline, or behind them without one."""
        return TIMED if self.timed else UNTIMED

    def remaining(self, now: float) -> float | None:
        return self.deadline.remaining(now)


class Admission:
    """Counts calls in flight (feeding the gauge) and decides which are served.

    The refusals decided from a call's facts are `policies` (see `ibex.service.policies`),
    asked in order at each checkpoint; the first refusal wins. Without `policies`,
    `default_policies(config)`.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        metrics: Metrics,
        policies: Sequence[AdmissionPolicy] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.pending = 0  # arrived, not yet assembling
        self.gated = 0  # passed the HEADERS gate, handler not yet started
        self.untimed = 0  # in flight without a deadline: never work ahead of one with a deadline
        self.thread_waiting = 0  # in flight, queued for a worker thread (no slot, no CPU)
        self.retrieving = 0  # in flight with a deadline, waiting on its retrieval branches
        self.cpu = CpuLoad()
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.queue = QueueDelay(config.queue_target, config.queue_interval)
        self.slots = FairQueue(config.max_concurrent, per_key=config.max_org_concurrent)
        self.policies = tuple(default_policies(config) if policies is None else policies)
        # Each checkpoint's policies, in order, picked once: the gate's loop is per call.
        at: dict[Stage, tuple[AdmissionPolicy, ...]] = {
            stage: tuple(p for p in self.policies if stage in p.stages)
            for stage in ("open", "bytes", "headers", "arrival")
        }
        self._open, self._bytes = at["open"], at["bytes"]
        self._headers, self._arrival = at["headers"], at["arrival"]
        self._facts = CallFacts("open")  # refilled for every question (no allocation)
        self.shares = Shares(config.max_caller_bytes)  # per connection and per caller
        self.unauthenticated = UnauthenticatedBytes(config.max_unauthenticated_bytes, metrics.shed)

    def _ask(
        self,
        policies: tuple[AdmissionPolicy, ...],
        stage: Stage,
        remaining: float | None,
        size: int,
        now: float,
        own: int = 0,
    ) -> None:
        """Raise the first refusal of `policies` (handler side)."""
        facts = self._facts
        facts.stage = stage
        facts.method = ""
        facts.remaining = remaining
        facts.size = size
        facts.own = own
        for policy in policies:
            refusal = policy.verdict(facts, self, now)
            if refusal is not None:
                raise self._error(refusal)

    def _error(self, refusal: Refusal) -> IbexError:
        if refusal.status == "RESOURCE_EXHAUSTED":
            self.metrics.shed(refusal.reason)
            return Overloaded(refusal.reason, refusal.message)
        if refusal.status == "DEADLINE_EXCEEDED":
            return DeadlineError(refusal.message)
        return Unavailable(refusal.message)

    def check_open(self, now: float | None = None) -> None:
        """Before the request is read: refuse at once while draining or at the hard cap."""
        if self.draining:
            raise Unavailable("server is draining; retry elsewhere")
        if self._open:
            self._ask(self._open, "open", None, 0, time.monotonic() if now is None else now)

    def gate(self, method: str, remaining: float | None) -> str | None:
        """Asked as a call's HEADERS arrive, before any per-call work (`protocol`).

        `method` is the short method name, or one label for anything unknown (it is a
        metrics label: a caller's path must not make new ones). None admits the call
        past the gate (counted in `gated` until `left_gate`). The refusal messages are
        constant: HPACK then sends each as an index into its table, not a new string.
        """
        facts = self._facts
        facts.stage = "headers"  # one store each: a tuple assignment would build a tuple
        facts.method = method
        facts.remaining = remaining
        facts.size = 0
        now = time.monotonic()
        for policy in self._headers:
            refusal = policy.verdict(facts, self, now)
            if refusal is not None:
                self.metrics.shed(refusal.reason)
                self.metrics.observe_request(method, "RESOURCE_EXHAUSTED", 0.0)
                return refusal.message
        self.gated += 1
        return None

    def left_gate(self) -> None:
        """A call that passed the gate has started its handler (or ended without one)."""
        self.gated -= 1

    def reserve_bytes(self, size: int, own: int = 0) -> None:
        """Count `size` request bytes in flight before they are buffered; refuse them
        (RESOURCE_EXHAUSTED) over the byte cap. One message always fits when nothing else
        is in flight (`own`: what the same message holds already). Pair with `release_bytes`."""
        self._ask(self._bytes, "bytes", None, size, time.monotonic(), own)
        self.in_flight_bytes += size

    def reservation(self, connection: Hashable, caller: str = "") -> Reservation:
        """A request's bytes, counted against the process cap, `connection`'s share and,
        with a `caller` (an authenticated identity), that caller's share
        (`ibex.service.budgets`). Grow it before each part is read; release it once."""
        shares = self.shares
        keys: tuple[tuple[str, Hashable], ...] = (("connection", connection),)
        if caller:
            keys += (("caller", caller),)

        def grow(r: Reservation, size: int) -> None:
            for key in keys:
                if shares.over(key, r.held, size) is not None:
                    whose = "connection" if key[0] == "connection" else "caller"
                    self._shed(
                        "in_flight",
                        f"overloaded: this {whose} holds its share of "
                        f"{shares.limit} request bytes in flight",
                    )
            self.reserve_bytes(size, r.held)
            for key in keys:
                shares.add(key, size)

        def release(r: Reservation) -> None:
            self.release_bytes(r.held)
            for key in keys:
                shares.add(key, -r.held)

        return Reservation(grow, release)

    def release_bytes(self, size: int) -> None:
        self.in_flight_bytes -= size

    @contextmanager
    def admitted(self, deadline: CallDeadline, size: int = 0) -> Iterator[Ticket]:
        """The request has arrived: count it in flight until it ends; refuse what cannot fit.

        `deadline` is when the call reached the process, the start of its sojourn, and
        when it is due; `size` the request message's bytes, unless `reserve_bytes`
        counted them already.
        """
        now = time.monotonic()
        self.check_open(now)
        remaining = deadline.remaining(now)
        self._ask(self._arrival, "arrival", remaining, size, now)
        self.in_flight += 1
        self.in_flight_bytes += size
        self.pending += 1
        self.untimed += remaining is None
        self.idle.clear()
        ticket = Ticket(deadline)
        try:
            with self.metrics.in_flight():
                yield ticket
        finally:
            if not ticket.started:  # refused or failed before its assembly began
                self.pending -= 1
            self.in_flight -= 1
            self.in_flight_bytes -= size
            self.untimed -= remaining is None
            self.cpu.finished(time.monotonic())
            if self.in_flight == 0:
                self.idle.set()

    @contextmanager
    def retrieving_for(self, ticket: Ticket) -> Iterator[None]:
        """Around a call's retrieval: while its branches are in flight it holds no CPU and
        has only part of an answer's work left, which the CPU gate counts (`retrieving_share`).

        Without this, calls parked on a slow dependency (a hung cold endpoint keeps every
        call until its wall) read as a full answer of CPU each, and the gate refused
        servable calls on a loop with room to spare.
        """
        timed = ticket.timed
        self.retrieving += timed
        try:
            yield
        finally:
            self.retrieving -= timed

    def _wait_limit(self, ticket: Ticket, now: float) -> float:
        """How long the call may wait in a queue: until `min_answer` before its deadline,
        or `max_queue_wait` without one."""
        remaining = ticket.remaining(now)
        if remaining is None:
            return self.config.max_queue_wait
        return remaining - self.config.min_answer

    @asynccontextmanager
    async def slot(
        self, ticket: Ticket, org: str = "", threads: WorkerThreads | None = None
    ) -> AsyncIterator[bool]:
        """Trio side: wait for an assembly slot within the deadline, then hold it.

        With `threads` (the call's own text sends its pipeline to a worker thread),
        the call first queues for a thread, then takes its slot, and holds both to
        the end; it yields True when it holds a thread unit. Queue first, then the
        slot: a call holding a slot while it waits for one of the few threads keeps
        a slot from every call that needs no thread, and a burst of large calls
        then holds all of them. Queued before its slot, a large call holds only its
        request (retrieval runs in the slots, so the memory bound stays), and the
        slots stay with calls that can run. The thread idles during the call's
        retrieval: that is the price of not holding a slot idle for much longer.

        `org` is the call's fairness key (`Caller.fairness_key`): its org, or the whole
        org scope of a caller whose token is bound to orgs, so a bound caller naming
        other org ids shares one limit. A key runs at most `max_org_concurrent`
        assemblies at once. The slot sojourn (from arrival, or from getting its
        thread, to the slot; crossing included) feeds the queue detector, except for
        calls without a deadline and calls held back by their own key's limit: their
        waits say nothing about the queue a call with a deadline would face.
        """
        if ticket.started:
            raise RuntimeError("a ticket takes one slot")
        ticket.started = True
        self.pending -= 1
        async with AsyncExitStack() as stack:
            since = ticket.arrived
            if threads is not None:
                await self._thread(ticket, threads)
                stack.callback(threads.queue.release)
                since = time.monotonic()
            line = ticket.line
            capped = self.slots.key_full(org)
            if not self.slots.try_acquire(org):
                acquired = await self.slots.acquire(
                    org, line, self._wait_limit(ticket, time.monotonic())
                )
                if not acquired:
                    self._no_slot(ticket, org)
            stack.callback(self.slots.release, org)
            if line != UNTIMED and not capped:
                now = time.monotonic()
                self.queue.observe(now - since, now)
            yield threads is not None

    async def _thread(self, ticket: Ticket, threads: WorkerThreads) -> None:
        """Queue for a worker thread, or refuse when that queue is too long for the call."""
        line = ticket.line
        remaining = ticket.remaining(time.monotonic())
        expected = threads.expected_wait(line)
        waiting = threads.queue.waiting()
        if waiting >= self.config.max_thread_queue:
            self._shed("threads", f"overloaded: {waiting} calls already wait for a worker thread")
        if remaining is None and expected > self.config.max_queue_wait:
            self._shed(
                "threads",
                f"overloaded: about {expected * 1000:.0f}ms of worker-thread queue, over the "
                f"{self.config.max_queue_wait * 1000:.0f}ms a call without a deadline waits",
            )
        useful = self.config.min_useful
        if remaining is not None and expected > 0 and useful <= remaining < expected + useful:
            # A call with less than min_useful left is never refused as overload: an idle
            # daemon could not serve it usefully either (it waits and gets its answer or
            # DEADLINE_EXCEEDED).
            self._shed(
                "threads",
                f"overloaded: about {expected * 1000:.0f}ms of worker-thread queue "
                f"before a call with {remaining * 1000:.0f}ms left",
            )
        self.thread_waiting += 1
        try:
            acquired = await threads.queue.acquire(
                "", line, self._wait_limit(ticket, time.monotonic())
            )
        finally:
            self.thread_waiting -= 1
        if not acquired:
            if remaining is not None and remaining < useful:
                raise DeadlineError("no worker thread free within the deadline")
            self._shed("threads", "overloaded: no worker thread free within the call's wait")

    def _no_slot(self, ticket: Ticket, org: str) -> NoReturn:
        """The wait for a slot ended empty: say why (never naming another tenant)."""
        if self.slots.key_full(org):
            self._shed(
                "org",
                "overloaded: this org already runs its limit of "
                f"{self.config.max_org_concurrent} concurrent assemblies",
            )
        if not ticket.timed:
            self._shed(
                "queue",
                "overloaded: no assembly slot within the "
                f"{self.config.max_queue_wait * 1000:.0f}ms a call without a deadline waits",
            )
        if self.queue.standing:
            self._shed("queue", "overloaded: no assembly slot within the deadline")
        raise DeadlineError("no assembly slot free within the deadline")

    def _shed(self, reason: str, message: str) -> NoReturn:
        self.metrics.shed(reason)
        raise Overloaded(reason, message)
