"""A single process's metric updates, held in plain numbers and folded in at collection.

What `Metrics.observe_assembly` records is about twenty updates an answer, each a
lock and a check in prometheus_client. With one process (no
``PROMETHEUS_MULTIPROC_DIR``) the registry is collected in the same process, so
those updates are held here and added to the collectors as the registry is
collected (`Held`, registered ahead of them): every scrape reads the values it
would have read had each been observed in turn. In multiprocess mode the values
live in files the supervisor reads, and nothing is held.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

__all__ = ["Held", "HeldCount", "HeldHistogram", "holdable"]


class HeldCount:
    """A counter child's increments, held until the next collection."""

    __slots__ = ("child", "n")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.n = 0

    def inc(self, amount: int = 1) -> None:
        self.n += amount

    def fold(self) -> None:
        if self.n:
            n, self.n = self.n, 0
            self.child.inc(n)


class HeldHistogram:
    """A histogram child's observations, held as bucket counts and a running sum.

    The sum is the child's own, continued in the order of the observations, and
    written back whole: the same float as observing each value in turn. Only
    `observe_assembly` writes these children.
    """

    __slots__ = ("bounds", "child", "counts", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds = tuple(child._upper_bounds)  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.total = child._sum.get()

    def observe(self, amount: float) -> None:
        # The first bound >= amount: the bucket prometheus_client's loop picks.
        if amount == amount:  # a NaN lands in no bucket, as there
            self.counts[bisect_left(self.bounds, amount)] += 1
        self.total += amount

    def fold(self) -> None:
        counts = self.counts
        if not any(counts) and self.total == self.child._sum.get():
            return
        self.counts = [0] * len(counts)
        self.child._sum.set(self.total)
        for bucket, n in zip(self.child._buckets, counts, strict=True):
            if n:
                bucket.inc(n)


def holdable(child: Any) -> bool:
    """Whether a histogram child has the private parts `HeldHistogram` writes
    (prometheus_client 0.2x's): else its updates go through `observe`."""
    try:
        return (
            len(child._upper_bounds) == len(child._buckets)
            and child._upper_bounds[-1] == float("inf")
            and callable(child._sum.set)
            and isinstance(child._sum.get(), float)
        )
    except (AttributeError, TypeError):
        return False


class Held(Collector):
    """Registered ahead of the metrics: folds the held updates into them, yields nothing."""

    def __init__(self) -> None:
        self.held: list[HeldCount | HeldHistogram] = []

    def count(self, child: Any) -> HeldCount:
        """A held stand-in for the counter `child`, folded at each collection."""
        held = HeldCount(child)
        self.held.append(held)
        return held

    def histogram(self, child: Any) -> Any:
        """A held stand-in for the histogram `child`, or `child` itself when its internals
        are not the ones `HeldHistogram` writes."""
        if not holdable(child):
            return child
        held = HeldHistogram(child)
        self.held.append(held)
        return held

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        for h in self.held:
            h.fold()
        return ()
