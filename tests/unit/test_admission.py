"""Admission by deadline (ibex.service.admission): what is served, what is refused, why."""

from __future__ import annotations

import contextlib
import re
import time

import pytest
import trio
import trio.testing

from ibex.errors import DeadlineError, Overloaded, Unavailable
from ibex.ops.metrics import Metrics
from ibex.service.admission import Admission, AdmissionConfig
from ibex.service.edge.deadline import CallDeadline
from ibex.service.handlers import METHODS, ContextService, method_label
from ibex.service.load import CpuLoad, QueueDelay
from ibex.service.policies import CallFacts, StandingQueue
from ibex.service.queues import WorkerThreads

CONFIG = AdmissionConfig(
    max_in_flight=4,
    max_concurrent=2,
    min_answer=0.002,
    min_useful=0.020,
    queue_target=0.005,
    queue_interval=0.100,
)


def admission(config: AdmissionConfig = CONFIG) -> Admission:
    return Admission(config, Metrics())


def shed(a: Admission, reason: str) -> float:
    return a.metrics.shed_requests.labels(reason)._value.get()


# -- the standing-queue detector ------------------------------------------------------------


def test_a_burst_shorter_than_the_interval_is_not_a_standing_queue() -> None:
    q = QueueDelay(target=0.005, interval=0.100)
    for i in range(9):  # 90 ms of sojourns far above target
        q.observe(0.050, now=i * 0.010)
    assert not q.standing
    q.observe(0.001, now=0.095)  # the queue drained once: the clock restarts
    q.observe(0.050, now=0.150)
    q.observe(0.050, now=0.240)
    assert not q.standing


def test_sojourns_above_target_for_a_whole_interval_make_a_standing_queue() -> None:
    q = QueueDelay(target=0.005, interval=0.100)
    q.observe(0.006, now=1.000)
    q.observe(0.006, now=1.099)
    assert not q.standing
    q.observe(0.006, now=1.100)
    assert q.standing
    q.observe(0.004, now=1.101)  # one sojourn under target ends it
    assert not q.standing


def test_the_wait_estimate_follows_the_sojourns() -> None:
    q = QueueDelay(target=0.005, interval=0.100)
    for i in range(50):
        q.observe(0.030, now=i * 0.01)
    assert q.estimate == pytest.approx(0.030, rel=0.01)


# -- refusals ---------------------------------------------------------------------------------


def test_too_little_deadline_is_deadline_exceeded_even_when_idle() -> None:
    a = admission()
    with pytest.raises(DeadlineError), a.admitted(CallDeadline.after(0.0019)):
        pass
    assert a.in_flight == 0 and a.pending == 0
    assert shed(a, "deadline") == 0 and shed(a, "queue") == 0
    with a.admitted(CallDeadline.after(0.0021)):  # just enough for a degraded answer: admitted
        assert a.in_flight == 1


def test_no_deadline_is_always_admitted_below_the_cap() -> None:
    a = admission()
    with a.admitted(CallDeadline.after(None)) as ticket:
        assert ticket.remaining(123.0) is None


def test_the_hard_cap_refuses_as_overload() -> None:
    a = admission()
    with (
        a.admitted(CallDeadline.after(1.0)),
        a.admitted(CallDeadline.after(1.0)),
        a.admitted(CallDeadline.after(1.0)),
        a.admitted(CallDeadline.after(1.0)),
    ):
        assert a.in_flight == 4
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(1.0)):
            pass
        assert info.value.reason == "in_flight" and info.value.status == "RESOURCE_EXHAUSTED"
    assert a.in_flight == 0 and a.idle.is_set()
    assert shed(a, "in_flight") == 1


def test_a_draining_daemon_is_unavailable() -> None:
    a = admission()
    a.draining = True
    with pytest.raises(Unavailable):
        a.check_open()


def _standing(a: Admission, wait: float) -> None:
    for i in range(30):
        a.queue.observe(wait, now=i * 0.01)
    assert a.queue.standing


