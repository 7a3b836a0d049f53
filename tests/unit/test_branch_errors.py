"""The rate-limited summary of branch errors and timeouts (`ibex.ops.branch_errors`).

A failed branch degrades its answer without failing the call, so failures are
counted by source and reason and logged as at most one `branch_errors` line per
source and window, at warning, never one line per failed branch.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from ibex.assembly.structs import BranchOutcome
from ibex.ops.branch_errors import MAX_REASONS, BranchErrors

REFUSED = BranchOutcome("directive", "error", 0.3, "redis: connection failed")
LATE = BranchOutcome("directive", "timeout", 5.0, "no answer within 5ms")
HOT_OK = BranchOutcome("hot", "success", 2.0, "")
COLD_503 = BranchOutcome("cold", "error", 3.0, "cold: HTTP 503")
COLD_SKIPPED = BranchOutcome("cold", "skipped", 0.0, "empty query")


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "branch_errors"]


def fields(record: logging.LogRecord) -> dict[str, object]:
    keys = ("source", "errors", "timeouts", "successes", "reasons", "window_s")
    return {k: getattr(record, k) for k in keys}


def test_one_line_per_failing_source_with_counts_by_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    errors = BranchErrors(interval=10.0, clock=lambda: now[0])
    for _ in range(4):
        errors.observe([REFUSED, HOT_OK, COLD_503])
    errors.observe([LATE, HOT_OK, COLD_SKIPPED])
    now[0] += 10.0
    with caplog.at_level(logging.INFO):
        assert errors.flush() == 2
    assert all(r.levelno == logging.WARNING for r in lines(caplog))
    assert [fields(r) for r in lines(caplog)] == [
        {
            "source": "cold",
            "errors": 4,
            "timeouts": 0,
            "successes": 0,
            "reasons": {"error: cold: HTTP 503": 4},
            "window_s": 10.0,
        },
        {
            "source": "directive",
            "errors": 4,
            "timeouts": 1,
            "successes": 0,
            "reasons": {"error: redis: connection failed": 4, "timeout: no answer within 5ms": 1},
            "window_s": 10.0,
        },
    ]
    caplog.clear()
    errors.observe([HOT_OK])  # successes alone are nothing to report
    with caplog.at_level(logging.INFO):
        assert errors.flush() == 0
    assert lines(caplog) == []


def test_distinct_reasons_are_bounded() -> None:
    errors = BranchErrors()
    for i in range(MAX_REASONS + 5):
        errors.observe([BranchOutcome("hot", "error", 1.0, f"hot: HTTP {500 + i}")])
    window = errors._windows["hot"]
    assert len(window.reasons) == MAX_REASONS + 1
    assert window.reasons["other"] == 5
    assert window.errors == MAX_REASONS + 5


async def test_a_storm_of_failures_is_one_line_per_source_per_interval(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed call every 30 ms for 25 s: one line per 10 s interval while running."""
    errors = BranchErrors(interval=10.0, clock=trio.current_time)
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(errors.run)
        for _ in range(int(25 / 0.03)):
            errors.observe([REFUSED])
            await trio.sleep(0.03)
        nursery.cancel_scope.cancel()
    # Calls at 0, 0.03, ... : 334 before 10 s, 333 from 10 s to 20 s.
    assert [(r.source, r.errors) for r in lines(caplog)] == [  # type: ignore[attr-defined]
        ("directive", 334),
        ("directive", 333),
    ]
