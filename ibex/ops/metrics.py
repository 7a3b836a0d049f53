"""Prometheus metrics for the daemon: the definitions and the `Metrics` recording API.

The ``/metrics`` listener that exposes them is `ibex.ops.metrics_http`; with
several workers the supervisor serves every worker's values together
(`ibex.ops.supervisor_metrics`, which also holds its own series).

Every metric, its type, labels and meaning: the table in docs/operations.md
("Metrics"), which tests/unit/test_metrics_table.py checks against this module
and `ibex.ops.supervisor_metrics`.

With a single process and no ``PROMETHEUS_MULTIPROC_DIR`` the process serves
its own ``Metrics().registry``, and what `observe_assembly` records is held in
plain numbers and folded into the collectors as the registry is collected
(`ibex.ops.metrics_held`). The token-cache counters read the tokenizer's
own counters at scrape time in that mode; in multiprocess mode a collector
cannot run in the worker at scrape time, so `observe_assembly` copies the
tokenizer's deltas into ordinary counters instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    values,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ibex.assembly.structs import (
    AssemblyResult,
    BranchSource,
    BranchStatus,
    DegradationLevel,
    PackPath,
    Stage,
)
from ibex.ops.metrics_held import Held

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

SOURCES: Final[tuple[str, ...]] = get_args(BranchSource)
STATUSES: Final[tuple[str, ...]] = get_args(BranchStatus)
STAGES: Final[tuple[str, ...]] = (*(s.value for s in Stage), "total")
LEVELS: Final[tuple[str, ...]] = get_args(DegradationLevel)
PACK_PATHS: Final[tuple[str, ...]] = get_args(PackPath)
SHED_REASONS: Final = ("in_flight", "queue", "cpu", "org", "threads")
#: Why the daemon closed (or refused) a gRPC connection: the caps and timeouts of
#: `ibex.service.edge.connections` and the HTTP/2 floods of `ibex.service.edge.frame_guard`.
CONNECTION_CLOSE_REASONS: Final = (
    "refused_cap",
    "refused_rate",
    "evicted",
    "auth_timeout",
    "idle",
    "rapid_reset",
    "reset_flood",
    "ping_flood",
    "settings_flood",
    "empty_frames",
    "empty_headers",
    "priority_flood",
    "unknown_frames",
    "unread_output",
    "continuation_flood",
    "too_many_streams",
    "protocol_error",
)
FEEDBACK_OUTCOMES: Final = (
    "recorded", "invalid", "denied", "rejected", "unavailable", "deadline", "shed", "error",
)  # fmt: skip

# Stage work is sub-millisecond to tens of ms; branch latency is bounded by the
# retrieval wall (~45 ms) but a misconfigured wall should still land in a bucket.
STAGE_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)
BRANCH_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.045, 0.075, 0.1, 0.25)
REQUEST_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
# The server's whole time per call, HEADERS read to last byte written: answers cut
# at the retrieval wall (40 ms by default) land just above it, so the region from
# 38 to 50 ms has 1 ms buckets and the time after the wall can be read off them.
ANSWER_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.035,
    *(n / 1000 for n in range(38, 51)),
    0.055, 0.06, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
TOKEN_BUCKETS: Final = tuple(float(2**i) for i in range(6, 18))  # 64 .. 131072
RATIO_BUCKETS: Final = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
MEMORY_BUCKETS: Final = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)

_STAGE_FIELDS: Final = {**{s.value: s.field for s in Stage}, "total": "total_ms"}

TokenCacheSource = Callable[[], tuple[int, int]]


def multiprocess_dir() -> str | None:
    """The multiprocess directory when multiprocess mode is active in this process.

    Raises RuntimeError when the variable is set but prometheus_client was
    imported before it was, because every value would then silently stay
    in-process and the aggregate would read zeros.
    """
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return None
    if values.ValueClass is values.MutexValue:
        raise RuntimeError(
            f"{MULTIPROC_ENV} was set after prometheus_client was imported; "
            "set it in the environment before the process starts"
        )
    return path


class _TokenCacheCollector(Collector):
    """Reads the tokenizer's own hit/miss counters at scrape time (single-process mode)."""

    def __init__(self) -> None:
        self.source: TokenCacheSource | None = None

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        if self.source is None:
            return
        hits, misses = self.source()
        yield CounterMetricFamily("ibex_token_cache_hits", "Token-count cache hits.", value=hits)
        yield CounterMetricFamily(
            "ibex_token_cache_misses", "Token-count cache misses.", value=misses
        )