def test_a_standing_queue_refuses_only_calls_it_would_leave_too_little_time() -> None:
    a = admission()
    _standing(a, 0.030)
    with a.admitted(CallDeadline.after(1.0)):  # queued behind the waiting call: 1 s leaves plenty
        assert a.pending == 1
        with a.admitted(CallDeadline.after(1.0)):
            pass
        # 45 ms - 30 ms of expected wait < 20 ms needed for a useful answer
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(0.045)):
            pass
        assert info.value.reason == "queue"
        with a.admitted(CallDeadline.after(0.060)):  # 30 ms left after the wait: served
            pass
    assert shed(a, "queue") == 1


def test_a_standing_estimate_with_nobody_waiting_refuses_nothing() -> None:
    """After a burst the estimate lingers; with no queue in front, nothing is refused."""
    a = admission()
    _standing(a, 0.030)
    with a.admitted(CallDeadline.after(0.045)):
        pass
    assert shed(a, "queue") == 0


# -- slots ------------------------------------------------------------------------------------


async def test_slots_bound_concurrent_assemblies_and_feed_the_detector() -> None:
    a = admission()
    running = 0
    peak = 0

    async def call() -> None:
        nonlocal running, peak
        with a.admitted(CallDeadline.after(2.0)) as ticket:
            async with a.slot(ticket):
                running += 1
                peak = max(peak, running)
                await trio.sleep(0.01)
                running -= 1

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(call)
    assert peak == 2  # max_concurrent
    assert a.in_flight == 0 and a.pending == 0
    assert a.queue.estimate > 0  # the later two waited for a slot


async def test_no_slot_within_the_deadline_is_deadline_exceeded_without_a_queue() -> None:
    a = admission(AdmissionConfig(max_in_flight=4, max_concurrent=1, min_answer=0.002))
    release = trio.Event()
    outcome: list[BaseException] = []

    async def holder() -> None:
        with a.admitted(CallDeadline.after(5.0)) as ticket:
            async with a.slot(ticket):
                await release.wait()

    async def late() -> None:
        try:
            with a.admitted(CallDeadline.after(0.050)) as ticket:
                async with a.slot(ticket):
                    pass
        except (DeadlineError, Overloaded) as exc:
            outcome.append(exc)
        release.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.sleep(0.01)
            nursery.start_soon(late)
    assert len(outcome) == 1 and isinstance(outcome[0], DeadlineError)
    assert a.in_flight == 0 and a.pending == 0


def test_the_sojourn_starts_when_the_call_arrived_not_when_its_handler_ran() -> None:
    """A call that waited 30 ms for its handler task has waited 30 ms: the ticket keeps
    the arrival, so the wait feeds the queue detector with it."""
    a = admission()
    arrived = time.monotonic() - 0.030
    with a.admitted(CallDeadline.after(1.0, arrived)) as ticket:
        assert ticket.arrived == arrived


# -- the CPU gate (HEADERS time) ----------------------------------------------------------------


