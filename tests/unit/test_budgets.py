"""Request bytes by share (ibex.service.budgets) and where a unary request ends
(ibex.service.edge.flow): the rules the integration tests in test_budgets.py rest on."""

from __future__ import annotations

import struct

import pytest

from ibex.errors import Overloaded
from ibex.ops.metrics import Metrics
from ibex.service.admission import Admission, AdmissionConfig
from ibex.service.edge.flow import UnaryRequest

KIB = 1024
CONFIG = AdmissionConfig(
    max_in_flight_bytes=64 * KIB, max_caller_bytes=16 * KIB, max_unauthenticated_bytes=8 * KIB
)


def admission() -> Admission:
    return Admission(CONFIG, Metrics())


def test_a_caller_is_refused_beyond_its_share_and_another_keeps_its_own() -> None:
    a = admission()
    first = a.reservation("conn-1", "token:a")
    first.grow(10 * KIB)
    second = a.reservation("conn-2", "token:a")  # the same caller on another connection
    second.grow(6 * KIB)  # exactly its share
    with pytest.raises(Overloaded):
        a.reservation("conn-3", "token:a").grow(1)
    other = a.reservation("conn-4", "token:b")
    other.grow(16 * KIB)  # another caller's share is whole
    assert a.in_flight_bytes == 32 * KIB
    for r in (first, second, other):
        r.release()
    assert a.in_flight_bytes == 0 and a.shares.held == {}


def test_a_connection_is_refused_beyond_its_share_whoever_the_callers() -> None:
    a = admission()
    a.reservation("conn", "token:a").grow(16 * KIB)
    with pytest.raises(Overloaded):
        a.reservation("conn", "token:b").grow(1)
    a.reservation("other-conn", "token:b").grow(1)


def test_one_message_always_fits_a_share_when_its_holder_has_nothing_else() -> None:
    a = admission()
    alone = a.reservation("conn", "token:a")
    for _ in range(4):
        alone.grow(8 * KIB)  # its own parts grow past the 16 KiB share
    assert alone.held == 32 * KIB
    with pytest.raises(Overloaded):
        a.reservation("conn-2", "token:a").grow(1)
    alone.release()
    alone.release()  # idempotent
    assert a.in_flight_bytes == 0


def test_the_process_cap_counts_a_message_s_own_parts_as_its_own() -> None:
    config = AdmissionConfig(max_in_flight_bytes=4 * KIB, max_caller_bytes=64 * KIB)
    a = Admission(config, Metrics())
    one = a.reservation("conn", "token:a")
    one.grow(4 * KIB)
    one.grow(4 * KIB)  # alone: grows past the process cap
    with pytest.raises(Overloaded):
        a.reservation("conn-2", "token:b").grow(1)


def test_unauthenticated_reads_draw_on_their_own_pool() -> None:
    a = admission()
    health = [a.unauthenticated.reservation(f"conn-{i}") for i in range(4)]
    for r in health:
        r.grow(2 * KIB)  # a quarter of the pool each: the whole pool
    with pytest.raises(Overloaded):
        a.unauthenticated.reservation("conn-9").grow(1)
    assert a.in_flight_bytes == 0  # the callers' budget is untouched
    a.reservation("conn-0", "token:a").grow(16 * KIB)
    for r in health:
        r.release()
    assert a.unauthenticated.held == 0


def test_one_connection_holds_at_most_a_quarter_of_the_unauthenticated_pool() -> None:
    a = admission()
    a.unauthenticated.reservation("conn").grow(2 * KIB)
    with pytest.raises(Overloaded):
        a.unauthenticated.reservation("conn").grow(1)
    a.unauthenticated.reservation("other").grow(1)


def message(length: int) -> bytes:
    return struct.pack(">?I", False, length) + b"\x00" * length


def test_a_unary_request_ends_after_its_one_message() -> None:
    request = UnaryRequest()
    data = message(10)
    # In pieces: the prefix split across frames, then the body.
    assert not any(request.past_end(part) for part in (data[:2], data[2:7], data[7:]))
    assert not request.past_end(b"")  # an empty DATA frame with END_STREAM
    assert request.past_end(b"\x00")


def test_a_frame_carrying_the_message_and_more_is_past_the_end() -> None:
    assert UnaryRequest().past_end(message(3) + b"\x00")
    assert not UnaryRequest().past_end(message(3))
    assert UnaryRequest().past_end(message(0) + message(0))
