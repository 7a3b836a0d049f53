"""The in-process directive cache: served by version or TTL, bounded, per tenant."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
import trio.testing

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.base import Answer
from ibex.sources.directive_cache import DirectiveCache, DirectiveCacheConfig

ORG = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
AGENT = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
OTHER = "9f1c2b3a-0d6f-4f51-9a8e-0b6f8f1e5c3a"
V1 = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
V2 = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"


class Store:
    """A directive source whose answers and call count the test controls."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Directive | None] = {}
        self.calls = 0
        self.versions: list[str] = []

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        self.calls += 1
        self.versions.append(version)
        return self.values.get((org_id, agent_id))

    async def aclose(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def directive(version: str | None, text: str = "be brief") -> Directive:
    return Directive(content=text, version_id=version)


def cache(store: Store, clock: Clock, **config: int | float) -> DirectiveCache:
    return DirectiveCache(store, DirectiveCacheConfig(**config), clock=clock)  # type: ignore[arg-type]


async def test_the_expected_version_is_served_without_a_round_trip() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, ttl=1.0, max_age=30.0)
    assert await c.fetch(ORG, AGENT, V1) == Answer(directive(V1), "")
    clock.now += 29  # far past the TTL: within its maximum age the version vouches for it
    assert await c.fetch(ORG, AGENT, V1) == Answer(directive(V1), "cache")
    assert store.calls == 1 and (c.hits, c.misses) == (1, 1)


async def test_a_versioned_hit_is_revalidated_after_its_maximum_age() -> None:
    """A directive rotated and then deleted stops being served to callers still naming
    the old version once the entry is `max_age` old, however often it was hit."""
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1, "old")
    c = cache(store, clock, ttl=1.0, max_age=2.0)
    await c.fetch(ORG, AGENT, V1)
    store.values[(ORG, AGENT)] = directive(V2, "new")
    del store.values[(ORG, AGENT)]  # rotated, then revoked
    for _ in range(3):
        clock.now += 0.5
        assert await c.fetch(ORG, AGENT, V1) == Answer(directive(V1, "old"), "cache")
    clock.now = 101.75
    assert c.cached(ORG, AGENT, V1) is not None
    clock.now = 102.0  # 2.0 s after the read: hits do not extend an entry's life
    assert c.cached(ORG, AGENT, V1) is None
    assert await c.fetch(ORG, AGENT, V1) == Answer(None, "")
    assert await c.fetch(ORG, AGENT, V1) == Answer(None, "")  # never matches a version
    assert store.calls == 3


async def test_a_revalidated_entry_that_still_matches_serves_for_another_maximum_age() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, max_age=2.0)
    await c.fetch(ORG, AGENT, V1)
    clock.now = 102.0  # the bound is exclusive
    assert (await c.fetch(ORG, AGENT, V1)).detail == ""
    clock.now = 103.5
    assert (await c.fetch(ORG, AGENT, V1)).detail == "cache"
    assert store.calls == 2


def test_the_default_maximum_age_is_seconds_not_minutes() -> None:
    assert 0 < DirectiveCacheConfig().max_age <= 10


async def test_another_version_goes_to_the_source_and_replaces_the_entry() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1, "old")
    c = cache(store, clock)
    await c.fetch(ORG, AGENT, V1)
    store.values[(ORG, AGENT)] = directive(V2, "new")
    assert await c.fetch(ORG, AGENT, V2) == Answer(directive(V2, "new"), "")
    assert await c.fetch(ORG, AGENT, V2) == Answer(directive(V2, "new"), "cache")
    assert store.calls == 2


async def test_without_a_version_an_entry_serves_for_the_ttl_only() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, ttl=1.0)
    await c.fetch(ORG, AGENT, "")
    clock.now += 0.999
    assert (await c.fetch(ORG, AGENT, "")).detail == "cache"
    clock.now += 0.002
    assert (await c.fetch(ORG, AGENT, "")).detail == ""
    assert store.calls == 2


async def test_a_missing_directive_is_cached_for_the_ttl_but_never_matches_a_version() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, ttl=1.0)
    assert await c.fetch(ORG, AGENT, "") == Answer(None, "")
    assert await c.fetch(ORG, AGENT, "") == Answer(None, "cache")
    assert await c.fetch(ORG, AGENT, V1) == Answer(None, "")
    assert store.calls == 2