class FakeCpu:
    """The loop thread's CPU clock, advanced by hand."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_cpu_load_measures_utilisation_and_cpu_per_finished_call() -> None:
    cpu = FakeCpu()
    load = CpuLoad(window=0.025, cpu_clock=cpu, now=0.0)
    t = 0.0
    for _ in range(20):  # 25 ms windows, the loop busy 100 %, 10 calls each: 2.5 ms per call
        cpu.seconds += 0.025
        for _ in range(9):
            load.finished(t)
        t += 0.025
        load.finished(t)
    assert load.utilisation == pytest.approx(1.0, abs=0.01)
    assert load.per_call == pytest.approx(0.0025, rel=0.05)
    # A second of idle loop: the next sample reads idle at once (one window's weight).
    load.sample(t + 1.0)
    assert load.utilisation < 0.55


def test_one_long_stretch_of_work_is_not_read_as_one_expensive_call() -> None:
    """100 ms of loop work (a GC, a burst of intake) and then one finished call: the
    CPU-per-call sample waits for enough calls, so it stays near what calls cost."""
    cpu = FakeCpu()
    load = CpuLoad(window=0.025, cpu_clock=cpu, now=0.0)
    t = 0.0
    for _ in range(10):  # steady: 2 ms per call
        for _ in range(8):
            cpu.seconds += 0.002
            t += 0.002
            load.finished(t)
    assert load.per_call == pytest.approx(0.002, rel=0.05)
    cpu.seconds += 0.100
    t += 0.100
    load.finished(t)  # the one call after the stall
    assert load.per_call == pytest.approx(0.002, rel=0.05)  # not 100 ms
    for _ in range(7):
        cpu.seconds += 0.002
        t += 0.002
        load.finished(t)
    assert load.per_call < 0.010  # (100 + 8 x 2) / 8 ms, halved by the smoothing


def test_windows_shorter_than_the_window_are_not_sampled() -> None:
    cpu = FakeCpu()
    load = CpuLoad(window=0.025, cpu_clock=cpu, now=0.0)
    cpu.seconds = 0.010
    load.finished(0.010)
    assert load.utilisation == 0.0 and load.per_call == 0.0


def _saturated(a: Admission, per_call: float) -> None:
    a.cpu.utilisation, a.cpu.per_call = 1.0, per_call
    a.cpu.sample = lambda now: None  # type: ignore[method-assign]  # keep the state set here


def test_a_saturated_loop_refuses_a_call_it_could_not_finish_in_time() -> None:
    """Little's law: behind n calls a saturated loop finishes a new one after (n+1) x CPU
    per call; refused when that passes the deadline less the margin (5 ms)."""
    a = admission(AdmissionConfig(max_in_flight=64, wait_margin=0.005))
    _saturated(a, 0.004)
    a.in_flight = 9  # (9 + 1) x 4 ms = 40 ms = 45 ms - 5 ms: still fits
    assert a.gate("/svc/AssembleContext", 0.045) is None
    assert a.gated == 1
    a.in_flight, a.gated = 5, 5  # calls let in and not started count as ahead too
    message = a.gate("/svc/AssembleContext", 0.045)
    assert message is not None and message.startswith("overloaded")
    assert a.gated == 5  # a refused call is not counted
    assert a.gate("/svc/AssembleContext", 1.0) is None  # a 1 s call has room
    assert a.gate("/svc/AssembleContext", None) is None  # no deadline: only the cap applies
    assert shed(a, "cpu") == 1


def test_the_cpu_gate_never_refuses_a_call_an_idle_daemon_could_not_serve_either() -> None:
    """Less than min_useful left: the call gets its degraded answer or DEADLINE_EXCEEDED
    downstream, never RESOURCE_EXHAUSTED."""
    a = admission(AdmissionConfig(max_in_flight=64, min_useful=0.020))
    _saturated(a, 0.004)
    a.in_flight = 60
    assert a.gate("/svc/AssembleContext", 0.005) is None
    assert a.gate("/svc/AssembleContext", 0.0199) is None
    assert a.gate("/svc/AssembleContext", 0.020) is not None
    assert shed(a, "cpu") == 1


def test_a_loop_that_is_not_saturated_refuses_nothing_for_cpu() -> None:
    """Calls waiting on a slow dependency hold no CPU: many in flight on a half-idle loop
    are no queue."""
    a = admission(AdmissionConfig(max_in_flight=64, saturated=0.5))
    _saturated(a, 0.004)
    a.cpu.utilisation = 0.45
    a.in_flight = 40
    assert a.gate("/svc/AssembleContext", 0.045) is None
    assert shed(a, "cpu") == 0


def test_left_gate_undoes_what_gate_counted() -> None:
    a = admission()
    assert a.gate("/svc/AssembleContext", 1.0) is None
    assert a.gate("/svc/AssembleContext", None) is None
    assert a.gated == 2
    a.left_gate()
    a.left_gate()
    assert a.gated == 0


def test_the_gate_labels_a_refusal_by_known_method_only() -> None:
    """The gate sees a caller's raw `:path`; as a metrics label it must not mint new series."""
    prefix = "/ibex.context.v1.ContextAssemblyService/"
    assert method_label(prefix + "AssembleContext") == "AssembleContext"
    assert method_label(prefix + "SearchMemories") == "SearchMemories"
    assert method_label(prefix + "Nope") == "other"
    assert method_label("/evil.Service/AssembleContext") == "other"
    assert method_label("/" + "x" * 10_000) == "other"
    # The known names are the service's own: every method it serves, nothing else.
    served = ContextService.__new__(ContextService).__mapping__()
    assert {method_label(path) for path in served} == METHODS


