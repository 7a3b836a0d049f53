"""A least-recently-used map bounded in bytes, shareable with worker threads.

Every cache of the pure core (token counts, escaped bodies) is one of these, so
what a cache can keep alive is a number of bytes, not a number of entries
whose size an attacker chooses. The size of an entry is what `sizeof` says
(for strings, `sys.getsizeof` of the key and value) plus `ENTRY_OVERHEAD` for
the map's own node; an entry larger than `max_item_bytes` is never stored.

Reads take no lock: `dict.get` and `OrderedDict.move_to_end` are single C calls
that run under the GIL, and a key evicted between the two is ignored. Writes
(insert, evict, byte accounting) hold a `threading.Lock`, so assemblies may run
in worker threads (`trio.to_thread.run_sync`) as well as on the event loop.
The hit and miss counters are plain integers: exact on one thread, close
enough for metrics on several.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Bytes an entry costs beyond its key and value: the OrderedDict's hash slot,
#: its linked-list node and the entry's share of the table (about 100 on 64-bit
#: CPython, rounded up).
ENTRY_OVERHEAD = 128


def text_size(key: Hashable, value: object) -> int:
    """Key plus value as CPython stores them (small ints are shared: not counted)."""
    size = sys.getsizeof(key) + ENTRY_OVERHEAD
    if isinstance(value, str):
        size += sys.getsizeof(value)
    return size


class LRUInfo(NamedTuple):
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int


class ByteLRU(Generic[K, V]):
    """Least recently used entries are evicted until the stored bytes fit `max_bytes`."""

    __slots__ = (
        "_data",
        "_lock",
        "_sizeof",
        "bytes",
        "hits",
        "max_bytes",
        "max_entries",
        "max_item_bytes",
        "misses",
    )

    def __init__(
        self,
        max_bytes: int,
        *,
        max_entries: int | None = None,
        max_item_bytes: int | None = None,
        sizeof: Callable[[K, V], int] = text_size,
    ) -> None:
        self.max_bytes = max(0, max_bytes)
        self.max_entries = max_entries if max_entries is not None else sys.maxsize
        # By default one entry may take at most 1/16 of the budget, so a handful
        # of huge texts can never flush everything else.
        self.max_item_bytes = max_item_bytes if max_item_bytes is not None else self.max_bytes // 16
        self._sizeof = sizeof
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        """The value, marked as recently used; None (and a miss) when absent."""
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        try:  # noqa: SIM105  (contextlib.suppress costs more than the lookup)
            self._data.move_to_end(key)
        except KeyError:  # evicted by another thread since the get: still a valid answer
            pass
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> bool:
        """Store `value`, evicting the least recently used; False when the entry is too big."""
        if self.max_entries <= 0:
            return False
        size = self._sizeof(key, value)
        if size > self.max_item_bytes or size > self.max_bytes:
            return False
        data = self._data
        with self._lock:
            old = data.pop(key, None)
            if old is not None:
                self.bytes -= self._sizeof(key, old)
            data[key] = value
            self.bytes += size
            while self.bytes > self.max_bytes or len(data) > self.max_entries:
                evicted, evicted_value = data.popitem(last=False)
                self.bytes -= self._sizeof(evicted, evicted_value)
        return True

    def put_many(self, items: Iterable[tuple[K, V]]) -> None:
        for key, value in items:
            self.put(key, value)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.bytes = 0

    def info(self) -> LRUInfo:
        return LRUInfo(self.hits, self.misses, len(self._data), self.bytes, self.max_bytes)