async def test_entries_are_per_tenant() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1, "org one")
    store.values[(OTHER, AGENT)] = directive(V1, "org two")
    c = cache(store, clock)
    await c.fetch(ORG, AGENT, V1)
    got = await c.fetch(OTHER, AGENT, V1)  # same agent id and version, another org
    assert got == Answer(directive(V1, "org two"), "")
    assert (await c.fetch(ORG, AGENT, V1)).value == directive(V1, "org one")


async def test_entries_are_bounded_in_number_lru_first() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, max_entries=2)
    agents = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(3)]
    for agent in agents:
        store.values[(ORG, agent)] = directive(V1)
    await c.fetch(ORG, agents[0], V1)
    await c.fetch(ORG, agents[1], V1)
    await c.fetch(ORG, agents[0], V1)  # a hit makes agents[0] the newest
    await c.fetch(ORG, agents[2], V1)  # evicts agents[1]
    assert len(c) == 2
    calls = store.calls
    assert (await c.fetch(ORG, agents[0], V1)).detail == "cache"
    assert (await c.fetch(ORG, agents[1], V1)).detail == ""
    assert store.calls == calls + 1


async def test_entries_are_bounded_in_bytes_and_huge_ones_are_not_cached() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, max_bytes=64 * 1024)
    agents = [f"00000000-0000-4000-8000-0000000000{i:02d}" for i in range(40)]
    for agent in agents:
        store.values[(ORG, agent)] = directive(V1, "x" * 1000)
        await c.fetch(ORG, agent, V1)
        assert c.bytes <= 64 * 1024
    assert 0 < len(c) < 40
    store.values[(ORG, AGENT)] = directive(V1, "y" * 64 * 1024)  # over max_bytes / 8
    await c.fetch(ORG, AGENT, V1)
    assert (await c.fetch(ORG, AGENT, V1)).detail == ""
    assert c.bytes <= 64 * 1024


@pytest.mark.parametrize("entries", [0])
async def test_zero_entries_caches_nothing(entries: int) -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, max_entries=entries)
    await c.fetch(ORG, AGENT, V1)
    await c.fetch(ORG, AGENT, V1)
    assert store.calls == 2 and len(c) == 0 and c.bytes == 0


# Sizes follow the module's accounting: 256 bytes of overhead per entry, four per
# character of content (CPython's widest string), one per character of version.
def entry_size(content_chars: int, version: str | None = V1) -> int:
    return 256 + 4 * content_chars + len(version or "")


async def test_bytes_are_the_exact_sum_of_the_entries_through_replacement_and_eviction() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, max_entries=2)
    a, b, d = (f"00000000-0000-4000-8000-00000000000{i}" for i in range(3))
    store.values[(ORG, a)] = directive(V1, "x" * 1000)
    store.values[(ORG, b)] = directive(None, "y" * 10)
    store.values[(ORG, d)] = None
    await c.fetch(ORG, a, V1)
    assert c.bytes == entry_size(1000)
    await c.fetch(ORG, b, "")
    assert c.bytes == entry_size(1000) + entry_size(10, None)
    store.values[(ORG, a)] = directive(V2, "z" * 3)  # replaced: the old size is given back
    await c.fetch(ORG, a, V2)
    assert c.bytes == entry_size(3, V2) + entry_size(10, None)
    await c.fetch(ORG, d, "")  # evicts b, the least recently used; a missing directive
    assert len(c) == 2
    assert c.bytes == entry_size(3, V2) + 256
    assert (c.hits, c.misses) == (0, 4)
    await c.fetch(ORG, a, V2)
    await c.fetch(ORG, d, "")
    assert (c.hits, c.misses) == (2, 4)


async def test_the_ttl_is_exclusive() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, ttl=0.5)
    await c.fetch(ORG, AGENT, "")
    clock.now += 0.5  # exactly the TTL (0.5 is exact in binary): no longer fresh
    assert (await c.fetch(ORG, AGENT, "")).detail == ""
    assert store.calls == 2


