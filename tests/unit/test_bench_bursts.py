"""The burst benchmark's figures: directive successes of the bursts, scheduler passes per read."""

from __future__ import annotations

from typing import Any

from benchmarks.load.bursts import passes_per_read, report


def result() -> dict[str, Any]:
    """Two bursts of two calls; the probe's events: (ms, agent, step, passes so far)."""
    return {
        "root": "/tmp/old",
        "bursts": [
            {"calls": [("success", 1.5), ("timeout", 5.2)], "redis": 1, "window": (0.0, 50.0)},
            {"calls": [("success", 0.0), ("success", 2.0)], "redis": 1, "window": (100.0, 150.0)},
        ],
        "singles": [("success", 0.8), ("success", 0.9)],
        "probe": {
            "events": [
                (1.0, "aaaa", "decoded", 10),
                (1.1, "bbbb", "decoded", 10),
                (2.0, "aaaa", "branch start", 12),
                (3.0, "bbbb", "branch start", 13),
                (4.0, "aaaa", "branch end", 14),
                (9.0, "bbbb", "branch end", 18),
                (101.0, "aaaa", "decoded", 40),
                (101.5, "bbbb", "decoded", 41),
                (103.0, "aaaa", "landed directive", 43),  # a cache hit: no branch task
                (104.0, "bbbb", "branch start", 44),
                (105.0, "bbbb", "branch end", 46),
            ],
            "steps": [],
            "task_steps": 0,
        },
    }


def test_passes_from_decode_and_from_branch_start_to_the_branch_end() -> None:
    assert passes_per_read(result()) == {"decoded": [4, 8, 3, 5], "branch": [2, 5, 2]}


def test_the_report_counts_the_bursts_directive_successes_and_the_singles() -> None:
    text = report(result())
    assert "bursts: directive success 3 of 4" in text
    assert "singles: directive success 2 of 2" in text