def test_request_bytes_in_flight_are_capped_but_one_call_always_fits() -> None:
    """Calls waiting for a slot hold their requests: their bytes are bounded too."""
    a = admission(AdmissionConfig(max_in_flight=64, max_in_flight_bytes=10_000))
    with a.admitted(CallDeadline.after(1.0), 50_000):  # alone: admitted whatever its size
        assert a.in_flight_bytes == 50_000
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(1.0), 1):
            pass
        assert info.value.reason == "in_flight"
    assert a.in_flight_bytes == 0
    with a.admitted(CallDeadline.after(1.0), 6_000), a.admitted(CallDeadline.after(1.0), 4_000):
        assert a.in_flight_bytes == 10_000
        with pytest.raises(Overloaded), a.admitted(CallDeadline.after(1.0), 1):
            pass
    assert a.in_flight_bytes == 0 and a.in_flight == 0
    assert shed(a, "in_flight") == 2


def test_declared_request_bytes_are_reserved_before_they_arrive_under_the_same_cap() -> None:
    """`reserve_bytes` counts a message from its length prefix; the call it belongs to is
    then admitted with size 0, also when its one message alone is over the cap."""
    a = admission(AdmissionConfig(max_in_flight=64, max_in_flight_bytes=10_000))
    a.reserve_bytes(50_000)  # alone: reserved whatever its size
    with a.admitted(CallDeadline.after(1.0)):  # its bytes are not counted a second time
        assert a.in_flight_bytes == 50_000
        with pytest.raises(Overloaded) as info:
            a.reserve_bytes(1)
        assert info.value.reason == "in_flight"
    a.release_bytes(50_000)
    a.reserve_bytes(6_000)
    a.reserve_bytes(4_000)  # exactly at the cap
    with pytest.raises(Overloaded), a.admitted(CallDeadline.after(1.0), 1):
        pass
    with pytest.raises(Overloaded):
        a.reserve_bytes(1)
    a.release_bytes(10_000)
    assert a.in_flight_bytes == 0 and a.in_flight == 0
    assert shed(a, "in_flight") == 3


# -- exact boundaries and what a refusal records ----------------------------------------------


def test_the_detector_starts_clear_and_a_sojourn_at_target_counts_as_above_it() -> None:
    """CoDel's rule: below target clears; at target for a whole interval is standing."""
    q = QueueDelay(target=0.5, interval=0.25)  # binary fractions: exact comparisons
    assert q.standing is False and q.estimate == 0.0
    q.observe(0.5, now=1.0)
    assert q.estimate == pytest.approx(0.2 * 0.5)  # the first sample, weighted from zero
    q.observe(0.5, now=1.25)  # exactly one interval at target
    assert q.standing is True
    q.observe(0.25, now=1.5)
    assert q.standing is False


def test_a_window_of_exactly_the_window_length_is_sampled_and_utilisation_is_capped() -> None:
    cpu = FakeCpu()
    load = CpuLoad(window=0.25, cpu_clock=cpu, now=0.0)
    cpu.seconds = 0.5  # more CPU than wall time (threads): utilisation still reads 1.0 at most
    load.sample(0.25)
    assert load.utilisation == pytest.approx(0.5 * 1.0)  # one window's weight of 100 %


def test_a_cpu_per_call_sample_is_taken_at_exactly_eight_calls_and_divides_by_them() -> None:
    cpu = FakeCpu()
    load = CpuLoad(window=0.25, cpu_clock=cpu, now=0.0)
    t = 0.0
    for _ in range(7):
        load.finished(t)
    cpu.seconds = 0.016
    load.finished(0.25)  # the eighth call, as the window ends: 16 ms over 8 calls
    assert load.per_call == pytest.approx(0.5 * 0.002)