async def test_one_entry_allowed_is_one_entry_kept() -> None:
    store, clock = Store(), Clock()
    store.values[(ORG, AGENT)] = directive(V1)
    c = cache(store, clock, max_entries=1)
    await c.fetch(ORG, AGENT, V1)
    assert (await c.fetch(ORG, AGENT, V1)).detail == "cache"
    assert store.calls == 1


async def test_an_entry_of_an_eighth_of_the_bytes_is_cached_and_a_larger_one_is_not() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, max_bytes=64 * 1024)  # an eighth: 8,192 bytes
    fits = (8192 - entry_size(0)) // 4  # content that makes the entry exactly 8,192 bytes
    assert entry_size(fits) == 8192
    store.values[(ORG, AGENT)] = directive(V1, "f" * fits)
    store.values[(OTHER, AGENT)] = directive(V1, "g" * (fits + 1))
    await c.fetch(ORG, AGENT, V1)
    assert len(c) == 1 and c.bytes == 8192
    await c.fetch(OTHER, AGENT, V1)  # 8,196 bytes: served, never stored
    assert len(c) == 1 and c.bytes == 8192
    assert (await c.fetch(ORG, AGENT, V1)).detail == "cache"  # the small one stayed
    assert (await c.fetch(OTHER, AGENT, V1)).detail == ""


async def test_entries_filling_the_bytes_exactly_all_stay() -> None:
    store, clock = Store(), Clock()
    c = cache(store, clock, max_bytes=8 * 8192)
    fits = (8192 - entry_size(0)) // 4
    agents = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(9)]
    for agent in agents:
        store.values[(ORG, agent)] = directive(V1, "h" * fits)
    for agent in agents[:8]:
        await c.fetch(ORG, agent, V1)
    assert len(c) == 8 and c.bytes == 8 * 8192  # at the bound, not over it
    await c.fetch(ORG, agents[8], V1)  # one more: the oldest goes
    assert len(c) == 8 and c.bytes == 8 * 8192
    calls = store.calls
    assert (await c.fetch(ORG, agents[1], V1)).detail == "cache"
    assert (await c.fetch(ORG, agents[0], V1)).detail == ""
    assert store.calls == calls + 1


async def test_the_cache_is_a_directive_source_that_passes_the_version_on() -> None:
    store, clock = Store(), Clock()
    store.values[ORG, AGENT] = directive(V1)
    c = cache(store, clock)
    assert await c.get_directive(ORG, AGENT, V1) == directive(V1)
    assert await c.get_directive(ORG, AGENT, V1) == directive(V1)  # a hit: no call
    assert await c.get_directive(ORG, AGENT) == directive(V1)  # no version: the TTL serves
    assert await c.get_directive(ORG, AGENT, V2) == directive(V1)  # the source's current one
    assert store.versions == [V1, V2]
    assert (c.hits, c.misses) == (2, 2)


# ------------------------------------------------------------------ reads owned by the cache


class SlowStore(Store):
    """Answers after `delay` seconds of Trio time (forever when None)."""

    def __init__(self, delay: float | None) -> None:
        super().__init__()
        self.delay = delay
        self.finished = 0

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        self.calls += 1
        self.versions.append(version)
        if self.delay is None:
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        self.finished += 1
        return self.values.get((org_id, agent_id))


def owned(store: Store, **config: float) -> DirectiveCache:
    return DirectiveCache(store, DirectiveCacheConfig(**config), clock=trio.current_time)  # type: ignore[arg-type]


async def test_callers_missing_on_one_key_share_one_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = SlowStore(0.010)
    store.values[(ORG, AGENT)] = directive(V1)
    got: list[Answer[Directive | None]] = []
    async with owned(store) as c:

        async def one() -> None:
            got.append(await c.fetch(ORG, AGENT, V1))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
    assert store.calls == 1 and store.versions == [V1]  # the version is passed on
    assert got == [Answer(directive(V1), "")] * 5


