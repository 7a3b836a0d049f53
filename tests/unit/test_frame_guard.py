"""The per-connection budgets of offending HTTP/2 frames, on a fake clock and frames built
with hyperframe; `tests/integration/test_http2_attacks.py` sends the floods to the daemon."""

from __future__ import annotations

import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ibex.ops.metrics import CONNECTION_CLOSE_REASONS
from ibex.service.edge.connections import CLOSE_REASONS
from ibex.service.edge.frame_guard import (
    BUDGETS,
    CLOSE_CODES,
    ENHANCE_YOUR_CALM,
    FLOOD_REASONS,
    MAX_REQUEST_HEADER_FIELDS,
    PREFACE_BYTES,
    PROTOCOL_ERROR,
    FrameGuard,
    malformed,
    resets_in,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock | None = None) -> FrameGuard:
    g = FrameGuard(clock=clock or Clock())
    assert g.scan(PREFACE) is None
    return g


OFFENDING = {
    "rapid_reset": RstStreamFrame(1, error_code=8).serialize(),
    "ping_flood": PingFrame(0, b"12345678").serialize(),
    "settings_flood": SettingsFrame(0).serialize(),
    "empty_frames": DataFrame(1, b"").serialize(),
    "priority_flood": PriorityFrame(3, depends_on=1).serialize(),
    "unknown_frames": b"\x00\x00\x00\x20\x00\x00\x00\x00\x00",
}


@pytest.mark.parametrize("kind", list(OFFENDING))
def test_an_unauthenticated_connection_has_a_small_budget_of_each_kind(kind: str) -> None:
    g = guard()
    frame = OFFENDING[kind]
    allowed = BUDGETS[kind].unauthenticated
    assert g.scan(frame * allowed) is None
    assert g.scan(frame) == kind


def test_harmless_frames_are_not_counted() -> None:
    g = guard()
    harmless = (
        PingFrame(0, b"12345678", flags=["ACK"]).serialize()
        + SettingsFrame(0, flags=["ACK"]).serialize()
        + DataFrame(1, b"", flags=["END_STREAM"]).serialize()
        + DataFrame(1, b"\x00" * 5).serialize()
        + WindowUpdateFrame(0, 100).serialize()
        + HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize()
        + ContinuationFrame(1, b"", flags=["END_HEADERS"]).serialize()
    )
    for _ in range(100):
        assert g.scan(harmless) is None


def test_frames_split_across_reads_are_counted_once_and_payloads_are_skipped() -> None:
    g = FrameGuard(clock=Clock())
    # A PING-typed byte inside a DATA payload is payload, not a frame.
    fake_ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"x" * 8
    data = PREFACE + DataFrame(1, fake_ping * 200).serialize()
    pings = PingFrame(0, b"12345678").serialize() * (BUDGETS["ping_flood"].unauthenticated + 1)
    stream = data + pings
    verdicts = [g.scan(stream[i : i + 7]) for i in range(0, len(stream), 7)]
    assert [v for v in verdicts if v is not None] == ["ping_flood"]


def test_the_budget_refills_over_time_and_with_answered_calls() -> None:
    clock = Clock()
    g = guard(clock)
    budget = BUDGETS["rapid_reset"]
    reset = OFFENDING["rapid_reset"]
    assert g.scan(reset * budget.unauthenticated) is None
    g.earned()  # one answered call buys one more
    assert g.scan(reset) is None
    clock.now += 1.0 / budget.per_second
    assert g.scan(reset) is None
    assert g.scan(reset) == "rapid_reset"


def test_an_authenticated_connection_gets_the_larger_budget() -> None:
    g = guard()
    g.authenticated = lambda: True
    budget = BUDGETS["rapid_reset"]
    assert budget.authenticated > budget.unauthenticated
    reset = OFFENDING["rapid_reset"]
    assert g.scan(reset * budget.authenticated) is None
    assert g.scan(reset) == "rapid_reset"


def test_header_blocks_no_grpc_client_sends_are_malformed() -> None:
    ok = [(b":method", b"POST"), (b":path", b"/x"), (b"te", b"trailers"), (b"x-empty", b"")]
    assert not malformed(ok)
    assert malformed([(b"", b"")] * 2000)
    assert malformed([*ok, (b"", b"v")])
    assert malformed([])
    assert malformed([(b"a", b"")] * (MAX_REQUEST_HEADER_FIELDS + 1))
    g = guard()
    for _ in range(BUDGETS["empty_headers"].unauthenticated):
        assert g.offend("empty_headers") is None
    assert g.offend("empty_headers") == "empty_headers"


def test_close_codes_and_every_reason_has_a_metric_series() -> None:
    assert CLOSE_CODES["empty_headers"] == PROTOCOL_ERROR
    assert {CLOSE_CODES[k] for k in BUDGETS if k != "empty_headers"} == {ENHANCE_YOUR_CALM}
    assert set(CONNECTION_CLOSE_REASONS) == set(CLOSE_REASONS) | set(FLOOD_REASONS)
    assert len(PREFACE) == PREFACE_BYTES


def test_resets_h2_queued_are_counted_and_the_rest_skipped() -> None:
    queued = (
        RstStreamFrame(1, error_code=5).serialize()
        + WindowUpdateFrame(0, 100).serialize()
        + DataFrame(3, RstStreamFrame(3).serialize() * 3).serialize()  # payload, not frames
        + RstStreamFrame(5, error_code=5).serialize()
    )
    assert resets_in(queued) == 2
    assert resets_in(b"") == 0
    g = guard()
    assert g.offend("reset_flood", BUDGETS["reset_flood"].unauthenticated) is None
    assert g.offend("reset_flood", 0) is None
    assert g.offend("reset_flood") == "reset_flood"


def test_answered_calls_never_raise_a_budget_past_its_size() -> None:
    g = guard(Clock())
    budget = BUDGETS["rapid_reset"]
    reset = OFFENDING["rapid_reset"]
    for _ in range(3 * budget.unauthenticated):
        g.earned()
    assert g.scan(reset * budget.unauthenticated) is None
    assert g.scan(reset) == "rapid_reset"


def test_each_answered_call_buys_back_one_frame_of_every_kind() -> None:
    g = guard(Clock())
    resets, pings = BUDGETS["rapid_reset"], BUDGETS["ping_flood"]
    assert g.scan(OFFENDING["rapid_reset"] * resets.unauthenticated) is None
    assert g.scan(OFFENDING["ping_flood"] * pings.unauthenticated) is None
    g.earned()
    g.earned()
    assert g.scan(OFFENDING["rapid_reset"] * 2) is None
    assert g.scan(OFFENDING["ping_flood"] * 2) is None
    assert g.scan(OFFENDING["rapid_reset"]) == "rapid_reset"
    assert g.scan(OFFENDING["ping_flood"]) == "ping_flood"
