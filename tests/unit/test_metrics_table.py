"""docs/operations.md's metrics table names every series the daemon and its supervisor
expose, with the type and labels they have (and nothing they do not)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from ibex.ops.metrics import Metrics
from ibex.ops.supervisor_metrics import ProcessMetrics, WorkerReloads, WorkerRestarts

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
_ROW = re.compile(r"^\| `(?P<name>[a-z_]+)` \| (?P<type>\w+) \|(?P<labels>[^|]*)\|")

Series = dict[str, tuple[str, frozenset[str]]]


def documented() -> Series:
    """The rows of the "### Metrics" section: name -> (type, labels)."""
    text = PAGE.read_text()
    section = text.split("\n### Metrics\n", 1)[1].split("\n#", 1)[0]
    rows: Series = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            assert match["name"] not in rows, f"{match['name']} is listed twice"
            labels = frozenset(re.findall(r"`(\w+)`", match["labels"]))
            rows[match["name"]] = (match["type"], labels)
    return rows


def exposed(collectors: Iterable[Collector]) -> Series:
    """What a scrape of `collectors` shows: name (counters with `_total`) -> (type, labels)."""
    found: Series = {}
    for collector in collectors:
        for family in collector.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {key for s in family.samples for key in s.labels if key != "le"}
            found[name] = (family.type, frozenset(labels))
    return found


def daemon_metrics() -> CollectorRegistry:
    """A worker's registry with one event of each labelled kind, so every series shows."""
    metrics = Metrics(CollectorRegistry())
    metrics.set_token_cache_source(lambda: (0, 0))
    metrics.observe_request("AssembleContext", "OK", 0.01)
    metrics.observe_answer("AssembleContext", 0.01)
    metrics.observe_feedback("recorded")
    metrics.set_dependency_up("redis", True)
    return metrics.registry


def test_the_table_lists_every_series_with_its_type_and_labels() -> None:
    supervisor = [
        WorkerRestarts(),
        WorkerReloads(),
        ProcessMetrics(lambda: [("supervisor", os.getpid())]),
    ]
    have = exposed([daemon_metrics(), *supervisor])
    table = documented()
    assert sorted(have) == sorted(table)
    for name, (kind, labels) in have.items():
        assert table[name] == (kind, labels), name


def test_the_table_is_read_from_the_page() -> None:
    table = documented()
    assert table["ibex_grpc_requests_total"] == ("counter", frozenset({"method", "code"}))
    assert table["ibex_in_flight_requests"] == ("gauge", frozenset())
    assert table["process_open_fds"] == ("gauge", frozenset({"process", "pid"}))
