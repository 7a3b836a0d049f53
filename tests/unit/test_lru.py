"""ByteLRU: hits and misses are counted one per lookup (they feed the cache metrics)."""

from __future__ import annotations

import sys

from ibex.assembly.lru import ENTRY_OVERHEAD, ByteLRU, text_size


def test_each_lookup_counts_one_hit_or_one_miss() -> None:
    cache: ByteLRU[str, int] = ByteLRU(1 << 20)
    assert cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("a") == 1
    assert cache.get("a") == 1
    assert cache.get("b") is None
    assert cache.get("c") is None
    assert (cache.hits, cache.misses) == (3, 2)


def test_info_counts_hits_and_misses_and_clear_empties_the_bytes() -> None:
    lru: ByteLRU[str, str] = ByteLRU(1 << 20)
    lru.put("a", "x")
    assert lru.get("a") == "x" and lru.get("b") is None and lru.get("a") == "x"
    info = lru.info()
    assert (info.hits, info.misses, info.entries) == (2, 1, 1) and info.bytes > 0
    lru.clear()
    assert lru.info().entries == 0 and lru.info().bytes == 0


def test_an_entry_is_charged_its_key_and_a_string_value_as_cpython_holds_them() -> None:
    key, value = "k" * 100, "v" * 1000
    assert text_size(key, value) == sys.getsizeof(key) + ENTRY_OVERHEAD + sys.getsizeof(value)
    assert text_size(key, 7) == sys.getsizeof(key) + ENTRY_OVERHEAD  # small ints are shared


def _sized(sizes: dict[str, int]) -> ByteLRU[str, str]:
    """A cache of 100 bytes whose entries cost what `sizes` says (by key)."""
    return ByteLRU(100, max_item_bytes=60, sizeof=lambda key, value: sizes[key] + len(value))


def test_an_entry_up_to_the_item_limit_is_stored_and_one_over_it_never() -> None:
    lru = _sized({"fits": 60, "over": 61})
    assert lru.put("fits", "") and lru.get("fits") == ""
    assert not lru.put("over", "") and lru.get("over") is None
    assert lru.bytes == 60


def test_the_stored_bytes_may_reach_the_budget_and_the_oldest_goes_past_it() -> None:
    lru = _sized({"a": 50, "b": 50, "c": 1})
    lru.put("a", "")
    lru.put("b", "")
    assert len(lru) == 2 and lru.bytes == 100  # exactly the budget: nothing evicted
    lru.put("c", "")
    assert lru.get("a") is None and lru.get("b") == "" and lru.bytes == 51


def test_a_lookup_makes_an_entry_the_most_recently_used() -> None:
    lru = _sized({"a": 40, "b": 40, "c": 40})
    lru.put("a", "")
    lru.put("b", "")
    assert lru.get("a") == ""  # now b is the least recently used
    lru.put("c", "")
    assert lru.get("b") is None and lru.get("a") == "" and lru.get("c") == ""


def test_replacing_an_entry_charges_its_new_value_and_refunds_the_old_one() -> None:
    lru = _sized({"a": 10})
    lru.put("a", "x" * 30)
    assert lru.bytes == 40
    lru.put("a", "y" * 5)
    assert lru.bytes == 15 and len(lru) == 1 and lru.get("a") == "y" * 5


def test_no_budget_or_no_entries_stores_nothing() -> None:
    assert not ByteLRU(0).put("a", "x")
    assert not ByteLRU(-5).put("a", "x") and ByteLRU(-5).max_bytes == 0
    none: ByteLRU[str, str] = ByteLRU(1 << 20, max_entries=0)
    assert not none.put("a", "x") and len(none) == 0
    one: ByteLRU[str, str] = ByteLRU(1 << 20, max_entries=1)
    one.put("a", "x")
    one.put("b", "y")
    assert len(one) == 1 and one.get("b") == "y"


def test_by_default_one_entry_may_take_a_sixteenth_of_the_budget() -> None:
    """The default item limit: 1/16 of max_bytes (so a few huge texts cannot flush the rest)."""
    lru: ByteLRU[str, int] = ByteLRU(1600, sizeof=lambda key, value: value)
    assert lru.max_item_bytes == 100
    assert lru.put("at", 100) and lru.get("at") == 100
    assert not lru.put("over", 101) and lru.get("over") is None


def test_an_entry_as_large_as_the_whole_budget_is_stored_when_the_item_limit_allows() -> None:
    lru: ByteLRU[str, int] = ByteLRU(100, max_item_bytes=1000, sizeof=lambda key, value: value)
    assert lru.put("all", 100) and lru.bytes == 100 and lru.get("all") == 100
    assert not lru.put("more", 101) and lru.get("all") == 100