def test_the_cpu_estimate_applies_from_exactly_the_saturation_threshold() -> None:
    load = CpuLoad(window=0.25, cpu_clock=FakeCpu(), now=0.0)
    load.utilisation, load.per_call = 0.5, 0.004
    assert load.latency(ahead=4, saturated=0.5) == pytest.approx(5 * 0.004)
    assert load.latency(ahead=4, saturated=0.75) == 0.0


def test_fresh_state_is_false_not_merely_falsy() -> None:
    a = admission()
    assert a.draining is False
    with a.admitted(CallDeadline.after(1.0)) as ticket:
        assert ticket.started is False


def test_refusals_say_why_in_their_messages() -> None:
    a = admission()
    a.draining = True
    with pytest.raises(Unavailable, match=r"^server is draining; retry elsewhere$"):
        a.check_open()
    a.draining = False
    a.in_flight = 4
    with pytest.raises(Overloaded, match=r"^overloaded: 4 requests in flight$"):
        a.check_open()


def test_a_queue_refusal_at_the_gate_is_labelled_queue_and_counted_as_a_request() -> None:
    """The gate's standing-queue refusal: `queue` on the shed counter, and one
    RESOURCE_EXHAUSTED request of the method that took no time."""
    a = admission()
    _standing(a, 0.030)
    a.pending = 1
    assert a.gate("AssembleContext", 1.0) is None  # room left after the wait
    message = a.gate("AssembleContext", 0.045)
    assert message is not None and message.startswith("overloaded")
    assert shed(a, "queue") == 1 and shed(a, "cpu") == 0
    assert a.metrics.requests.labels("AssembleContext", "RESOURCE_EXHAUSTED")._value.get() == 1
    duration = a.metrics.request_duration.labels("AssembleContext")
    assert duration._sum.get() == 0.0


def test_the_standing_queue_refuses_when_exactly_min_useful_would_be_left() -> None:
    """Refused only when less than `min_useful` would be left: exactly that is served."""
    a = admission(AdmissionConfig(max_in_flight=64, min_useful=0.25))
    a.queue.standing, a.queue.estimate, a.pending = True, 0.5, 1
    queue = StandingQueue(min_useful=0.25)
    assert queue.verdict(CallFacts("arrival", remaining=0.75), a, 0.0) is None  # 0.25: enough
    assert queue.verdict(CallFacts("arrival", remaining=0.625), a, 0.0) is not None


# -- fairness: per-org cap, calls without a deadline, the worker-thread queue -----------------

ORG_A, ORG_B = "org-a", "org-b"


def fair(**overrides: object) -> Admission:
    base = {"max_in_flight": 64, "max_concurrent": 4, "max_org_concurrent": 2}
    return admission(AdmissionConfig(**{**base, **overrides}))  # type: ignore[arg-type]


async def _hold(a: Admission, org: str, remaining: float | None, release: trio.Event) -> None:
    with a.admitted(CallDeadline.after(remaining)) as ticket:
        async with a.slot(ticket, org):
            await release.wait()


async def test_one_org_never_holds_every_slot_and_its_refusal_names_only_its_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair()
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(_hold, a, ORG_A, 5.0, release)
        await trio.sleep(0.001)
        assert a.slots.by_key == {ORG_A: 2} and a.slots.held == 2
        # Org A's third call waits for one of its own slots and is refused when none frees.
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(0.045)) as ticket:
            async with a.slot(ticket, ORG_A):
                pass
        assert info.value.reason == "org" and info.value.status == "RESOURCE_EXHAUSTED"
        assert "limit of 2 concurrent assemblies" in str(info.value)
        assert ORG_B not in str(info.value)
        # Org B still finds slots at once, although org A has a call waiting.
        with a.admitted(CallDeadline.after(0.045)) as ticket:
            async with a.slot(ticket, ORG_B):
                assert a.slots.by_key == {ORG_A: 2, ORG_B: 1}
        release.set()
    assert shed(a, "org") == 1 and a.slots.held == 0 and a.in_flight == 0
    # The org's wait says nothing about the queue a call with a deadline faces.
    assert not a.queue.standing