async def test_a_read_outlives_the_branch_that_asked_and_refreshes_the_entry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 5 ms branch gives up on a 20 ms read; the read goes on and the next call hits."""
    store = SlowStore(0.020)
    store.values[(ORG, AGENT)] = directive(V1)
    async with owned(store, refresh_timeout=0.25) as c:
        with trio.move_on_after(0.005) as scope:
            await c.fetch(ORG, AGENT, V1)
        assert scope.cancelled_caught
        await trio.sleep(0.030)
        assert store.finished == 1
        assert c.cached(ORG, AGENT, V1) == Answer(directive(V1), "cache")
        assert store.calls == 1


async def test_a_read_is_bounded_by_the_refresh_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = SlowStore(None)
    async with owned(store, refresh_timeout=0.75) as c:
        t0 = trio.current_time()
        with pytest.raises(SourceError, match=r"^no answer within 750ms$"):
            await c.fetch(ORG, AGENT, V1)
        assert trio.current_time() - t0 == pytest.approx(0.75)
        # the failed read is forgotten: the next miss reads again
        with trio.move_on_after(0.01):
            await c.fetch(ORG, AGENT, V1)
        assert store.calls == 2


async def test_leaving_the_cache_cancels_its_reads(autojump_clock: trio.testing.MockClock) -> None:
    store = SlowStore(None)
    async with trio.open_nursery() as nursery, owned(store, refresh_timeout=60.0) as c:
        nursery.start_soon(c.fetch, ORG, AGENT, V1)
        await trio.sleep(1.0)
        assert store.calls == 1
        nursery.cancel_scope.cancel()
    assert len(c._reads) == 0


class FailingStore(Store):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        self.calls += 1
        raise self.error


async def test_a_failed_read_is_the_callers_source_error_and_a_bug_is_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A SourceError's message reaches the caller as it is; anything else is contained as
    "unexpected <type>" (no text of the exception) and logged with its traceback."""
    async with owned(FailingStore(SourceError("directive: redis timed out"))) as c:
        with pytest.raises(SourceError, match=r"^directive: redis timed out$"):
            await c.fetch(ORG, AGENT, V1)
    async with owned(FailingStore(KeyError("secret"))) as c:
        with pytest.raises(SourceError, match=r"^unexpected KeyError$"):
            await c.fetch(ORG, AGENT, V1)
    assert [r.getMessage() for r in caplog.records] == ["directive_refresh_failed"]
    assert caplog.records[0].exc_info is not None


