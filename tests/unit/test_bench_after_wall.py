"""The after-the-wall benchmark's summary: steps in order, median and p90 of each."""

from __future__ import annotations

from benchmarks.load.after_wall import summary


def test_summary_orders_steps_and_takes_median_and_p90() -> None:
    steps = {
        "3 retrieval returns": [float(v) for v in range(1, 11)],  # 1..10
        "1 loop wakes after the wall": [0.5],
        "2 cold branch cancelled": [],
    }
    assert summary(steps) == [
        ("1 loop wakes after the wall", 1, 0.5, 0.5),
        ("3 retrieval returns", 10, 5.5, 10.0),  # p90 of ten values is the tenth
    ]
