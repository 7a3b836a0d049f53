"""Admission policies (ibex.service.policies): swappable rules the gate composes in order."""

from __future__ import annotations

import time

import pytest

from ibex.errors import DeadlineError, Overloaded, Unavailable
from ibex.ops.metrics import Metrics
from ibex.service.admission import GATE_CPU_MESSAGE, Admission, AdmissionConfig
from ibex.service.edge.deadline import CallDeadline
from ibex.service.policies import (
    QUEUE_REFUSAL,
    BytesCap,
    CallFacts,
    CpuSaturation,
    InFlightCap,
    MinAnswer,
    Refusal,
    Stage,
    StandingQueue,
    default_policies,
)

MAINTENANCE_MESSAGE = "unavailable: SearchMemories is down for maintenance"


class Maintenance:
    """Test-only policy: refuse one method at the HEADERS gate while a flag is set."""

    stages: frozenset[Stage] = frozenset(("headers",))

    def __init__(self, method: str) -> None:
        self.method = method
        self.on = False
        self.asked = 0

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        self.asked += 1
        if self.on and call.method == self.method:
            return Refusal("maintenance", "RESOURCE_EXHAUSTED", MAINTENANCE_MESSAGE)
        return None


class Closed:
    """Test-only policy: refuse every call before its request is read, as UNAVAILABLE."""

    stages: frozenset[Stage] = frozenset(("open",))

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        return Refusal("", "UNAVAILABLE", "closed for the test")


def shed(a: Admission, reason: str) -> float:
    return a.metrics.shed_requests.labels(reason)._value.get()


def _saturated(a: Admission, per_call: float) -> None:
    a.cpu.utilisation, a.cpu.per_call = 1.0, per_call
    a.cpu.sample = lambda now: None  # type: ignore[method-assign]  # keep the state set here


def test_the_defaults_are_todays_rules_in_todays_order() -> None:
    config = AdmissionConfig()
    kinds = [type(p) for p in default_policies(config)]
    assert kinds == [InFlightCap, BytesCap, MinAnswer, CpuSaturation, StandingQueue]
    assert [type(p) for p in Admission(config, Metrics()).policies] == kinds


def test_a_test_only_policy_composes_with_the_defaults_at_the_gate() -> None:
    """Added in front of the defaults: it refuses its method while on, with its own label
    and message; other methods, and all calls while it is off, meet the defaults as before."""
    config = AdmissionConfig(max_in_flight=64, wait_margin=0.005)
    maintenance = Maintenance("SearchMemories")
    a = Admission(config, Metrics(), (maintenance, *default_policies(config)))
    assert a.gate("SearchMemories", 1.0) is None  # off: admitted
    maintenance.on = True
    assert a.gate("SearchMemories", 1.0) == MAINTENANCE_MESSAGE
    assert a.gate("SearchMemories", None) == MAINTENANCE_MESSAGE  # no deadline: still refused
    assert a.gate("AssembleContext", 1.0) is None
    assert a.gated == 2  # refused calls are not counted as let through
    assert shed(a, "maintenance") == 2
    assert a.metrics.requests.labels("SearchMemories", "RESOURCE_EXHAUSTED")._value.get() == 2
    # The defaults still apply behind it: a saturated loop refuses a short call for CPU.
    _saturated(a, 0.004)
    a.in_flight = 20
    assert a.gate("AssembleContext", 0.045) == GATE_CPU_MESSAGE
    assert shed(a, "cpu") == 1


def test_the_first_refusal_wins() -> None:
    """Behind the defaults, the CPU rule answers first; the test policy is not even asked."""
    config = AdmissionConfig(max_in_flight=64, wait_margin=0.005)
    maintenance = Maintenance("AssembleContext")
    maintenance.on = True
    a = Admission(config, Metrics(), (*default_policies(config), maintenance))
    _saturated(a, 0.004)
    a.in_flight = 20
    assert a.gate("AssembleContext", 0.045) == GATE_CPU_MESSAGE
    assert maintenance.asked == 0
    assert shed(a, "cpu") == 1 and shed(a, "maintenance") == 0
    assert a.gate("AssembleContext", 1.0) == MAINTENANCE_MESSAGE  # room: the CPU rule passes


