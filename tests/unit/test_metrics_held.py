"""Held metric updates (single process): what a scrape reads is what observing each value
in turn through prometheus_client gives, bucket for bucket and to the last bit of the sum."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ibex.ops.metrics import STAGE_BUCKETS, Metrics
from ibex.ops.metrics_held import Held, HeldCount, HeldHistogram

amounts = st.one_of(
    st.floats(min_value=0.0, max_value=1.0),
    st.sampled_from([0.0, 0.0001, 0.00025, 0.25, 1e9, math.inf, math.nan]),
    st.integers(min_value=0, max_value=200_000),
)


def _exposed(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(amounts, st.booleans()), max_size=60))
def test_a_held_histogram_reads_as_one_observed_value_by_value(
    steps: list[tuple[float, bool]],
) -> None:
    """`steps`: (amount, scrape after it); both registries are read after every scrape."""
    direct_registry, held_registry = CollectorRegistry(), CollectorRegistry()
    held = Held()
    held_registry.register(held)
    direct = Histogram("h", "h", ["s"], buckets=STAGE_BUCKETS, registry=direct_registry)
    kept = Histogram("h", "h", ["s"], buckets=STAGE_BUCKETS, registry=held_registry)
    child = HeldHistogram(kept.labels("x"))
    held.held.append(child)
    series = direct.labels("x")
    for amount, scrape in steps:
        series.observe(amount)
        child.observe(amount)
        if scrape:
            assert _exposed(held_registry) == _exposed(direct_registry)
    assert _exposed(held_registry) == _exposed(direct_registry)


def test_a_held_count_reads_as_its_increments() -> None:
    direct_registry, held_registry = CollectorRegistry(), CollectorRegistry()
    held = Held()
    held_registry.register(held)
    direct = Counter("c", "c", registry=direct_registry)
    count = HeldCount(Counter("c", "c", registry=held_registry))
    held.held.append(count)
    for n in (1, 1, 5, 0, 3):
        direct.inc(n)
        count.inc(n)
    assert _exposed(held_registry) == _exposed(direct_registry)
    assert _exposed(held_registry) == _exposed(direct_registry)  # folded once, not twice


def test_the_daemon_metrics_hold_assembly_updates_until_collected() -> None:
    metrics = Metrics()
    child = metrics.degradation.labels("L2")
    metrics._level["L2"].inc()
    assert child._value.get() == 0  # held, not yet in the collector
    value = metrics.registry.get_sample_value("ibex_degradation_total", {"level": "L2"})
    assert value == 1