async def test_a_caller_waiting_on_a_read_the_closing_cache_cancels_gets_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled reads (the cache's exit) are errors for their waiters, never "no directive"."""
    store = SlowStore(None)
    got: list[object] = []

    async def waiter(c: DirectiveCache) -> None:
        try:
            got.append(await c.fetch(ORG, AGENT, V1))
        except SourceError as exc:
            got.append(str(exc))

    async with trio.open_nursery() as nursery, owned(store, refresh_timeout=60.0) as c:
        nursery.start_soon(waiter, c)
        await trio.sleep(1.0)
        assert store.calls == 1
    assert got == ["the directive cache closed before its read finished"]


async def test_after_the_cache_is_left_a_miss_reads_in_the_callers_task() -> None:
    store = Store()
    store.values[(ORG, AGENT)] = directive(V1)
    async with owned(store) as c:
        pass
    assert await c.fetch(ORG, AGENT, V1) == Answer(directive(V1), "")
    assert store.calls == 1 and c.cached(ORG, AGENT, V1) is not None


# ------------------------------------------------------------------ misses read together


AGENTS = [f"7c9e6679-7425-40de-944b-e07fc1f90a{i:02x}" for i in range(5)]


class BatchStore(SlowStore):
    """A source that also reads several keys in one call (`get_directives`), as Redis does
    with MGET; `fail` names agents whose value does not decode."""

    def __init__(self, delay: float | None) -> None:
        super().__init__(delay)
        self.batches: list[list[tuple[str, str, str]]] = []
        self.fail: set[str] = set()

    async def get_directives(
        self, wanted: list[tuple[str, str, str]], *, on_answers: Any = None
    ) -> list[Directive | SourceError | None]:
        self.batches.append(list(wanted))
        if self.delay is None:
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        return [
            SourceError("redis: malformed value")
            if agent in self.fail
            else self.values.get((org, agent))
            for org, agent, _ in wanted
        ]


async def fetch_all(c: DirectiveCache, agents: list[str]) -> dict[str, object]:
    """Every agent's `fetch` started together; each answer, or its error's text."""
    got: dict[str, object] = {}

    async def one(agent: str) -> None:
        try:
            got[agent] = await c.fetch(ORG, agent, "")
        except SourceError as exc:
            got[agent] = str(exc)

    async with trio.open_nursery() as nursery:
        for agent in agents:
            nursery.start_soon(one, agent)
    return got


async def test_misses_on_several_keys_together_are_one_read_of_them_all(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Five calls for five agents missing together cost one `get_directives` (one round
    trip), each caller gets its own agent's directive, and the entries are filled."""
    store = BatchStore(0.002)
    for i, agent in enumerate(AGENTS):
        store.values[(ORG, agent)] = directive(V1, f"agent {i}")
    async with owned(store) as c:
        got = await fetch_all(c, AGENTS)
        assert [sorted(b) for b in store.batches] == [[(ORG, agent, "") for agent in AGENTS]]
        assert store.calls == 0  # no key read alone
        assert got == {a: Answer(directive(V1, f"agent {i}"), "") for i, a in enumerate(AGENTS)}
        for i, agent in enumerate(AGENTS):
            assert c.cached(ORG, agent, V1) == Answer(directive(V1, f"agent {i}"), "cache")


async def test_one_keys_error_in_a_batch_is_that_callers_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(0.002)
    store.values[(ORG, AGENTS[0])] = directive(V1)
    store.fail = {AGENTS[1]}
    async with owned(store) as c:
        got = await fetch_all(c, AGENTS[:3])
        assert got == {
            AGENTS[0]: Answer(directive(V1), ""),
            AGENTS[1]: "redis: malformed value",
            AGENTS[2]: Answer(None, ""),  # no key: no directive, a success
        }
        assert c.cached(ORG, AGENTS[1], "") is None  # an error is not cached
        assert c.cached(ORG, AGENTS[2], "") == Answer(None, "cache")


async def test_a_batch_is_bounded_by_the_refresh_timeout_for_all_its_callers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(None)
    async with owned(store, refresh_timeout=0.5) as c:
        got = await fetch_all(c, AGENTS[:2])
    assert got == {a: "no answer within 500ms" for a in AGENTS[:2]}
    assert len(store.batches) == 1


async def test_a_key_missed_while_a_batch_is_in_flight_goes_in_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(0.010)
    async with owned(store) as c, trio.open_nursery() as nursery:
        nursery.start_soon(c.fetch, ORG, AGENTS[0], "")
        nursery.start_soon(c.fetch, ORG, AGENTS[1], "")
        await trio.sleep(0.005)  # the first batch is in flight
        nursery.start_soon(c.fetch, ORG, AGENTS[2], V1)
        nursery.start_soon(c.fetch, ORG, AGENTS[0], "")  # joins the read in flight
    assert [sorted(b) for b in store.batches] == [
        [(ORG, a, "") for a in AGENTS[:2]],
        [(ORG, AGENTS[2], V1)],
    ]


async def test_a_source_without_batches_reads_each_key_concurrently(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = SlowStore(0.010)
    for agent in AGENTS:
        store.values[(ORG, agent)] = directive(V1)
    async with owned(store) as c:
        t0 = trio.current_time()
        got = await fetch_all(c, AGENTS)
        assert trio.current_time() - t0 == pytest.approx(0.010)  # not 5 x 10 ms one by one
    assert store.calls == 5 and got == {a: Answer(directive(V1), "") for a in AGENTS}


# ------------------------------------------------------------------ prefetch


async def test_a_prefetch_fills_the_entry_before_the_call_asks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(0.002)
    store.values[(ORG, AGENT)] = directive(V1)
    async with owned(store) as c:
        c.prefetch(ORG, AGENT, V1)
        c.prefetch(ORG, AGENT, V1)  # already queued: nothing more
        await trio.sleep(0.010)
        assert c.cached(ORG, AGENT, V1) == Answer(directive(V1), "cache")
        c.prefetch(ORG, AGENT, V1)  # the entry serves: nothing to read
        await trio.sleep(0.010)
    assert store.batches == [[(ORG, AGENT, V1)]]


async def test_a_call_whose_prefetch_is_in_flight_waits_for_that_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(0.010)
    store.values[(ORG, AGENT)] = directive(V1)
    async with owned(store) as c:
        c.prefetch(ORG, AGENT, V1)
        await trio.sleep(0.004)
        t0 = trio.current_time()
        assert await c.fetch(ORG, AGENT, V1) == Answer(directive(V1), "")
        assert trio.current_time() - t0 == pytest.approx(0.006)  # the rest of that read
    assert len(store.batches) == 1


async def test_prefetches_of_calls_known_together_are_one_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = BatchStore(0.002)
    async with owned(store) as c:
        for agent in AGENTS:
            c.prefetch(ORG, agent, "")
        await trio.sleep(0.010)
    assert store.batches == [[(ORG, agent, "") for agent in AGENTS]]  # in the calls' order


async def test_a_prefetch_revalidates_an_entry_past_its_maximum_age(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Prefetching never stretches an entry's life: past `max_age` it is read again, and a
    revoked directive (key deleted) is what the next call gets."""
    store = BatchStore(0.001)
    store.values[(ORG, AGENT)] = directive(V1)
    async with owned(store, ttl=1.0, max_age=2.0) as c:
        await c.fetch(ORG, AGENT, V1)
        del store.values[(ORG, AGENT)]  # revoked
        await trio.sleep(1.5)
        c.prefetch(ORG, AGENT, V1)  # within max_age: nothing read
        await trio.sleep(0.6)  # 2.1 s after the read
        c.prefetch(ORG, AGENT, V1)
        await trio.sleep(0.01)
        assert c.cached(ORG, AGENT, V1) is None  # the revoked version no longer serves
        assert await c.fetch(ORG, AGENT, V1) == Answer(None, "")
    assert len(store.batches) == 3  # the first read, the prefetch past max_age, the call


@pytest.mark.parametrize("entered", [True, False])
async def test_a_prefetch_does_nothing_unentered_or_with_caching_off(entered: bool) -> None:
    store = BatchStore(0.0)
    c = owned(store, max_entries=0 if entered else 10)
    assert store.calls == 0
    if entered:
        async with c:
            c.prefetch(ORG, AGENT, V1)
            await trio.sleep(0.01)
    else:
        c.prefetch(ORG, AGENT, V1)
    assert store.batches == [] and store.calls == 0


async def test_keys_of_a_source_that_does_not_batch_are_read_apart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A Redis Cluster (`batch_reads = False`): one hung key fails alone at the refresh
    timeout, and the keys missed with it answer as soon as they are read."""

    class Cluster(BatchStore):
        batch_reads = False

        async def get_directive(
            self, org_id: str, agent_id: str, version: str = ""
        ) -> Directive | None:
            if agent_id == AGENTS[0]:
                await trio.sleep_forever()
            return await super().get_directive(org_id, agent_id, version)

    store = Cluster(0.002)
    for agent in AGENTS:
        store.values[(ORG, agent)] = directive(V1)
    ended: dict[str, float] = {}
    async with owned(store, refresh_timeout=0.25) as c:

        async def one(agent: str) -> None:
            with contextlib.suppress(SourceError):
                await c.fetch(ORG, agent, "")
            ended[agent] = trio.current_time()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for agent in AGENTS:
                nursery.start_soon(one, agent)
    assert store.batches == [] and store.finished == 4
    assert ended.pop(AGENTS[0]) - t0 == pytest.approx(0.25)
    assert all(t - t0 == pytest.approx(0.002) for t in ended.values())


async def test_answers_told_before_the_read_returns_wake_their_callers_then(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A source that tells the answers (`on_answers`) before its call returns: the
    callers resume at that moment and the entries are filled, not when the read task
    gets the return; a timeout after that moment takes nothing back."""

    class Early(BatchStore):
        async def get_directives(
            self, wanted: list[tuple[str, str, str]], *, on_answers: Any = None
        ) -> list[Directive | SourceError | None]:
            answers = await super().get_directives(wanted)
            on_answers(answers)
            await trio.sleep(1.0)  # the way back to the read task, taking long
            return answers

    store = Early(0.002)
    store.values[(ORG, AGENTS[0])] = directive(V1)
    async with owned(store, refresh_timeout=0.5) as c:
        t0 = trio.current_time()
        got = await fetch_all(c, AGENTS[:2])
        assert trio.current_time() - t0 == pytest.approx(0.002)
        assert got == {AGENTS[0]: Answer(directive(V1), ""), AGENTS[1]: Answer(None, "")}
        await trio.sleep(1.0)  # the read task's timeout has fired meanwhile
        assert c.cached(ORG, AGENTS[0], V1) == Answer(directive(V1), "cache")
        assert len(c._reads) == 0


class StartStore(BatchStore):
    """A batch source whose reads start at once (`start_directives`, as Redis's asyncio
    side does): the keys are taken when the read's I/O side first runs, here when its
    wait begins. `refuse` makes the start fail; `lose` ends the read before it took them."""

    def __init__(self, delay: float | None) -> None:
        super().__init__(delay)
        self.starts = 0
        self.refuse: SourceError | None = None
        self.lose: SourceError | None = None

    def start_directives(self, take: Any, on_answers: Any) -> Any:
        if self.refuse is not None:
            raise self.refuse
        self.starts += 1
        lose, self.lose = self.lose, None

        async def wait() -> list[Directive | SourceError | None]:
            if lose is not None:
                raise lose
            return await self.get_directives(take(), on_answers=on_answers)

        return wait


def start_store(**failure: SourceError) -> StartStore:
    """A StartStore holding the first agent's directive, with `refuse` or `lose` set."""
    store = StartStore(0.002)
    store.values[(ORG, AGENTS[0])] = directive(V1)
    for name, error in failure.items():
        setattr(store, name, error)
    return store


async def test_a_started_read_is_one_read_of_the_keys_queued_before_it_took_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = StartStore(0.002)
    for i, agent in enumerate(AGENTS):
        store.values[(ORG, agent)] = directive(V1, f"agent {i}")
    async with owned(store) as c:
        for agent in AGENTS:
            c.prefetch(ORG, agent, "")
        got = await fetch_all(c, AGENTS)
    assert store.starts == 1
    assert [sorted(b) for b in store.batches] == [[(ORG, agent, "") for agent in AGENTS]]
    assert got == {a: Answer(directive(V1, f"agent {i}"), "") for i, a in enumerate(AGENTS)}


async def test_a_started_read_that_ends_before_taking_its_keys_fails_them_and_reads_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its callers get its error (none waits for ever), and the next miss starts a read."""
    store = start_store(lose=SourceError("redis: connection failed"))
    async with owned(store) as c:
        assert await fetch_all(c, AGENTS[:2]) == {a: "redis: connection failed" for a in AGENTS[:2]}
        assert await c.fetch(ORG, AGENTS[0], "") == Answer(directive(V1), "")
    assert store.starts == 2 and len(store.batches) == 1


async def test_a_started_read_is_bounded_by_the_refresh_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = StartStore(None)
    async with owned(store, refresh_timeout=0.5) as c:
        assert await fetch_all(c, AGENTS[:2]) == {a: "no answer within 500ms" for a in AGENTS[:2]}
    assert store.starts == 1


async def test_a_read_the_source_cannot_start_is_read_from_the_cache_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = start_store(refuse=SourceError("redis directive source: no asyncio loop running"))
    async with owned(store) as c:
        assert await c.fetch(ORG, AGENTS[0], "") == Answer(directive(V1), "")
    assert store.starts == 0 and len(store.batches) == 1


async def test_a_started_read_that_returns_without_taking_its_keys_leaves_none_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A source bug: its callers get an error, and the next miss still starts a read."""
    store = start_store()
    real = store.start_directives

    def skipping(take: Any, on_answers: Any) -> Any:
        store.start_directives = real  # type: ignore[method-assign]

        async def wait() -> list[Directive | SourceError | None]:
            return []

        return wait

    store.start_directives = skipping  # type: ignore[method-assign]
    async with owned(store) as c:
        got = await fetch_all(c, AGENTS[:1])
        assert got == {AGENTS[0]: "the directive read ended without its keys"}
        assert await c.fetch(ORG, AGENTS[0], "") == Answer(directive(V1), "")
