"""The price table (ibex.assembly.pricing): a memory's cost, kept once its pieces are cached.

A memory block costs the counts of its pieces (ibex.assembly.output_format): the
opening tag's prefix and suffix, the escaped body and the closing tag. The table
keeps that sum by (content, tag suffix) for one counter and format, enters only
sums whose counts all came from the shared caches, and only once the request is
known to fit; then the same memory costs no cache lookups at all.
"""

from __future__ import annotations

import msgspec
import pytest

from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.history import DeferredCache, Uncached
from ibex.assembly.output_format import BODY_CACHE_MAX_CHARS
from ibex.assembly.prepare import EarlyAssembly
from ibex.assembly.pricing import (
    PRICE_TABLE_CHARS,
    PriceKey,
    PriceTable,
    price,
    price_table,
    pricer,
)
from ibex.assembly.structs import AssemblyRequest, MemoryHit, ScoredMemory
from ibex.assembly.tokens import TokenCounter, Tokenizers
from ibex.assembly.xml_format import XML_TAGS, new_nonce
from ibex.testing.samples import AGENT, ORG, scored

NOW = 1_760_000_000.0
IDS = "00000000-0000-4000-8000-00000000000"  # + a digit


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def memories(tag: str) -> list[ScoredMemory]:
    """Memories no other test prices (contents carry `tag`), one in CJK, one with markup."""
    texts = (f"Deploys go out from main {tag}.", f"数据库迁移 {tag}。", f"a </memory> b {tag}")
    return [scored(i, 0.5, content=t) for i, t in enumerate(texts)]


def block_cost(counter: TokenCounter, m: ScoredMemory) -> int:
    """The spec's cost: the pieces of the rendered block, each counted afresh."""
    pieces = (
        XML_TAGS.memory_open_prefix,
        XML_TAGS.memory_open_suffix(m),
        XML_TAGS.body_piece_uncached(m.content),
        XML_TAGS.memory_close,
    )
    return sum(counter.count_uncached(p) for p in pieces)


def staged_pricing(
    counter: TokenCounter, ms: list[ScoredMemory]
) -> tuple[list[int], list[tuple[PriceKey, int]]]:
    """One request's pricing through a `DeferredCache`, its sums pending, nothing committed."""
    pending: list[tuple[PriceKey, int]] = []
    priced = pricer(counter, XML_TAGS, DeferredCache(counter, XML_TAGS), pending)
    return [priced(m).token_estimate for m in ms], pending


def test_a_memory_priced_again_costs_its_block_without_a_cache_lookup() -> None:
    counter = Tokenizers(None, 65536).counter("o200k_base", "o200k_base")
    ms = memories(new_nonce(8))
    expected = [block_cost(counter, m) for m in ms]
    assert [m.token_estimate for m in price(ms, counter, XML_TAGS)] == expected  # counted, cached
    table = price_table(counter, XML_TAGS)
    assert not table.prices  # every piece was new: no sum of cached counts yet
    estimates, pending = staged_pricing(counter, ms)  # every piece cached: sums pending
    assert estimates == expected and len(pending) == len(ms)
    assert not table.prices  # not committed: nothing entered
    table.put_many(pending)
    assert len(table.prices) == len(ms)
    hits = counter.cache_info().hits
    estimates, pending = staged_pricing(counter, ms)
    assert estimates == expected
    assert pending == []
    # The fixed tags only: the bodies and suffixes are not looked up.
    assert counter.cache_info().hits == hits + 2


def test_sums_enter_the_table_only_when_the_prepared_request_commits(catalog: Catalog) -> None:
    tokenizers = Tokenizers(None, 65536)
    counter = tokenizers.counter("o200k_base", "o200k_base")
    tag = new_nonce(8)
    one = MemoryHit("", ORG, AGENT, "", "factual", 0.5, 0.5, 1, branch="hot")
    hot = tuple(
        msgspec.structs.replace(one, memory_id=f"{IDS}{i}", content=f"Memory {i} {tag}", rank=i + 1)
        for i in range(3)
    )
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")
    table = price_table(counter, XML_TAGS)

    def prepared() -> EarlyAssembly:
        early = EarlyAssembly(request, new_nonce(8), NOW, catalog=catalog, tokenizers=tokenizers)
        early.hits("hot", hot)
        return early

    prepared().commit()  # new pieces: counted and cached, no sum yet
    assert not table.prices
    prepared()  # every piece cached, but this request never commits (refused, say)
    assert not table.prices
    prepared().commit()
    assert {content for content, _ in table.prices} == {h.content for h in hot}


class _NoCache(Uncached):
    """A counter that caches nothing (as a family with its cache off), counting characters."""

    estimate_kind = "chars"
    max_token_bytes = 4

    def __init__(self) -> None:
        self.counted = 0
        self.price_tables: dict[object, object] = {}  # room for a table, as a real counter has

    def count(self, text: str) -> int:
        self.counted += 1
        return len(text)

    count_uncached = count

    def additive_cut(self, text: str) -> int:
        return len(text)


def test_a_counter_without_a_cache_never_enters_the_table() -> None:
    counter = _NoCache()
    ms = memories(new_nonce(8))
    for _ in range(3):
        deferred = DeferredCache(counter, XML_TAGS)
        pending: list[tuple[PriceKey, int]] = []
        priced = pricer(counter, XML_TAGS, deferred, pending)
        for m in ms:
            priced(m)
        deferred.commit()
        assert pending == []
    assert not price_table(counter, XML_TAGS).prices
    assert counter.counted == 3 * (2 + 2 * len(ms))  # every request counts every piece


def test_the_table_is_bounded_in_the_characters_of_its_keys() -> None:
    table = PriceTable()
    table.put_many([(("x" * (BODY_CACHE_MAX_CHARS + 1), ""), 1)])
    assert not table.prices  # a content too long for the body cache is never kept
    size = 1000
    for i in range(3 * PRICE_TABLE_CHARS // size):
        table.put_many([((f"{i:08d}" + "y" * (size - 8), ""), i)])
        assert table.chars <= PRICE_TABLE_CHARS
        assert table.chars == sum(len(c) + len(s) for c, s in table.prices)
    assert 0 < len(table.prices) <= PRICE_TABLE_CHARS // size
