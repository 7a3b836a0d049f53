"""The caller's deadline as the edge reads it from `grpc-timeout` (ibex/service/edge/deadline.py).

Expected values from the gRPC over HTTP/2 spec: Timeout = TimeoutValue TimeoutUnit,
TimeoutValue a positive integer of at most 8 ASCII digits, TimeoutUnit one of
H (hours), M (minutes), S (seconds), m (milliseconds), u (microseconds), n (nanoseconds).
"""

from __future__ import annotations

import time

import pytest
import trio

from ibex.service.edge.deadline import CallDeadline, parse_timeout


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("2H", 7200.0), ("3M", 180.0), ("5S", 5.0), ("45m", 0.045), ("250u", 250e-6),
     ("1n", 1e-9), ("99999999S", 99999999.0), (b"100m", 0.1), ("00000001S", 1.0)],
)  # fmt: skip
def test_each_unit_of_the_spec(value: str | bytes, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    "value",
    ["", "S", "5", "5s", "5h", "5 S", " 5S", "5S ", "-5S", "+5S", "1.5S", "0x5S",
     "123456789S", "5SS", "\u0665S", "soon", b"\xff5S"],
)  # fmt: skip
def test_anything_else_is_refused(value: str | bytes) -> None:
    """No unit or an unknown one, signs, spaces, fractions, non-ASCII digits, 9 digits."""
    with pytest.raises(ValueError, match="invalid grpc-timeout"):
        parse_timeout(value)


def test_from_headers_counts_from_arrival_and_the_shortest_timeout_wins() -> None:
    headers = [(":path", "/x"), ("grpc-timeout", "5S"), (b"grpc-timeout", b"45m")]
    deadline = CallDeadline.from_headers(headers, 100.0)
    assert deadline == CallDeadline(arrived=100.0, at=100.045)
    assert deadline.timeout == pytest.approx(0.045)
    assert deadline.remaining(100.04) == pytest.approx(0.005)
    assert not deadline.expired(100.04)
    assert deadline.expired(100.045)


def test_no_grpc_timeout_is_no_deadline() -> None:
    deadline = CallDeadline.from_headers([(":path", "/x")], 100.0)
    assert deadline == CallDeadline(100.0, None)
    assert deadline.timeout is None and deadline.remaining(1e9) is None
    assert not deadline.expired(1e9)


def test_a_malformed_value_among_the_headers_is_refused() -> None:
    with pytest.raises(ValueError):
        CallDeadline.from_headers([("grpc-timeout", "5S"), ("grpc-timeout", "5")], 0.0)


def test_the_type_is_frozen() -> None:
    deadline = CallDeadline.after(1.0, 10.0)
    with pytest.raises(AttributeError):
        deadline.at = 12.0  # type: ignore[misc]


async def test_on_the_trio_clock_arrival_and_deadline_keep_their_distance() -> None:
    """One conversion: both ends move by the same offset between the two clocks."""
    now = time.monotonic()
    deadline = CallDeadline.after(0.040, now - 0.010)
    arrived, due = deadline.on_trio_clock()
    assert due is not None
    assert due - arrived == pytest.approx(0.040, abs=1e-9)
    assert arrived <= trio.current_time()
    assert CallDeadline.after(None, now).on_trio_clock()[1] is None
