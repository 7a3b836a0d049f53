"""Admission by deadline (ibex.service.admission): what is served, what is refused, why."""

from __future__ import annotations

import time

import pytest
import trio

from ibex.errors import DeadlineError, Overloaded, Unavailable
from ibex.ops.metrics import Metrics
from ibex.service.admission import Admission, AdmissionConfig, QueueDelay

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
    with pytest.raises(DeadlineError), a.admitted(time.monotonic(), 0.0019):
        pass
    assert a.in_flight == 0 and a.pending == 0
    assert shed(a, "deadline") == 0 and shed(a, "queue") == 0
    with a.admitted(time.monotonic(), 0.0021):  # just enough for a degraded answer: admitted
        assert a.in_flight == 1


def test_no_deadline_is_always_admitted_below_the_cap() -> None:
    a = admission()
    with a.admitted(time.monotonic(), None) as ticket:
        assert ticket.remaining(123.0) is None


def test_the_hard_cap_refuses_as_overload() -> None:
    a = admission()
    with (
        a.admitted(time.monotonic(), 1.0),
        a.admitted(time.monotonic(), 1.0),
        a.admitted(time.monotonic(), 1.0),
        a.admitted(time.monotonic(), 1.0),
    ):
        assert a.in_flight == 4
        with pytest.raises(Overloaded) as info, a.admitted(time.monotonic(), 1.0):
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
    with a.admitted(time.monotonic(), 1.0):  # queued behind the waiting call: 1 s leaves plenty
        assert a.pending == 1
        with a.admitted(time.monotonic(), 1.0):
            pass
        # 45 ms - 30 ms of expected wait < 20 ms needed for a useful answer
        with pytest.raises(Overloaded) as info, a.admitted(time.monotonic(), 0.045):
            pass
        assert info.value.reason == "queue"
        with a.admitted(time.monotonic(), 0.060):  # 30 ms left after the wait: served
            pass
    assert shed(a, "queue") == 1


def test_a_standing_estimate_with_nobody_waiting_refuses_nothing() -> None:
    """After a burst the estimate lingers; with no queue in front, nothing is refused."""
    a = admission()
    _standing(a, 0.030)
    with a.admitted(time.monotonic(), 0.045):
        pass
    assert shed(a, "queue") == 0


# -- slots ------------------------------------------------------------------------------------


async def test_slots_bound_concurrent_assemblies_and_feed_the_detector() -> None:
    a = admission()
    running = 0
    peak = 0

    async def call() -> None:
        nonlocal running, peak
        with a.admitted(time.monotonic(), 2.0) as ticket:
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
        with a.admitted(time.monotonic(), 5.0) as ticket:
            async with a.slot(ticket):
                await release.wait()

    async def late() -> None:
        try:
            with a.admitted(time.monotonic(), 0.050) as ticket:
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
    with a.admitted(arrived, 1.0) as ticket:
        assert ticket.arrived == arrived
