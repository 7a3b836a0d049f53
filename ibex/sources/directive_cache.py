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

import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType

import msgspec

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.base import Answer, DirectiveAnswer, DirectiveSource
from ibex.sources.directive_cache_config import DirectiveCacheConfig as DirectiveCacheConfig
from ibex.sources.directive_reads import DirectiveReads

_ENTRY_OVERHEAD = 256  # key strings, the Directive struct, the dict slot


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

    Entered with `async with`, misses are read once per key in tasks the cache
    owns (`ibex.sources.directive_reads`: every caller missing on a key waits for
    that one read, keys missed together are read together, under
    `refresh_timeout`, never cut by a caller's branch timeout). `prefetch` queues a
    call's read as soon as the call is known, before its own work. Revocation still
    takes effect within `max_age` plus `refresh_timeout`. Not entered, a miss reads
    in the caller's task.
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
        self._reads = DirectiveReads(source, config.refresh_timeout, self._store, clock)

    async def __aenter__(self) -> DirectiveCache:
        await self._reads.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Cancels the reads still in flight; closes nothing else (`aclose` does)."""
        await self._reads.stop()

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
        reads = self._reads
        if not reads.open or reads.reading(key) is not None or self.config.max_entries <= 0:
            return  # nothing to fill: the branch reads (or waits) as it always does
        if entry is not None and self._fresh(entry, version, self._clock()):
            return
        reads.queue(key, version)

    async def fetch(self, org_id: str, agent_id: str, version: str) -> DirectiveAnswer:
        """The directive (detail `cache` when no round trip was needed)."""
        hit = self.cached(org_id, agent_id, version)
        if hit is not None:
            return hit
        key = (org_id, agent_id)
        self.misses += 1
        if not self._reads.open:
            directive = await self.source.get_directive(org_id, agent_id, version)
            self._store(key, directive, self._clock())
            return Answer(directive, "")
        read = self._reads.reading(key) or self._reads.queue(key, version)
        await read.done.wait()
        if read.error:
            raise SourceError(read.error)
        return Answer(read.directive, "")

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
