"""The before/after cold-endpoint benchmark's share of calls answered OK."""

from __future__ import annotations

from benchmarks.load.cold_versus import ok_share


def test_ok_share_is_the_percent_answered_ok() -> None:
    assert ok_share({"OK": 3, "DEADLINE_EXCEEDED": 1}) == 75.0
    assert ok_share({}) == 0.0