async def test_a_call_of_a_capped_org_gets_its_slot_when_one_of_its_own_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair()
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(_hold, a, ORG_A, 5.0, release)
        await trio.sleep(0.001)

        async def third() -> None:
            with a.admitted(CallDeadline.after(5.0)) as ticket:
                async with a.slot(ticket, ORG_A):
                    assert a.slots.by_key[ORG_A] <= 2

        nursery.start_soon(third)
        await trio.sleep(1.0)
        assert a.slots.waiting() == 1
        release.set()
    assert a.slots.held == 0 and shed(a, "org") == 0


async def test_calls_without_a_deadline_wait_behind_calls_with_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair(max_concurrent=1, max_org_concurrent=1)
    release = trio.Event()
    order: list[str] = []

    async def call(name: str, org: str, remaining: float | None) -> None:
        with a.admitted(CallDeadline.after(remaining)) as ticket:
            async with a.slot(ticket, org):
                order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold, a, ORG_A, 5.0, release)
        await trio.sleep(0.001)
        nursery.start_soon(call, "untimed", ORG_B, None)
        await trio.sleep(0.001)
        nursery.start_soon(call, "timed", "org-c", 5.0)
        await trio.sleep(0.001)
        assert a.untimed == 1
        release.set()
    assert order == ["timed", "untimed"]
    assert a.untimed == 0


async def test_a_call_without_a_deadline_waits_at_most_max_queue_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair(max_concurrent=1, max_queue_wait=0.5)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold, a, ORG_A, 50.0, release)
        await trio.sleep(0.001)
        t0 = trio.current_time()
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(None)) as ticket:
            async with a.slot(ticket, ORG_B):
                pass
        assert trio.current_time() - t0 == pytest.approx(0.5)
        assert info.value.reason == "queue" and "without a deadline" in str(info.value)
        release.set()
    assert not a.queue.standing  # its long wait is no standing queue for calls with deadlines


def test_calls_without_a_deadline_are_not_work_ahead_at_the_cpu_gate() -> None:
    a = admission(AdmissionConfig(max_in_flight=64, wait_margin=0.005))
    _saturated(a, 0.004)
    with contextlib.ExitStack() as stack:
        for _ in range(20):  # 20 untimed calls in flight: 21 x 4 ms would be 84 ms
            stack.enter_context(a.admitted(CallDeadline.after(None)))
        assert a.gate("/svc/AssembleContext", 0.045) is None
        a.left_gate()
        stack.enter_context(a.admitted(CallDeadline.after(1.0)))
        for _ in range(10):  # 10 calls with deadlines are work ahead: 11 x 4 ms > 40 ms
            stack.enter_context(a.admitted(CallDeadline.after(1.0)))
        assert a.gate("/svc/AssembleContext", 0.045) is not None
    assert a.untimed == 0


def test_calls_waiting_on_their_branches_count_for_their_share_of_an_answer() -> None:
    """A call whose branches are in flight has only `retrieving_share` of an answer's CPU
    left: 16 of them parked on a hung endpoint are 16 x 0.5 = 8 answers of work, not 16."""
    a = admission(AdmissionConfig(max_in_flight=64, wait_margin=0.005, retrieving_share=0.5))
    _saturated(a, 0.004)
    with contextlib.ExitStack() as stack:
        tickets = [stack.enter_context(a.admitted(CallDeadline.after(1.0))) for _ in range(16)]
        # As working calls: (16 + 1) x 4 ms = 68 ms > 40 ms, refused.
        assert a.gate("/svc/AssembleContext", 0.045) is not None
        for ticket in tickets:
            stack.enter_context(a.retrieving_for(ticket))
        assert a.retrieving == 16
        # Parked: (16 x 0.5 + 1) x 4 ms = 36 ms <= 40 ms, admitted.
        assert a.gate("/svc/AssembleContext", 0.045) is None
        a.left_gate()
        # Two more working calls: (2 + 8 + 1) x 4 ms = 44 ms > 40 ms, refused again.
        for _ in range(2):
            stack.enter_context(a.admitted(CallDeadline.after(1.0)))
        assert a.gate("/svc/AssembleContext", 0.045) is not None
    assert a.retrieving == 0 and a.in_flight == 0


