"""An in-process directive cache: a DirectiveSource that wraps another, validated by version.

A Redis GET costs two loop crossings and a round trip on every answer, for a
value that changes rarely. The caller names the
version it expects (`directive_version_id`): a cached envelope with that
version is exactly what Redis would return, so it is served without a round
trip, but only for `max_age` seconds after it was read: the proxy revokes a
directive by deleting or replacing its key, and a version the caller still
names must stop being served soon after (revalidation costs one GET per agent
per `max_age`). Without a version, an entry serves for a short TTL. A miss, a
version mismatch or an expired entry goes to the source, and its answer
replaces the entry. Entries are bounded in number and in bytes (LRU); an envelope larger
than a fraction of the byte bound is not cached at all. The key is the
canonical (org_id, agent_id) pair, the same as the Redis key's parts, so an
entry can only ever answer its own tenant.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol

import msgspec
import trio

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.base import (
    Answer,
    Answers,
    BatchRead,
    DirectiveAnswer,
    DirectiveOrError,
    DirectiveSource,
    Wanted,
    batch_reader,
)
from ibex.sources.directive_cache_config import DirectiveCacheConfig as DirectiveCacheConfig

log = logging.getLogger(__name__)

_ENTRY_OVERHEAD = 256  # key strings, the Directive struct, the dict slot


class _Refresh:
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
        self.reads: list[_Refresh] = []


class _Entry(msgspec.Struct):
    directive: Directive | None
    fetched: float
    size: int


def _size(directive: Directive | None) -> int:
    if directive is None:
        return _ENTRY_OVERHEAD
    return _ENTRY_OVERHEAD + 4 * len(directive.content) + len(directive.version_id or "")


class DirectiveCache:
    """Answers directive lookups from memory when the version (or the TTL) allows.

    A decorator: it is a DirectiveSource over any DirectiveSource, and offers the
    optional `cached` method, so retrieval serves a hit without starting a task.

    Entered with `async with`, misses are read once per key in a task the cache
    owns, under `refresh_timeout`, and every caller missing on that key waits for
    that one read (each no longer than its own branch allows). Keys missed before
    the read takes them are read with it, in one `get_directives` call where the
    source offers one (one MGET on Redis): a burst of calls for different agents
    costs one round trip and one set of loop crossings, not one each, and its
    answers wake their callers as soon as the source has them. A source that offers
    `start_directives` (Redis) starts that read on its I/O side at once, ahead of
    the Trio work of the calls that queued it (see `_start_read`). `prefetch` queues
    a call's read as soon as the call is known, before its own work. A read is then never
    cut by a caller's branch timeout: on a saturated loop a Redis GET rarely makes a
    5 ms branch, and a cut GET closes its connection, so without this an expired
    entry would stay expired, every call for that agent would reconnect, and the
    answers would go without their directive. Revocation still takes effect within
    `max_age` plus `refresh_timeout`. Not entered, a miss reads in the caller's task.
    """

    def __init__(
        self,
        source: DirectiveSource,
        config: DirectiveCacheConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        # Keys queued or in flight, and the queued ones that no read task has taken yet.
        self._reading: dict[tuple[str, str], _Refresh] = {}
        self._queued: dict[tuple[str, str], str] = {}  # key -> the version its caller named

    async def __aenter__(self) -> DirectiveCache:
        self._stack = contextlib.AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Cancels the reads still in flight; closes nothing else (`aclose` does)."""
        nursery, stack = self._nursery, self._stack
        self._nursery = self._stack = None
        if nursery is not None and stack is not None:
            nursery.cancel_scope.cancel()
            await stack.aclose()

    def __len__(self) -> int:
        return len(self._entries)

    def recent(self, limit: int) -> list[tuple[str, str]]:
        """The (org_id, agent_id) keys of the `limit` entries used last, the latest first:
        what a worker hands its successor so that one reads them before serving."""
        keys: list[tuple[str, str]] = []
        for key in reversed(self._entries):
            if len(keys) >= limit:
                break
            keys.append(key)
        return keys

    def cached(self, org_id: str, agent_id: str, version: str) -> DirectiveAnswer | None:
        """The cached answer (detail `cache`) when it may serve, else None; no I/O.

        Retrieval asks this first, so a hit costs no task and no scheduler pass.
        """
        key = (org_id, agent_id)
        entry = self._entries.get(key)
        if entry is None or not self._fresh(entry, version, self._clock()):
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return Answer(entry.directive, "cache")

    def prefetch(self, org_id: str, agent_id: str, version: str) -> None:
        """Queue a read of the key unless its entry may serve or a read is already queued;
        no I/O here.

        Called as soon as a call is known (decoded, checked, admitted), before the
        call's own work: its directive branch then finds the entry filled, or the
        read under way, instead of starting the read after that work and after
        that of every call that arrived with it. The read stores what it finds; a
        branch that names another version than the one read reads again, as any
        version mismatch does. Not entered, or with caching off, it does nothing.
        """
        key = (org_id, agent_id)
        entry = self._entries.get(key)
        if self._nursery is None or key in self._reading or self.config.max_entries <= 0:
            return  # nothing to fill: the branch reads (or waits) as it always does
        if entry is not None and self._fresh(entry, version, self._clock()):
            return
        self._queue(key, version)

    async def fetch(self, org_id: str, agent_id: str, version: str) -> DirectiveAnswer:
        """The directive (detail `cache` when no round trip was needed)."""
        hit = self.cached(org_id, agent_id, version)
        if hit is not None:
            return hit
        key = (org_id, agent_id)
        self.misses += 1
        if self._nursery is None:
            directive = await self.source.get_directive(org_id, agent_id, version)
            self._store(key, directive, self._clock())
            return Answer(directive, "")
        read = self._reading.get(key) or self._queue(key, version)
        await read.done.wait()
        if read.error:
            raise SourceError(read.error)
        return Answer(read.directive, "")

    def _queue(self, key: tuple[str, str], version: str) -> _Refresh:
        """Queue a read of `key`; the first key queued starts the read of them all."""
        assert self._nursery is not None
        read = self._reading[key] = _Refresh()
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

        def reads() -> list[_Refresh]:
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

    async def _store_one(self, key: tuple[str, str], version: str, read: _Refresh) -> None:
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
        self, many: BatchRead, queued: dict[tuple[str, str], str], reads: list[_Refresh]
    ) -> None:
        keys = list(queued)

        def deliver(answers: list[DirectiveOrError]) -> None:
            self._deliver(keys, reads, answers)

        wanted = [(org, agent, version) for (org, agent), version in queued.items()]
        self._deliver(keys, reads, await many(wanted, on_answers=deliver))

    def _deliver(
        self, keys: list[tuple[str, str]], reads: list[_Refresh], answers: list[DirectiveOrError]
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

    def _finish(self, key: tuple[str, str], read: _Refresh) -> None:
        if self._reading.get(key) is read:
            del self._reading[key]
        read.done.set()

    async def _guarded(
        self, reads: Callable[[], list[_Refresh]], work: Callable[[], Awaitable[None]]
    ) -> None:
        """`work()` under `refresh_timeout`; any failure becomes the error of `reads()`."""
        timeout = self.config.refresh_timeout
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
    def _fail(reads: Callable[[], list[_Refresh]], error: str) -> None:
        for read in reads():
            if not read.done.is_set():  # an answer already delivered stands
                read.directive, read.error = None, error

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        """The DirectiveSource method: `fetch` without its detail."""
        answer = await self.fetch(org_id, agent_id, version)
        directive: Directive | None = answer.value
        return directive

    async def aclose(self) -> None:
        """Closes the wrapped source."""
        await self.source.aclose()

    def _fresh(self, entry: _Entry, version: str, now: float) -> bool:
        age = now - entry.fetched
        if version:
            found = entry.directive.version_id if entry.directive is not None else None
            return (found or "").lower() == version and age < self.config.max_age
        return age < self.config.ttl

    def _store(self, key: tuple[str, str], directive: Directive | None, now: float) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        size = _size(directive)
        if self.config.max_entries <= 0 or size > self.config.max_bytes // 8:
            return
        self._entries[key] = _Entry(directive, now, size)
        self.bytes += size
        while len(self._entries) > self.config.max_entries or self.bytes > self.config.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
