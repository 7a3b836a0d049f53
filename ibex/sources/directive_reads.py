"""Reads of the keys a directive cache missed: once per key, batched, in the cache's own tasks.

A miss is read once, however many calls wait for it: every call that misses on a
key queued or in flight waits for that one read (each no longer than its own
branch allows), and its answer is stored for the next (`store`). Keys missed
before a read takes them are read with it, in one `get_directives` call where the
source offers one (one MGET on Redis): a burst of calls for different agents costs
one round trip and one set of loop crossings, not one each, and its answers wake
their callers as soon as the source has them. A source that offers
`start_directives` (Redis) starts that read on its I/O side at once, ahead of the
Trio work of the calls that queued it (see `DirectiveReads._start_read`). A read
runs under `refresh_timeout` in a task of its own, so it is never cut by a
caller's branch timeout: on a saturated loop a Redis GET rarely makes a 5 ms
branch, and a cut GET closes its connection, so without this an expired entry
would stay expired and every call for that agent would reconnect.
`ibex.sources.directive_cache` decides what is a miss.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.base import (
    Answers,
    BatchRead,
    DirectiveOrError,
    DirectiveSource,
    Wanted,
    batch_reader,
)

__all__ = ["BatchStart", "DirectiveReads", "Refresh", "Started", "batch_starter"]

log = logging.getLogger(__name__)

#: Stores what a read found: (key, the directive or None, when it was read).
Store = Callable[[tuple[str, str], Directive | None, float], None]


class Refresh:
    """One read of a key queued or in flight: every call that misses on that key waits for it."""

    __slots__ = ("directive", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.directive: Directive | None = None
        self.error = ""


# A started read's wait: Trio-async, the answers in the order `take` gave the keys.
Started = Callable[[], Awaitable[list[DirectiveOrError]]]


class BatchStart(Protocol):
    """A source's `start_directives(take, on_answers)`: start one round trip now, on the
    I/O side of the loop, for the keys `take()` returns when that side first runs; the
    Trio-async wait it returns gives the answers (and cancels the read when cancelled)."""

    def __call__(self, take: Callable[[], list[Wanted]], on_answers: Answers) -> Started: ...


def batch_starter(source: DirectiveSource) -> BatchStart | None:
    """The source's `start_directives` when it reads keys together (`batch_reader`), else None."""
    start: BatchStart | None = getattr(source, "start_directives", None)
    return start if batch_reader(source) is not None else None


class _Batch:
    """The keys a started read took when its I/O side first ran, and their reads."""

    __slots__ = ("keys", "reads", "taken")

    def __init__(self) -> None:
        self.taken = False
        self.keys: list[tuple[str, str]] = []
        self.reads: list[Refresh] = []


