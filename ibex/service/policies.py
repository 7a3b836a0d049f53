"""Admission policies: each rule that refuses a call from its facts is one small object.

`Admission` asks its policies at each checkpoint of a call, in order; the
first refusal wins. The policies only decide: `Admission` owns the counters
they read, the metrics and the refusal itself (an error raised in the
handler, or a trailers-only answer at HEADERS). A new rule is a class with
`stages` and `verdict`, put into the tuple the composition root hands to
`Admission` (`default_policies` builds today's from `AdmissionConfig`).

The checkpoints (`Stage`), in the order a call meets them:

- "headers": the HEADERS gate (`Admission.gate`), before grpclib spends a task
  on the call. `method` is known, no request bytes are. It runs for every
  call, so a policy here allocates nothing when it admits, and refuses with a
  constant `Refusal` (HPACK then sends the message as an index). The answer
  is RESOURCE_EXHAUSTED whatever `status` says: the HEADERS path writes only
  that status; a rule that needs another one decides at "open".
- "open": before the request is read, and again when it has arrived
  (`Admission.check_open`; draining is checked first and is no policy).
- "bytes": a part of a request message, before it is read (`Admission.reserve_bytes`);
  `own` is what the same message holds already.
- "arrival": the request has arrived (`Admission.admitted`); `size` is its
  bytes unless "bytes" counted them already (then 0).

Waiting is not a verdict: the slot and worker-thread queues, the per-org
limit among them, stay in `Admission.slot`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    from ibex.service.admission import Admission, AdmissionConfig

Stage = Literal["open", "bytes", "headers", "arrival"]
RefusalStatus = Literal["RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"]

GATE_CPU_MESSAGE = "overloaded: the calls in flight leave this one too little time"
GATE_QUEUE_MESSAGE = "overloaded: a standing queue leaves this call too little time"


@dataclass(slots=True, eq=False)
class CallFacts:
    """What is known of one call at a checkpoint.

    `Admission` fills one instance for every question (no allocation per call):
    read it during `verdict`, never keep it.
    """

    stage: Stage
    method: str = ""  # the short method label at "headers", else ""
    remaining: float | None = None  # seconds of the caller's deadline left; None without one
    size: int = 0  # request bytes this checkpoint adds to the in-flight bytes
    # At "bytes": what the same request holds already (it grows by parts).
    own: int = field(default=0, init=False)


class Refusal(NamedTuple):
    """A policy's no. `reason` labels the shed counter (RESOURCE_EXHAUSTED only)."""

    reason: str
    status: RefusalStatus
    message: str


class AdmissionPolicy(Protocol):
    """One admission rule. `load` is the admission state it may read, never change."""

    @property
    def stages(self) -> frozenset[Stage]:
        """The checkpoints where `verdict` is asked."""
        ...

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        """None admits the call past this rule; `now` is `time.monotonic()`."""
        ...


_RE: RefusalStatus = "RESOURCE_EXHAUSTED"
CPU_REFUSAL = Refusal("cpu", _RE, GATE_CPU_MESSAGE)
QUEUE_REFUSAL = Refusal("queue", _RE, GATE_QUEUE_MESSAGE)


@dataclass(frozen=True, slots=True)
class InFlightCap:
    """The hard cap of calls in flight."""

    stages: ClassVar[frozenset[Stage]] = frozenset(("open",))

    max_in_flight: int

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        if load.in_flight >= self.max_in_flight:
            return Refusal("in_flight", _RE, f"overloaded: {load.in_flight} requests in flight")
        return None


@dataclass(frozen=True, slots=True)
class BytesCap:
    """The cap of request bytes in flight: a memory bound (calls waiting for a slot hold
    only their requests). One message always fits when nothing else is in flight (the
    parts of the message asking count as its own, not as something else)."""

    stages: ClassVar[frozenset[Stage]] = frozenset(("bytes", "arrival"))

    max_in_flight_bytes: int

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        size = call.size
        if not size and call.stage == "arrival":  # counted already, at its length prefix
            return None
        held = load.in_flight_bytes
        if held - call.own > 0 and held + size > self.max_in_flight_bytes:
            return Refusal(
                "in_flight", _RE, f"overloaded: {held} request bytes in flight, {size} more"
            )
        return None


@dataclass(frozen=True, slots=True)
class MinAnswer:
    """Less than `min_answer` left: even a degraded answer could not leave in time.
    Not an overload signal: an idle daemon says the same."""

    stages: ClassVar[frozenset[Stage]] = frozenset(("arrival",))

    min_answer: float

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        remaining = call.remaining
        if remaining is not None and remaining < self.min_answer:
            return Refusal(
                "",
                "DEADLINE_EXCEEDED",
                f"{max(0.0, remaining) * 1000:.1f}ms of the deadline left: too little to answer in",
            )
        return None


@dataclass(frozen=True, slots=True)
class CpuSaturation:
    """A saturated loop could not finish the call in time (Little's law, see `admission`).

    Calls an idle daemon could not serve usefully either (less than `min_useful`
    left) are not refused here: they get their degraded answer or
    DEADLINE_EXCEEDED downstream, never an overload status.
    """

    stages: ClassVar[frozenset[Stage]] = frozenset(("headers",))

    min_useful: float
    saturated: float
    wait_margin: float
    retrieving_share: float = 1.0

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        remaining = call.remaining
        if remaining is None or remaining < self.min_useful:
            return None
        load.cpu.sample(now)
        # Calls without a deadline and calls parked in the thread queue are not ahead of
        # a new call: both are served after it, or paced by the threads, not the loop. A
        # call waiting on its branches counts for the share of an answer it has left.
        retrieving = max(0, load.retrieving)
        working = load.in_flight - load.untimed - load.thread_waiting - retrieving
        ahead = max(0, load.gated) + max(0, working) + self.retrieving_share * retrieving
        if load.cpu.latency(ahead, self.saturated) > remaining - self.wait_margin:
            return CPU_REFUSAL
        return None


@dataclass(frozen=True, slots=True)
class StandingQueue:
    """While the queue stands and calls wait in front, refuse a call the expected wait
    would leave less than `min_useful` of its deadline."""

    stages: ClassVar[frozenset[Stage]] = frozenset(("headers", "arrival"))

    min_useful: float

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        remaining = call.remaining
        queue = load.queue
        if (
            remaining is None
            or not queue.standing
            or load.pending <= 0
            or remaining - queue.estimate >= self.min_useful
        ):
            return None
        if call.stage == "headers":
            return QUEUE_REFUSAL
        return Refusal(
            "queue",
            _RE,
            f"overloaded: about {queue.estimate * 1000:.0f}ms of queue "
            f"before a call with {remaining * 1000:.0f}ms left",
        )


def default_policies(config: AdmissionConfig) -> tuple[AdmissionPolicy, ...]:
    """The daemon's rules, in the order they are asked at every checkpoint."""
    return (
        InFlightCap(config.max_in_flight),
        BytesCap(config.max_in_flight_bytes),
        MinAnswer(config.min_answer),
        CpuSaturation(
            config.min_useful, config.saturated, config.wait_margin, config.retrieving_share
        ),
        StandingQueue(config.min_useful),
    )
