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
    lru: ByteLRU[str] = ByteLRU(1 << 20)
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
