"""ByteLRU: hits and misses are counted one per lookup (they feed the cache metrics)."""

from __future__ import annotations

from ibex.assembly.lru import ByteLRU


def test_each_lookup_counts_one_hit_or_one_miss() -> None:
    cache: ByteLRU[str, int] = ByteLRU(1 << 20)
    assert cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("a") == 1
    assert cache.get("a") == 1
    assert cache.get("b") is None
    assert cache.get("c") is None
    assert (cache.hits, cache.misses) == (3, 2)
