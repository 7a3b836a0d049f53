"""The pure parts of `benchmarks.targets`: histogram p99 from scrape deltas, ratios, verdicts.

Expected values are worked out by hand from the definitions (Prometheus'
`histogram_quantile`: linear inside the bucket holding rank q x total; the
wall: min(TIMEOUT, DEADLINE_MS, caller deadline - PIPELINE_HEADROOM_MS)).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from benchmarks import targets as t

BUCKETS = tuple(n / 1000 for n in range(38, 51))


def _exposition(observations: dict[str, list[float]]) -> str:
    """A real Prometheus text scrape of `ibex_answer_seconds`, per method label."""
    registry = CollectorRegistry()
    h = Histogram("ibex_answer_seconds", "x", ["method"], buckets=BUCKETS, registry=registry)
    for method, values in observations.items():
        for v in values:
            h.labels(method).observe(v)
    return generate_latest(registry).decode()


def test_p99_interpolates_inside_the_bucket_that_holds_the_rank() -> None:
    # rank 99 of 100 lies in (42, 43] ms, 9 of whose 10 observations are needed.
    buckets = {0.040: 0.0, 0.041: 50.0, 0.042: 90.0, 0.043: 100.0, math.inf: 100.0}
    assert t.histogram_quantile(buckets, 0.99) == pytest.approx(0.0429)


def test_p99_edges() -> None:
    # In the first bucket the lower bound is 0; in +Inf the answer is the last finite bound.
    assert t.histogram_quantile({0.01: 100.0, math.inf: 100.0}, 0.5) == pytest.approx(0.005)
    assert t.histogram_quantile({0.04: 10.0, 0.05: 50.0, math.inf: 100.0}, 0.99) == 0.05
    assert t.histogram_quantile({}, 0.99) is None
    assert t.histogram_quantile({0.04: 0.0, math.inf: 0.0}, 0.99) is None


def test_p99_of_the_calls_between_two_scrapes() -> None:
    earlier = [0.0395] * 50  # before the run: must not count
    run = [0.0405] * 90 + [0.0415] * 9 + [0.0455]
    before = t.answer_buckets(_exposition({"AssembleContext": earlier, "Other": [0.049] * 7}))
    after = t.answer_buckets(
        _exposition({"AssembleContext": earlier + run, "Other": [0.049] * 500})
    )
    assert before[0.040] == 50 and before[math.inf] == 50
    deltas = t.bucket_deltas(before, after)
    assert deltas[0.040] == 0 and deltas[0.041] == 90 and deltas[0.042] == 99
    assert deltas[math.inf] == 100
    # rank 99 falls at the top of (41, 42]: the 99th observation is the last one there.
    p99 = t.histogram_quantile(deltas, 0.99)
    assert p99 == pytest.approx(0.042)
    # Two repeats' deltas add up bucket by bucket.
    assert t.add_buckets(deltas, deltas)[0.042] == 198


def test_ratio_and_verdicts() -> None:
    assert t.ratio(4.5, 1.8) == pytest.approx(2.5)
    assert t.ratio(1.0, 0.0) is None and t.ratio(None, 1.0) is None
    assert t.verdict(2.0, 2.0) == "met"
    assert t.verdict(2.01, 2.0) == "short"
    assert t.verdict(99.9, 99.9, at_least=True) == "met"
    assert t.verdict(99.89, 99.9, at_least=True) == "short"
    assert t.verdict(None, 2.0) == "short"
    assert t.verdict(math.nan, 2.0) == "short"


def _cpu(ibex: list[float], trio: list[float], aio: list[float]) -> dict[str, dict[str, Any]]:
    return {
        m: {"cpu_ms_per_answer": sorted(runs)[len(runs) // 2], "cpu_ms_per_answer_runs": runs}
        for m, runs in (("ibex", ibex), ("trio-asyncio", trio), ("asyncio", aio))
    }


def test_the_cpu_ratio_is_the_median_of_each_repeats_pair() -> None:
    # Pairs 3.0/1.0, 4.4/2.0, 2.0/1.6 = 3.0, 2.2, 1.25: median 2.2 (not 3.0/1.6 of the medians).
    assert t.paired_ratio([3.0, 4.4, 2.0], [1.0, 2.0, 1.6]) == pytest.approx(2.2)
    assert t.paired_ratio([3.0, None], [1.0, 2.0]) == pytest.approx(3.0)  # a row without answers
    assert t.paired_ratio([None], [1.0]) is None


def test_cpu_rows_divide_by_the_trio_asyncio_floor_against_each_loads_limit() -> None:
    loads = {
        "100rps": _cpu([3.0], [1.5], [1.2]),
        "200rps": _cpu([3.3], [1.5], [1.5]),
        "closed": _cpu([1.25], [0.5], [0.5]),
    }
    medians = {f"{m}_{load}": v for load, d in loads.items() for m, v in d.items()}
    rows = t.cpu_rows(medians)
    judged = [r for r in rows if r.verdict != "-"]
    assert [r.ratio for r in judged] == pytest.approx([2.0, 2.2, 2.5])
    assert [r.verdict for r in judged] == ["met", "short", "met"]  # limits 2.0, 2.0, 2.5
    beside = [r for r in rows if r.verdict == "-"]
    assert [r.ratio for r in beside] == pytest.approx([2.5, 2.2, 2.5])


def test_cold_deadline_rows() -> None:
    met = t.cold_deadline_rows(100, {"OK": 999, "DEADLINE_EXCEEDED": 1}, 999)
    assert [r.verdict for r in met] == ["met", "met"]
    assert "DEADLINE_EXCEEDED 1" in met[0].measured
    short = t.cold_deadline_rows(
        200, {"OK": 998, "DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 1}, 997
    )
    assert [r.verdict for r in short] == ["short", "short"]
    assert "RESOURCE_EXHAUSTED 1" in short[0].measured
    assert [r.verdict for r in t.cold_deadline_rows(100, {}, 0)] == ["short", "short"]


def test_the_server_share_within_the_deadline_is_shown_beside_the_target() -> None:
    text = "\n".join(
        f'ibex_answer_seconds_bucket{{method="AssembleContext",le="{le}"}} {n}'
        for le, n in (("0.044", 90.0), ("0.045", 97.0), ("0.046", 99.0), ("+Inf", 100.0))
    )
    buckets = t.answer_buckets("# TYPE ibex_answer_seconds histogram\n" + text + "\n")
    assert t.within(buckets, 0.045) == (97.0, 100.0)
    rows = t.cold_deadline_rows(200, {"OK": 95, "DEADLINE_EXCEEDED": 5}, 95, (97.0, 100.0))
    assert [r.verdict for r in rows] == ["short", "met", "-"]
    assert rows[2].measured == "97 of 100 (97.00 %)"
    assert t.cold_deadline_rows(200, {"OK": 1}, 1, (0.0, 0.0))[2].measured == "nothing observed"


def test_tail_rows_judge_the_time_after_the_wall() -> None:
    client, server = t.tail_rows(45.0, 0.0414, 0.040)
    assert (client.verdict, server.verdict) == ("met", "met")
    assert "1.40 ms after" in server.measured
    client, server = t.tail_rows(45.1, 0.0416, 0.040)
    assert (client.verdict, server.verdict) == ("short", "short")
    assert t.tail_rows(None, None, 0.040)[1].verdict == "short"


def test_refusal_and_short_deadline_rows() -> None:
    ok = {"refused": 0, "calls": 100, "achieved_rps": 500.0}
    rows = t.refusal_rows(ok, ok, {"refused": 1, "calls": 130})
    assert [r.verdict for r in rows] == ["met", "met", "short"]
    assert t.short_deadline_row({"OK": 3, "DEADLINE_EXCEEDED": 197}, 0).verdict == "met"
    assert t.short_deadline_row({"OK": 3, "RESOURCE_EXHAUSTED": 1}, 0).verdict == "short"
    assert t.short_deadline_row({"OK": 200}, 1).verdict == "short"


def test_the_wall_of_a_call_follows_the_daemons_settings() -> None:
    assert t.answer_wall({}, 1.0) == pytest.approx(0.040)  # min(45, 40) ms
    assert t.answer_wall({}, 0.045) == pytest.approx(0.035)  # 45 ms less 10 ms headroom
    assert t.answer_wall({"IBEX_CONTEXT_DEADLINE_MS": "30"}, 1.0) == pytest.approx(0.030)


def test_render_names_every_verdict_and_the_missing_asyncio_implementation() -> None:
    rows = [
        t.Row("a <= 1", "0.5", 0.5, "met"),
        t.Row("b", "x", None, "-"),
        t.Row("c", "y", None, "short"),
    ]
    text = t.render(rows, {"median_ms": 20.0}, "title")
    assert "0.50x" in text and "1 of 2 targets met" in text
    assert text.splitlines()[-1] == t.NO_ASYNCIO_IMPLEMENTATION
    assert "median_ms" in text
