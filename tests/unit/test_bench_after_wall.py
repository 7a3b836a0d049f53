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


def test_h2load_row_reads_the_tail_past_the_wall_off_the_daemons_histogram() -> None:
    import math

    from benchmarks.load.after_wall import h2load_row
    from benchmarks.load.h2load import Run

    # 100 answers: 90 in (0.040, 0.041], 10 in (0.041, 0.042]; the wall at 40 ms.
    buckets = {0.04: 0.0, 0.041: 90.0, 0.042: 100.0, math.inf: 100.0}
    run = Run(100, 100, 0, 0, 0, 10.0, [float(v) for v in range(1, 101)], client_cpu_s=0.2)
    row = h2load_row(run, {"OK": 100.0}, buckets, 0.040)
    # p99: rank 99 lies 9/10 into the (41, 42] bucket; p50: 50/90 into (40, 41].
    assert row["server_p99_after_wall_ms"] == 1.9
    assert row["server_p50_after_wall_ms"] == round(50 / 90, 2)
    assert row["statuses"] == {"OK": 100}
    assert row["server_observed"] == 100
    assert row["client_cpu_cores"] == 0.02
