"""The GC-pause benchmark's summary: passes per generation, p50 and max CPU, objects freed."""

from __future__ import annotations

from benchmarks.load.gc_pauses import summary


def test_summary_groups_passes_by_generation() -> None:
    passes = [
        {"generation": 0, "wall_ms": 0.2, "cpu_ms": 0.1, "collected": 0},
        {"generation": 0, "wall_ms": 0.4, "cpu_ms": 0.3, "collected": 5},
        {"generation": 0, "wall_ms": 0.3, "cpu_ms": 0.2, "collected": 1},
        {"generation": 2, "wall_ms": 9.0, "cpu_ms": 4.0, "collected": 30},
    ]
    assert summary(passes) == {
        0: {"passes": 3, "cpu_p50_ms": 0.2, "cpu_max_ms": 0.3, "collected": 6},
        2: {"passes": 1, "cpu_p50_ms": 4.0, "cpu_max_ms": 4.0, "collected": 30},
    }