class Metrics:
    """Every metric the daemon records, on a registry of its own (so tests can make fresh ones).

    Recording never raises into a request for a well-formed result; call it
    after the response is built.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.multiprocess = multiprocess_dir() is not None
        r = self.registry
        # Single process: `observe_assembly`'s updates are held and folded in as the
        # registry collects (`Held`, registered first so it runs first).
        self._held = None if self.multiprocess else Held()
        if self._held is not None:
            r.register(self._held)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        # Each outcome counter sits beside the histogram of the same events' durations.
        self.requests = counter(
            "ibex_grpc_requests", "Finished RPCs by gRPC status code.", "method", "code"
        )
        self.request_duration = histogram(
            "ibex_grpc_request_duration_seconds", "RPC handling time.", REQUEST_BUCKETS, "method"
        )
        self.answer_seconds = histogram(
            "ibex_answer_seconds",
            "Server-side time per call: its HEADERS read to its answer's last byte written.",
            ANSWER_BUCKETS,
            "method",
        )
        self.in_flight_requests = Gauge(
            "ibex_in_flight_requests",
            "RPCs being handled now.",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.shed_requests = counter(
            "ibex_shed_requests", "RPCs refused by admission, by reason.", "reason"
        )
        self.connections_closed = counter(
            "ibex_connections_closed",
            "gRPC connections closed or refused by the daemon before their peer left, by reason.",
            "reason",
        )
        self.branch_outcomes = counter(
            "ibex_branch_outcomes", "Retrieval branches by source and outcome.", "source", "status"
        )
        self.branch_latency = histogram(
            "ibex_branch_latency_seconds",
            "Retrieval branch latency, any outcome.",
            BRANCH_BUCKETS,
            "source",
        )
        self.stage_duration = histogram(
            "ibex_stage_duration_seconds", "Pipeline stage duration.", STAGE_BUCKETS, "stage"
        )
        self.degradation = counter("ibex_degradation", "Assemblies by degradation level.", "level")
        self.pack_path = counter("ibex_pack_path", "Assemblies by packer path.", "path")
        self.tokens_used = histogram(
            "ibex_context_tokens_used", "Tokens in the assembled context.", TOKEN_BUCKETS
        )
        self.budget_utilization = histogram(
            "ibex_context_budget_utilization_ratio", "tokens_used / budget ceiling.", RATIO_BUCKETS
        )
        self.memories_included = histogram(
            "ibex_context_memories_included", "Memories packed into one context.", MEMORY_BUCKETS
        )
        self.tenant_filtered = counter(
            "ibex_tenant_filtered_hits", "Memory hits dropped for another org/agent."
        )
        self.history_dropped = counter(
            "ibex_history_messages_dropped",
            "Oldest history messages left out so the rest fits the window.",
        )
        self.feedback = counter(
            "ibex_feedback", "RecordMemoryFeedback calls by outcome.", "outcome"
        )
        self.feedback_retries = counter(
            "ibex_feedback_retries", "Feedback attempts repeated with the same idempotency key."
        )

        self.dependency_up = Gauge(
            "ibex_dependency_up",
            "Whether the dependency answered its last probe (1) or not (0).",
            ["dependency"],
            multiprocess_mode="livemin",
            registry=r,
        )

        self._token_source: TokenCacheSource | None = None
        self._token_seen = (0, 0)
        self._token_collector: _TokenCacheCollector | None = None
        self._token_hits: Counter | None = None
        self._token_misses: Counter | None = None
        if self.multiprocess:
            self._token_hits = counter("ibex_token_cache_hits", "Token-count cache hits.")
            self._token_misses = counter("ibex_token_cache_misses", "Token-count cache misses.")
        else:
            self._token_collector = _TokenCacheCollector()
            r.register(self._token_collector)

        # Children for the known label values, created now (so series exist at
        # zero) and kept: a `.labels()` lookup per observation is most of the cost.
        hold_count, hold = self._hold_count, self._hold_histogram
        self._outcome = {
            (src, st): hold_count(self.branch_outcomes.labels(src, st))
            for src in SOURCES
            for st in STATUSES
        }
        self._latency = {src: hold(self.branch_latency.labels(src)) for src in SOURCES}
        self._stage = {stage: hold(self.stage_duration.labels(stage)) for stage in STAGES}
        self._level = {level: hold_count(self.degradation.labels(level)) for level in LEVELS}
        self._path = {path: hold_count(self.pack_path.labels(path)) for path in PACK_PATHS}
        self._tokens_used = hold(self.tokens_used)
        self._budget_utilization = hold(self.budget_utilization)
        self._memories_included = hold(self.memories_included)
        self._tenant_filtered = hold_count(self.tenant_filtered)
        self._history_dropped = hold_count(self.history_dropped)
        self._shed = {reason: self.shed_requests.labels(reason) for reason in SHED_REASONS}
        self._closed = {
            reason: self.connections_closed.labels(reason) for reason in CONNECTION_CLOSE_REASONS
        }
        self._feedback = {o: self.feedback.labels(o) for o in FEEDBACK_OUTCOMES}
        # (method, code) -> label children: `labels()` takes a lock and validates on every
        # call, a cost the overload path pays per refusal. Methods are the service's own
        # names (callers map anything else to one label), codes the gRPC status names,
        # so this stays a few dozen entries.
        self._request_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._answer_children: dict[str, Any] = {}

    def _hold_count(self, child: Any) -> Any:
        """`child`, or its held stand-in (single process)."""
        return child if self._held is None else self._held.count(child)

    def _hold_histogram(self, child: Any) -> Any:
        """`child`, or its held stand-in (single process, known internals)."""
        return child if self._held is None else self._held.histogram(child)

    # ------------------------------------------------------------------ recording

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC: short method name, gRPC status name, handling time."""
        children = self._request_children.get((method, code))
        if children is None:
            children = (self.requests.labels(method, code), self.request_duration.labels(method))
            self._request_children[method, code] = children
        children[0].inc()
        children[1].observe(max(0.0, seconds))

    def observe_answer(self, method: str, seconds: float) -> None:
        """One answered call (refusals too): short method name, HEADERS to last byte written."""
        child = self._answer_children.get(method)
        if child is None:
            child = self._answer_children[method] = self.answer_seconds.labels(method)
        child.observe(max(0.0, seconds))

    def observe_feedback(self, outcome: str) -> None:
        """One finished RecordMemoryFeedback call; `outcome` is one of `FEEDBACK_OUTCOMES`.

        Retries are counted as they start (`feedback_retries.inc`), whatever follows.
        """
        _child(self._feedback, self.feedback, outcome).inc()

    def set_dependency_up(self, dependency: str, up: bool) -> None:
        """A dependency's state changed (`ibex.service.dependencies`)."""
        self.dependency_up.labels(dependency).set(1 if up else 0)

    def in_flight(self) -> AbstractContextManager[None]:
        """Count the enclosed block as an in-flight request, however it ends."""
        return self.in_flight_requests.track_inprogress()

    def connection_closed(self, reason: str) -> None:
        """One connection closed or refused; `reason` is one of `CONNECTION_CLOSE_REASONS`."""
        _child(self._closed, self.connections_closed, reason).inc()

    def shed(self, reason: str) -> None:
        """One request refused by admission; `reason` is one of `SHED_REASONS`."""
        _child(self._shed, self.shed_requests, reason).inc()

    def observe_assembly(
        self, result: AssemblyResult, *, stage_seconds: Mapping[str, float] | None = None
    ) -> None:
        """Record everything one assembly reports about itself.

        `result.metrics` carries whole milliseconds (the wire format), so
        sub-millisecond stages land in the first bucket; pass precise
        `stage_seconds` (keys from `STAGES`) to override any of them.
        """
        for branch in result.branches:
            _child(self._outcome, self.branch_outcomes, branch.source, branch.status).inc()
            latency = _child(self._latency, self.branch_latency, branch.source)
            latency.observe(max(0.0, branch.latency_ms) / 1000)
        precise = stage_seconds or {}
        if precise and not precise.keys() <= self._stage.keys():
            unknown = sorted(set(precise) - set(STAGES))
            raise ValueError(f"unknown stages {unknown}; expected some of {STAGES}")
        timings = result.metrics
        for stage, field in _STAGE_FIELDS.items():
            seconds = precise.get(stage)
            if seconds is None:
                seconds = getattr(timings, field) / 1000
            self._stage[stage].observe(max(0.0, seconds))
        _child(self._level, self.degradation, result.degradation_level).inc()
        _child(self._path, self.pack_path, result.pack.path).inc()
        self._tokens_used.observe(result.tokens_used)
        ceiling = result.budget.ceiling
        if ceiling > 0:
            self._budget_utilization.observe(result.tokens_used / ceiling)
        self._memories_included.observe(len(result.memories_used))
        if result.pack.tenant_filtered:
            self._tenant_filtered.inc(result.pack.tenant_filtered)
        if result.budget.messages_dropped:
            self._history_dropped.inc(result.budget.messages_dropped)
        self.sync_token_cache()

    # ------------------------------------------------------------------ token cache

    def set_token_cache_source(self, source: TokenCacheSource) -> None:
        """Where cumulative (hits, misses) of the token-count cache come from.

        For `ibex.assembly.tokens.Tokenizers`: ``lambda: (sum(i.hits for i in
        t.cache_info().values()), sum(i.misses for i in t.cache_info().values()))``.
        The callable must be cheap and must not raise.
        """
        self._token_source = source
        if self._token_collector is not None:
            self._token_collector.source = source
        else:
            self._token_seen = (0, 0)
            self.sync_token_cache()

    def sync_token_cache(self) -> None:
        """Multiprocess mode: copy the tokenizer's new hits/misses into this process's counters."""
        if self._token_source is None or self._token_hits is None or self._token_misses is None:
            return
        hits, misses = self._token_source()
        seen_hits, seen_misses = self._token_seen
        # A counter that went backwards (a new tokenizer) restarts from its value.
        self._token_hits.inc(hits - seen_hits if hits >= seen_hits else hits)
        self._token_misses.inc(misses - seen_misses if misses >= seen_misses else misses)
        self._token_seen = (hits, misses)


def _child(children: Mapping[Any, Any], metric: Any, *labels: str) -> Any:
    """The labelled child: the one made at start for a known value (a `labels()` call
    takes a lock and validates, most of an observation's cost), else a lookup, so an
    unexpected value is still counted."""
    child = children.get(labels[0] if len(labels) == 1 else labels)
    return metric.labels(*labels) if child is None else child