def test_an_untimed_call_waiting_on_its_branches_is_not_counted_as_retrieving() -> None:
    """Calls without a deadline are never work ahead (see above), retrieving or not."""
    a = admission(AdmissionConfig(max_in_flight=64, wait_margin=0.005))
    _saturated(a, 0.004)
    with a.admitted(CallDeadline.after(None)) as ticket, a.retrieving_for(ticket):
        assert a.retrieving == 0 and a.untimed == 1
    assert a.retrieving == 0


async def test_a_large_call_queues_for_its_thread_before_it_takes_a_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair(max_concurrent=2, max_org_concurrent=2)
    threads = WorkerThreads(1)
    assert threads.queue.try_acquire()  # the only thread is busy
    held: list[bool] = []

    async def large() -> None:
        with a.admitted(CallDeadline.after(5.0)) as ticket:
            async with a.slot(ticket, ORG_A, threads) as thread_held:
                assert threads.queue.held == 1 and a.slots.by_key == {ORG_A: 1}
                held.append(thread_held)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(large)
        await trio.sleep(0.5)
        # Waiting for the thread, it holds no slot: both slots serve calls that can run.
        assert a.thread_waiting == 1 and a.slots.held == 0
        for _ in range(2):
            with a.admitted(CallDeadline.after(0.045)) as ticket:
                async with a.slot(ticket, ORG_A) as thread_held:
                    assert not thread_held
        threads.queue.release()
    assert held == [True]
    assert threads.queue.held == 0 and a.slots.held == 0 and a.thread_waiting == 0
    # Its wait was for the thread, not for a slot: no sojourn of 0.5 s reached the detector.
    assert a.queue.estimate < 0.1


async def test_a_long_thread_queue_refuses_and_says_which_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair(max_thread_queue=1, max_queue_wait=0.5)
    threads = WorkerThreads(1)
    threads.service = 0.040
    assert threads.queue.try_acquire()

    async def refused(remaining: float | None) -> Overloaded:
        """Refused at once: no time passes (the clock would jump while it waited)."""
        t0 = trio.current_time()
        with pytest.raises(Overloaded) as info, a.admitted(CallDeadline.after(remaining)) as ticket:
            async with a.slot(ticket, ORG_A, threads):
                pass
        assert trio.current_time() == t0
        return info.value

    # 45 ms left, about 40 ms of queue: less than min_useful (20 ms) would be left.
    exc = await refused(0.045)
    assert exc.reason == "threads" and "worker-thread queue" in str(exc)
    assert a.slots.held == 0 and a.thread_waiting == 0
    # Less than min_useful left: never refused as overload, it waits and misses its deadline.
    with pytest.raises(DeadlineError), a.admitted(CallDeadline.after(0.015)) as ticket:
        async with a.slot(ticket, ORG_A, threads):
            pass
    # A call with room waits (and gets the thread once it frees).
    async with trio.open_nursery() as nursery:

        async def patient() -> None:
            with a.admitted(CallDeadline.after(5.0)) as ticket:
                async with a.slot(ticket, ORG_A, threads):
                    pass

        nursery.start_soon(patient)
        await trio.sleep(0.01)
        assert a.thread_waiting == 1
        # The queue is at its count bound now: the next one is refused whatever its time.
        exc = await refused(5.0)
        assert "1 calls already wait for a worker thread" in str(exc)
        threads.queue.release()
    # Without a deadline: refused once the expected wait passes MAX_QUEUE_WAIT.
    assert threads.queue.try_acquire()
    threads.service = 1.0
    exc = await refused(None)
    assert exc.reason == "threads" and "without a deadline" in str(exc)
    threads.queue.release()
    assert shed(a, "threads") == 3 and a.in_flight == 0 and a.pending == 0


# -- when a wait runs out: what the caller is told ---------------------------------------------


def _one_busy_thread(service: float) -> WorkerThreads:
    """One worker thread, taken, that a call expects to take `service` seconds a turn."""
    threads = WorkerThreads(1)
    assert threads.queue.try_acquire()
    threads.service = service
    return threads