def test_a_policy_is_asked_only_at_its_own_checkpoints() -> None:
    """The maintenance policy decides at HEADERS only: a call reaching the handler (an
    in-process call, no gate) is not refused by it."""
    maintenance = Maintenance("")
    maintenance.on = True
    a = Admission(AdmissionConfig(), Metrics(), (maintenance,))
    a.check_open()
    a.reserve_bytes(10)
    with a.admitted(CallDeadline.after(1.0)):
        pass
    assert maintenance.asked == 0
    assert a.gate("", 1.0) == MAINTENANCE_MESSAGE


def test_a_refusal_status_other_than_overload_raises_its_own_error_unshed() -> None:
    a = Admission(AdmissionConfig(), Metrics(), (Closed(), *default_policies(AdmissionConfig())))
    with pytest.raises(Unavailable, match="closed for the test"):
        a.check_open()
    with pytest.raises(Unavailable), a.admitted(CallDeadline.after(1.0)):
        pass
    assert a.in_flight == 0
    assert a.gate("AssembleContext", 1.0) is None  # asked at "open" only


def test_without_the_cap_policy_nothing_caps_the_calls_in_flight() -> None:
    """The cap is the policy, not a rule hidden in the gate: a tuple without it admits
    past `max_in_flight`; with the defaults the same call is refused."""
    config = AdmissionConfig(max_in_flight=1)
    bare = Admission(config, Metrics(), ())
    with bare.admitted(CallDeadline.after(1.0)), bare.admitted(CallDeadline.after(1.0)):
        assert bare.in_flight == 2
    full = Admission(config, Metrics())
    with (
        full.admitted(CallDeadline.after(1.0)),
        pytest.raises(Overloaded) as info,
        full.admitted(CallDeadline.after(1.0)),
    ):
        pass
    assert info.value.reason == "in_flight"


class Recorder:
    """Test-only policy: asked everywhere, admits, and notes the facts it was shown."""

    stages: frozenset[Stage] = frozenset(("open", "bytes", "headers", "arrival"))

    def __init__(self) -> None:
        self.seen: list[tuple[Stage, str, float | None, int]] = []
        self.times: list[float] = []

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        self.seen.append((call.stage, call.method, call.remaining, call.size))
        self.times.append(now)
        return None


def test_each_checkpoint_shows_a_policy_the_facts_it_documents() -> None:
    """ibex.service.policies: `method` only at "headers", `size` the bytes this checkpoint
    adds (0 at "headers"), `remaining` from the caller, `now` the monotonic clock."""
    recorder = Recorder()
    a = Admission(AdmissionConfig(), Metrics(), (recorder,))
    before = time.monotonic()
    assert a.gate("AssembleContext", 0.5) is None
    a.check_open()
    a.reserve_bytes(300)
    deadline = CallDeadline.after(0.25)
    with a.admitted(deadline, size=40):
        pass
    assert recorder.seen == [
        ("headers", "AssembleContext", 0.5, 0),
        ("open", "", None, 0),
        ("bytes", "", None, 300),
        ("open", "", None, 0),  # admitted asks "open" again
        ("arrival", "", deadline.remaining(recorder.times[4]), 40),  # left at its `now`
    ]
    assert all(before <= t <= time.monotonic() for t in recorder.times)


class TooLate:
    """Test-only policy: a deadline refusal on arrival."""

    stages: frozenset[Stage] = frozenset(("arrival",))

    def verdict(self, call: CallFacts, load: Admission, now: float) -> Refusal | None:
        return Refusal("", "DEADLINE_EXCEEDED", "too late for the test")


def test_a_deadline_refusal_carries_the_policys_message() -> None:
    a = Admission(AdmissionConfig(), Metrics(), (TooLate(),))
    with pytest.raises(DeadlineError) as info, a.admitted(CallDeadline.after(1.0)):
        pass
    assert str(info.value) == "too late for the test"
    assert a.in_flight == 0


def test_call_facts_default_to_nothing_known() -> None:
    facts = CallFacts("open")
    assert (facts.stage, facts.method, facts.remaining, facts.size) == ("open", "", None, 0)


