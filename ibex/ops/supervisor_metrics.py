"""What the supervisor of several workers exposes on ``/metrics``.

Each worker has its own registry; a scrape of one worker would see a fraction
of the traffic. prometheus_client's multiprocess mode solves this with one
mmap file per process and metric type in a shared directory:

1. The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` (systemd: ``/run/ibex``
   from ``RuntimeDirectory=ibex``) **before anything imports prometheus_client**
   and passes it to the workers' environment; prometheus_client chooses its
   value storage at import time. It calls `clear_multiprocess_dir` once before
   starting workers (stale files from a previous run would be summed in).
2. Workers create `Metrics()` and record as usual; they do not serve /metrics.
3. The supervisor runs ``metrics_http.serve_metrics(exposition_registry(), host, port)``;
   `exposition_registry` aggregates every worker's files at scrape time.
4. When a worker exits, the supervisor calls ``mark_process_dead(pid)`` so
   its in-flight gauge stops counting; its counters are kept (they are totals).

The supervisor's own series (`WorkerRestarts`, `WorkerReloads`, and the
``process_*`` series of every process, `ProcessMetrics`) are collectors on the
exposition registry, never values in the workers' files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ibex.ops.metrics import MULTIPROC_ENV

__all__ = [
    "RELOAD_RESULTS",
    "RESTART_REASONS",
    "ProcessMetrics",
    "WorkerReloads",
    "WorkerRestarts",
    "clear_multiprocess_dir",
    "exposition_registry",
    "mark_process_dead",
]

RESTART_REASONS: Final = ("exited", "unresponsive")
RELOAD_RESULTS: Final = ("done", "failed", "rejected")


def clear_multiprocess_dir(path: str | None = None) -> None:
    """Remove the previous run's value files; the supervisor calls it before spawning workers."""
    target = path or os.environ.get(MULTIPROC_ENV)
    if not target:
        return
    for file in Path(target).glob("*.db"):
        file.unlink(missing_ok=True)


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Forget a dead worker's live gauges (in-flight); its counters stay in the totals."""
    target = path or os.environ.get(MULTIPROC_ENV)
    if target:
        multiprocess.mark_process_dead(pid, target)


def exposition_registry(path: str | None = None) -> CollectorRegistry:
    """A registry aggregating every worker's values, for the supervisor's /metrics."""
    target = path or os.environ.get(MULTIPROC_ENV)
    if not target:
        raise RuntimeError(f"{MULTIPROC_ENV} is not set; serve Metrics().registry instead")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=target)
    return registry


class _CountsByLabel(Collector):
    """A counter of the supervisor's own, one label, kept as plain counts.

    A collector rather than a `Counter`: the supervisor may have imported
    prometheus_client before choosing multiprocess mode, and its own value
    must not also appear through the workers' files. Register it on the
    exposition registry; `inc` counts one event.
    """

    def __init__(self, name: str, documentation: str, label: str, values: Iterable[str]) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.counts = dict.fromkeys(values, 0)

    def inc(self, value: str) -> None:
        self.counts[value] = self.counts.get(value, 0) + 1

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, count in self.counts.items():
            family.add_metric([value], count)
        yield family


class WorkerRestarts(_CountsByLabel):
    """``ibex_worker_restarts_total{reason}``: `inc("exited")` or `inc("unresponsive")`."""

    def __init__(self) -> None:
        super().__init__(
            "ibex_worker_restarts",
            "Workers restarted by the supervisor, by reason.",
            "reason",
            RESTART_REASONS,
        )


class WorkerReloads(_CountsByLabel):
    """``ibex_worker_reloads_total{result}``: `inc` with one of `RELOAD_RESULTS`."""

    def __init__(self) -> None:
        super().__init__(
            "ibex_worker_reloads", "Reloads (SIGHUP) by the supervisor, by result.", "result",
            RELOAD_RESULTS,
        )  # fmt: skip


ProcessSource = Callable[[], Iterable[tuple[str, int]]]


class ProcessMetrics(Collector):
    """The standard ``process_*`` series of the supervisor and of every worker.

    In multiprocess mode the scraped process is the supervisor, whose own CPU
    says nothing about the workers that serve; and prometheus_client's
    process collector reads one process only. This one reads ``/proc/<pid>``
    of each process `processes` names (``(name, pid)`` pairs, read at every
    scrape) through that collector, and labels each sample with ``process``
    and ``pid``. A process that is gone by the time it is read is left out.
    """

    def __init__(self, processes: ProcessSource, proc: str = "/proc") -> None:
        self.processes = processes
        self._pid = 0
        self._reader = ProcessCollector(pid=lambda: self._pid, proc=proc, registry=None)

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, pid in self.processes():
            self._pid = pid
            for family in self._reader.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type)
                    families[family.name] = merged
                for sample in family.samples:
                    merged.add_sample(sample.name, {"process": name, "pid": str(pid)}, sample.value)
        return list(families.values())