class DirectiveReads:
    """The reads of missed keys queued or in flight, in tasks of a nursery of its own
    (between `start` and `stop`); `store` keeps each answer."""

    def __init__(
        self,
        source: DirectiveSource,
        refresh_timeout: float,
        store: Store,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.refresh_timeout = refresh_timeout
        self._store = store
        self._clock = clock
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        # Keys queued or in flight, and the queued ones that no read task has taken yet.
        self._reading: dict[tuple[str, str], Refresh] = {}
        self._queued: dict[tuple[str, str], str] = {}  # key -> the version its caller named

    async def start(self) -> None:
        """Open the nursery the reads run in (`stop` closes it)."""
        self._stack = contextlib.AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())

    async def stop(self) -> None:
        """Cancel the reads still in flight and close their nursery."""
        nursery, stack = self._nursery, self._stack
        self._nursery = self._stack = None
        if nursery is not None and stack is not None:
            nursery.cancel_scope.cancel()
            await stack.aclose()

    @property
    def open(self) -> bool:
        """Entered: a miss is read in a task of its own; else in its caller's task."""
        return self._nursery is not None

    def reading(self, key: tuple[str, str]) -> Refresh | None:
        """The read of `key` queued or in flight, if any."""
        return self._reading.get(key)

    def __len__(self) -> int:
        """Keys queued or in flight."""
        return len(self._reading)

    def queue(self, key: tuple[str, str], version: str) -> Refresh:
        """Queue a read of `key`; the first key queued starts the read of them all."""
        assert self._nursery is not None
        read = self._reading[key] = Refresh()
        self._queued[key] = version
        if len(self._queued) == 1:
            self._start_read()
        return read

    def _start_read(self) -> None:
        """Start the read of the keys queued from now until its I/O side first runs.

        With a source that can start it there (`start_directives`: Redis's asyncio
        side), the round trip is sent in the loop's next round of I/O callbacks,
        ahead of the Trio tasks that the calls queued behind it start (each call's
        crossing, with its branches' set-up): a Trio task of the cache's would run
        in a random order among those, behind all five crossings half the time.
        The cache's own Trio task still owns the read: it waits for it under
        `refresh_timeout` and cancels it when it ends first.
        """
        assert self._nursery is not None
        start = batch_starter(self.source)
        if start is not None:
            batch = _Batch()
            try:
                wait = start(
                    functools.partial(self._take, batch),
                    functools.partial(self._deliver_batch, batch),
                )
            except SourceError:
                pass  # e.g. the source is closed: the read below says so to every waiter
            else:
                self._nursery.start_soon(self._read_started, batch, wait)
                return
        self._nursery.start_soon(self._read_queued)

    def _take(self, batch: _Batch) -> list[Wanted]:
        """The queued keys, for the started read `batch` (once): later keys start another."""
        if batch.taken:
            return []
        batch.taken = True
        queued, self._queued = self._queued, {}
        batch.keys = list(queued)
        batch.reads = [self._reading[key] for key in batch.keys]
        return [(org, agent, version) for (org, agent), version in queued.items()]

    def _deliver_batch(self, batch: _Batch, answers: list[DirectiveOrError]) -> None:
        self._deliver(batch.keys, batch.reads, answers)

    async def _read_started(self, batch: _Batch, wait: Started) -> None:
        """Wait for a started read under `refresh_timeout`; never raises. A read that ends
        before its I/O side took the keys takes them here, and fails them with its error."""

        def reads() -> list[Refresh]:
            self._take(batch)
            return batch.reads

        async def work() -> None:
            answers = await wait()
            self._deliver_batch(batch, answers)

        try:
            await self._guarded(reads, work)
        finally:
            if not batch.taken:  # a source that answered without taking them: no key stays queued
                self._fail(reads, "the directive read ended without its keys")
            for key, read in zip(batch.keys, batch.reads, strict=True):
                self._finish(key, read)

    async def _read_queued(self) -> None:
        """Read every key queued before this task ran; never raises.

        With a source that reads several keys in one round trip (`batch_reader`),
        they are one read: keys missed together (a burst of calls for different
        agents) then cost one round trip and one set of loop crossings, instead of
        one each. Otherwise each key is its own read, in a task of its own, so a
        key whose server hangs holds no other key's callers.
        """
        assert self._nursery is not None
        queued, self._queued = self._queued, {}
        many = batch_reader(self.source)
        if many is not None:
            await self._read_batch(many, queued)
            return
        *others, last = queued.items()
        for key, version in others:
            self._nursery.start_soon(self._read_one, key, version)
        await self._read_one(*last)

    async def _read_one(self, key: tuple[str, str], version: str) -> None:
        """Read `key` for every waiter, under `refresh_timeout`; never raises."""
        read = self._reading[key]
        try:
            await self._guarded(
                lambda: [read], functools.partial(self._store_one, key, version, read)
            )
        finally:
            self._finish(key, read)

    async def _store_one(self, key: tuple[str, str], version: str, read: Refresh) -> None:
        read.directive = await self.source.get_directive(key[0], key[1], version)
        self._store(key, read.directive, self._clock())

    async def _read_batch(self, many: BatchRead, queued: dict[tuple[str, str], str]) -> None:
        """Read the queued keys in one call for every waiter, under `refresh_timeout`."""
        keys = list(queued)
        reads = [self._reading[key] for key in keys]
        try:
            await self._guarded(
                lambda: reads, functools.partial(self._store_batch, many, queued, reads)
            )
        finally:
            for key, read in zip(keys, reads, strict=True):
                self._finish(key, read)

    async def _store_batch(
        self, many: BatchRead, queued: dict[tuple[str, str], str], reads: list[Refresh]
    ) -> None:
        keys = list(queued)

        def deliver(answers: list[DirectiveOrError]) -> None:
            self._deliver(keys, reads, answers)

        wanted = [(org, agent, version) for (org, agent), version in queued.items()]
        self._deliver(keys, reads, await many(wanted, on_answers=deliver))

    def _deliver(
        self, keys: list[tuple[str, str]], reads: list[Refresh], answers: list[DirectiveOrError]
    ) -> None:
        """Store the answers and wake their waiters, once (the source may tell them from
        the I/O side before its call returns: the waiters need not wait for the return)."""
        now = self._clock()
        for key, read, answer in zip(keys, reads, answers, strict=True):
            if read.done.is_set():
                continue
            if isinstance(answer, SourceError):
                read.error = str(answer)
            else:
                read.directive = answer
                self._store(key, answer, now)
            self._finish(key, read)

    def _finish(self, key: tuple[str, str], read: Refresh) -> None:
        if self._reading.get(key) is read:
            del self._reading[key]
        read.done.set()

    async def _guarded(
        self, reads: Callable[[], list[Refresh]], work: Callable[[], Awaitable[None]]
    ) -> None:
        """`work()` under `refresh_timeout`; any failure becomes the error of `reads()`."""
        timeout = self.refresh_timeout
        try:
            with trio.fail_after(timeout):
                await work()
        except trio.TooSlowError:
            self._fail(reads, f"no answer within {timeout * 1000:.0f}ms")
        except trio.Cancelled:
            # The cache is closing: a caller still waiting must not take "no directive".
            self._fail(reads, "the directive cache closed before its read finished")
            raise
        except SourceError as exc:
            self._fail(reads, str(exc))
        except Exception as exc:  # contained as a branch contains it: an error, logged
            self._fail(reads, f"unexpected {type(exc).__name__}")
            log.exception("directive_refresh_failed")

    @staticmethod
    def _fail(reads: Callable[[], list[Refresh]], error: str) -> None:
        for read in reads():
            if not read.done.is_set():  # an answer already delivered stands
                read.directive, read.error = None, error