def test_min_answer_refuses_below_its_time_only_and_says_how_much_was_left() -> None:
    a = Admission(AdmissionConfig(), Metrics(), ())
    rule = MinAnswer(1.0)
    assert rule.verdict(CallFacts("arrival", remaining=1.0), a, 0.0) is None  # exactly enough
    assert rule.verdict(CallFacts("arrival", remaining=None), a, 0.0) is None
    assert rule.verdict(CallFacts("arrival", remaining=0.9), a, 0.0) == Refusal(
        "", "DEADLINE_EXCEEDED", "900.0ms of the deadline left: too little to answer in"
    )
    assert rule.verdict(CallFacts("arrival", remaining=-0.5), a, 0.0) == Refusal(
        "", "DEADLINE_EXCEEDED", "0.0ms of the deadline left: too little to answer in"
    )


def test_the_standing_queue_rule_names_the_wait_and_the_time_left_in_the_handler() -> None:
    """At HEADERS the constant refusal (HPACK indexes it); in the handler the figures. No
    deadline, no standing queue or nobody waiting: never refused."""
    a = Admission(AdmissionConfig(), Metrics(), ())
    rule = StandingQueue(min_useful=0.25)
    a.queue.estimate, a.pending = 0.6, 1
    assert rule.verdict(CallFacts("arrival", remaining=0.7), a, 0.0) is None  # not standing
    a.queue.standing = True
    assert rule.verdict(CallFacts("arrival", remaining=None), a, 0.0) is None
    assert rule.verdict(CallFacts("headers", remaining=0.7), a, 0.0) == QUEUE_REFUSAL
    assert rule.verdict(CallFacts("arrival", remaining=0.7), a, 0.0) == Refusal(
        "queue",
        "RESOURCE_EXHAUSTED",
        "overloaded: about 600ms of queue before a call with 700ms left",
    )
    a.pending = 0
    assert rule.verdict(CallFacts("arrival", remaining=0.7), a, 0.0) is None


def test_the_bytes_cap_names_what_is_held_and_what_would_be_added() -> None:
    a = Admission(AdmissionConfig(), Metrics(), ())
    a.in_flight_bytes = 100
    assert BytesCap(120).verdict(CallFacts("bytes", size=50), a, 0.0) == Refusal(
        "in_flight", "RESOURCE_EXHAUSTED", "overloaded: 100 request bytes in flight, 50 more"
    )


def test_calls_parked_for_a_worker_thread_are_not_work_ahead_at_the_cpu_gate() -> None:
    """Three calls in flight, all waiting for a thread: a saturated loop has nothing ahead
    of a new call, which needs one call's CPU (10 ms) and has 19 ms after the margin."""
    config = AdmissionConfig(wait_margin=0.015, min_useful=0.020)
    a = Admission(config, Metrics(), ())
    _saturated(a, 0.010)
    a.in_flight = a.thread_waiting = 3
    rule = CpuSaturation(config.min_useful, config.saturated, config.wait_margin)
    assert rule.verdict(CallFacts("headers", remaining=0.034), a, time.monotonic()) is None
    a.thread_waiting = 2  # one of them runs: it is ahead, and two calls' CPU do not fit
    assert rule.verdict(CallFacts("headers", remaining=0.034), a, time.monotonic()) is not None


def test_without_a_share_given_a_call_waiting_on_its_branches_counts_as_a_whole_answer() -> None:
    """CpuSaturation's own default (Admission passes its configured share): each call still
    retrieving is one call's CPU (10 ms) ahead of a new one, which has 25 ms after the margin."""
    config = AdmissionConfig(wait_margin=0.015, min_useful=0.020)
    a = Admission(config, Metrics(), ())
    _saturated(a, 0.010)
    rule = CpuSaturation(config.min_useful, config.saturated, config.wait_margin)
    a.in_flight = a.retrieving = 1  # 10 ms ahead, 10 ms its own: fits
    assert rule.verdict(CallFacts("headers", remaining=0.040), a, time.monotonic()) is None
    a.in_flight = a.retrieving = 2  # 20 ms ahead: does not
    assert rule.verdict(CallFacts("headers", remaining=0.040), a, time.monotonic()) is not None