async def _slot(
    a: Admission, remaining: float | None, org: str = ORG_B, threads: WorkerThreads | None = None
) -> bool:
    with a.admitted(CallDeadline.after(remaining)) as ticket:
        async with a.slot(ticket, org, threads) as held:
            return held


async def test_a_wait_for_a_slot_that_runs_out_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No slot in time: DEADLINE_EXCEEDED while no queue stands (an idle daemon's answer
    too), `queue` overload while one does, and for a call without a deadline the wait
    it was given."""
    a = fair(max_concurrent=1, max_queue_wait=0.75)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold, a, ORG_A, 50.0, release)
        await trio.sleep(0.001)
        with pytest.raises(DeadlineError) as late:
            await _slot(a, 0.050)
        assert str(late.value) == "no assembly slot free within the deadline"
        _standing(a, 0.030)
        with pytest.raises(Overloaded) as standing:
            await _slot(a, 0.5)
        assert standing.value.reason == "queue"
        assert str(standing.value) == "overloaded: no assembly slot within the deadline"
        with pytest.raises(Overloaded) as untimed:
            await _slot(a, None)
        assert str(untimed.value) == (
            "overloaded: no assembly slot within the 750ms a call without a deadline waits"
        )
        release.set()
    assert shed(a, "queue") == 2 and a.in_flight == 0 and a.pending == 0


async def test_thread_queue_refusals_name_the_expected_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = fair(max_queue_wait=0.75)
    threads = _one_busy_thread(3.0)
    with pytest.raises(Overloaded) as timed:  # 2.5 s left: less than 3 s + min_useful
        await _slot(a, 2.5, ORG_A, threads)
    assert re.fullmatch(
        r"overloaded: about 3000ms of worker-thread queue before a call with (2499|2500)ms left",
        str(timed.value),
    )
    threads.service = 1.0
    with pytest.raises(Overloaded) as untimed:
        await _slot(a, None, ORG_A, threads)
    assert str(untimed.value) == (
        "overloaded: about 1000ms of worker-thread queue, over the 750ms a call without a "
        "deadline waits"
    )
    threads.queue.release()


async def test_a_wait_for_a_thread_that_runs_out_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The thread never frees: a call with less than `min_useful` left misses its deadline
    (DEADLINE_EXCEEDED); one with room, or without a deadline whose expected wait is exactly
    `max_queue_wait` (not over it), waits its whole time and is refused as `threads`."""
    a = fair(max_queue_wait=0.75)
    threads = _one_busy_thread(0.001)
    with pytest.raises(DeadlineError) as late:
        await _slot(a, 0.015, ORG_A, threads)
    assert str(late.value) == "no worker thread free within the deadline"
    t0 = trio.current_time()
    with pytest.raises(Overloaded) as timed:
        await _slot(a, 0.5, ORG_A, threads)
    assert trio.current_time() - t0 == pytest.approx(0.5 - 0.002, abs=0.001)  # less min_answer
    assert str(timed.value) == "overloaded: no worker thread free within the call's wait"
    threads.service = 0.75  # a call without a deadline expects exactly max_queue_wait
    t0 = trio.current_time()
    with pytest.raises(Overloaded) as untimed:
        await _slot(a, None, ORG_A, threads)
    assert trio.current_time() - t0 == pytest.approx(0.75)
    assert str(untimed.value) == "overloaded: no worker thread free within the call's wait"
    assert shed(a, "threads") == 2
    threads.queue.release()


async def test_calls_with_room_wait_for_a_thread_whatever_its_queue_would_cost_untimed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`max_queue_wait` bounds calls without a deadline only: two calls with 5 s left wait
    behind a 1 s thread queue (counted as waiting) and each gets the thread in turn."""
    a = fair(max_queue_wait=0.5)
    threads = _one_busy_thread(1.0)
    held: list[bool] = []

    async def patient() -> None:
        held.append(await _slot(a, 5.0, ORG_A, threads))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(patient)
        nursery.start_soon(patient)
        await trio.sleep(0.01)
        assert a.thread_waiting == 2
        threads.queue.release()
    assert held == [True, True] and a.thread_waiting == 0 and shed(a, "threads") == 0
