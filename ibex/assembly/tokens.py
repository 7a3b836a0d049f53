"""Token counting: exact and offline for OpenAI encodings, a labelled estimate otherwise.

Exact counts use tiktoken with verified local rank files (`rank_files`);
families without an offline tokenizer get `estimate_v1` (`estimate`, where its
measured error is documented). Counts are cached in LRUs bounded in bytes.

Counts of one kind must never be added to counts of another: use `Count` or
`ensure_same_kind`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from typing import Annotated, NamedTuple

import msgspec
import tiktoken

from ibex.assembly.estimate import ESTIMATE_MAX_UNDERCOUNT, ESTIMATE_V1, estimate_v1
from ibex.assembly.lru import ENTRY_OVERHEAD, ByteLRU
from ibex.assembly.rank_files import (
    ENCODINGS,
    ENDOFPROMPT,
    ENDOFTEXT,
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    EncodingSpec,
    TokenizerError,
    load_encoding,
    verify_files,
)
from ibex.envvar import env

__all__ = [
    "ENCODINGS",
    "ENDOFPROMPT",
    "ENDOFTEXT",
    "ESTIMATE_MAX_UNDERCOUNT",
    "ESTIMATE_V1",
    "EXACT",
    "FIM_MIDDLE",
    "FIM_PREFIX",
    "FIM_SUFFIX",
    "CacheInfo",
    "Count",
    "EncodingSpec",
    "TokenCacheConfig",
    "TokenCounter",
    "TokenizerError",
    "Tokenizers",
    "ensure_same_kind",
    "estimate_v1",
    "load_encoding",
    "verify_files",
]

EXACT = "exact"

#: Texts longer than this (in characters) are counted but never cached, so one
#: huge text cannot pin memory (the byte bound also refuses any entry above
#: 1/16 of the cache's bytes).
CACHE_MAX_TEXT_CHARS = 64 * 1024


# --------------------------------------------------------------------------- counters


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    uncached: int
    size: int
    capacity: int
    bytes: int = 0
    max_bytes: int = 0


#: Default byte budget of each count cache.
DEFAULT_CACHE_BYTES = 32 * 1024 * 1024


class TokenCacheConfig(msgspec.Struct, frozen=True):
    """Bounds of each encoding's token-count cache (0 turns it off)."""

    entries: Annotated[int, env("IBEX_CONTEXT_TOKEN_CACHE_ENTRIES", bounds=(0, 10_000_000))] = 65536
    max_bytes: Annotated[int, env("IBEX_CONTEXT_TOKEN_CACHE_BYTES", bounds=(0, 4 * 1024**3))] = (
        DEFAULT_CACHE_BYTES
    )


#: A cached count is a small int (its object counted once, shared or not).
_COUNT_SIZE = 32


def _count_entry_size(text: str, _n: int) -> int:
    return sys.getsizeof(text) + ENTRY_OVERHEAD + _COUNT_SIZE


class _CachedCount:
    """A count function behind an LRU bounded in bytes, shared by every family using it.

    Safe to call from worker threads (see ibex.assembly.lru). `peek` and
    `remember` let the pipeline look counts up during a request and store the
    new ones only once the request is known to fit, so a refused request
    leaves the cache as it found it.
    """

    def __init__(self, fn: Callable[[str], int], capacity: int, max_bytes: int) -> None:
        self._fn = fn
        self._capacity = max(0, capacity)
        self._lru: ByteLRU[str, int] = ByteLRU(
            max_bytes, max_entries=self._capacity, sizeof=_count_entry_size
        )
        self.misses = 0
        self.uncached = 0
        #: The cached count, or None; never computes, never stores. The LRU's own
        #: lookup, bound here: it runs for every piece a request prices.
        self.peek: Callable[[str], int | None] = self._lru.get

    @property
    def hits(self) -> int:
        """Lookups that found a count: the LRU's, since only `peek` and `count` look."""
        return self._lru.hits

    def store(self, text: str, n: int) -> None:
        if len(text) <= CACHE_MAX_TEXT_CHARS and self._lru.put(text, n):
            self.misses += 1
        else:
            self.uncached += 1

    def count(self, text: str) -> int:
        n = self._lru.get(text)
        if n is not None:
            return n
        n = self._fn(text)
        self.store(text, n)
        return n

    def info(self) -> CacheInfo:
        lru = self._lru
        return CacheInfo(
            self.hits,
            self.misses,
            self.uncached,
            len(lru),
            self._capacity,
            lru.bytes,
            lru.max_bytes,
        )


# A split the pre-tokenisers of cl100k_base and o200k_base always make: a letter
# (or a non-decimal number) followed by a space, a newline or punctuation other
# than an apostrophe. No pre-token that contains a letter extends past its
# letters (o200k_base's only exception is a contraction, which starts with
# "'"), and no pre-token reaches back before its first character, so the text
# before such a cut tokenises exactly as it does inside the whole text.
_ADDITIVE_CUT = re.compile(
    r"(?<=[^\W\d_])[ \n!-&(-/:-@\[-`{-~\u3001\u3002\uff0c\uff1a\uff1b\uff1f\uff01]"
)
_CUT_WINDOWS = (1024, 16384)


def _last_additive_cut(text: str) -> int:
    """The last safe cut in `text` (see _ADDITIVE_CUT), or 0 when none is found near its end."""
    for window in _CUT_WINDOWS:
        found = 0
        for m in _ADDITIVE_CUT.finditer(text, max(0, len(text) - window)):
            found = m.start()
        if found:
            return found
    return 0


def _whole(text: str) -> int:
    return len(text)


class TokenCounter:
    """Counts tokens for one tokenizer family; `estimate_kind` labels every count it gives.

    `count` is cached (a hit is a dict lookup); `count_uncached` always recomputes.
    `additive_cut(text)` is an index c such that no text starting with `text`
    counts fewer tokens than `text[:c]`, and `max_token_bytes` the longest token:
    together they prove that a long text cannot fit without counting all of it.
    """

    __slots__ = (
        "_cached",
        "additive_cut",
        "count_uncached",
        "encoding",
        "estimate_kind",
        "exact",
        "family",
        "max_token_bytes",
        "price_tables",
    )

    def __init__(
        self,
        family: str,
        encoding: str | None,
        estimate_kind: str,
        cached: _CachedCount,
        max_token_bytes: int = 0,
    ) -> None:
        self.family = family
        self.encoding = encoding
        self.estimate_kind = estimate_kind
        self.exact = estimate_kind == EXACT
        self._cached = cached
        self.count_uncached: Callable[[str], int] = cached._fn
        # 0: no byte bound; estimate_v1 never decreases as a text grows, so any
        # prefix is a lower bound and the whole prefix can be used.
        self.max_token_bytes = max_token_bytes
        self.additive_cut: Callable[[str], int] = _last_additive_cut if self.exact else _whole
        #: Memory prices summed from this counter's counts, by format (ibex.assembly.pricing).
        self.price_tables: dict[object, object] = {}

    def count(self, text: str) -> int:
        return self._cached.count(text)

    def peek(self, text: str) -> int | None:
        """The cached count, if any; nothing is computed or stored."""
        return self._cached.peek(text)

    def remember(self, items: Iterable[tuple[str, int]]) -> None:
        """Store counts computed with `count_uncached` once they are worth keeping."""
        store = self._cached.store
        for text, n in items:
            store(text, n)

    def counted(self, text: str) -> Count:
        """The count with its kind attached, for sums that must not mix kinds."""
        return Count(self._cached.count(text), self.estimate_kind)

    def cache_info(self) -> CacheInfo:
        """Hit/miss counters of the cache this counter shares with same-encoding families."""
        return self._cached.info()

    def __repr__(self) -> str:
        return f"TokenCounter(family={self.family!r}, estimate_kind={self.estimate_kind!r})"


class Tokenizers:
    """Counters per family, with encodings loaded lazily once and caches shared per encoding.

    Loading an encoding takes a fraction of a second and blocks: call `preload` at start-up
    with the catalog's encodings so no request pays for it.
    """

    def __init__(
        self, tiktoken_dir: str | None, cache_entries: int, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.tiktoken_dir = tiktoken_dir
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self._encodings: dict[str, tiktoken.Encoding] = {}
        self._max_token_bytes: dict[str, int] = {}
        self._backends: dict[str, _CachedCount] = {}
        self._counters: dict[tuple[str, str | None], TokenCounter] = {}

    def encoding(self, name: str) -> tiktoken.Encoding:
        enc = self._encodings.get(name)
        if enc is None:
            enc = load_encoding(name, self.tiktoken_dir)
            self._max_token_bytes[name] = max(map(len, enc.token_byte_values()))
            self._encodings[name] = enc
        return enc

    def preload(self, encodings: Iterable[str]) -> None:
        for name in encodings:
            self.encoding(name)

    def counter(self, family: str, encoding: str | None) -> TokenCounter:
        """Exact counter for an encoding name; `None` means the estimate for this family."""
        key = (family, encoding)
        counter = self._counters.get(key)
        if counter is not None:
            return counter
        max_bytes = 0
        if encoding is None:
            kind, backend_key = ESTIMATE_V1, ESTIMATE_V1
            fn: Callable[[str], int] = estimate_v1
        else:
            encode = self.encoding(encoding).encode_ordinary
            max_bytes = self._max_token_bytes[encoding]

            def fn(text: str) -> int:
                return len(encode(text))

            kind, backend_key = EXACT, encoding
        backend = self._backends.get(backend_key)
        if backend is None:
            backend = self._backends[backend_key] = _CachedCount(
                fn, self.cache_entries, self.cache_bytes
            )
        counter = self._counters[key] = TokenCounter(family, encoding, kind, backend, max_bytes)
        return counter

    def cache_info(self) -> dict[str, CacheInfo]:
        """Per backend (encoding name or estimate kind), for metrics."""
        return {key: backend.info() for key, backend in self._backends.items()}


# --------------------------------------------------------------------------- kinds


class Count(msgspec.Struct, frozen=True):
    """A token count labelled with its kind; adding two kinds raises TokenizerError."""

    tokens: int
    kind: str

    def __add__(self, other: Count) -> Count:
        if other.kind != self.kind:
            raise TokenizerError(f"cannot add a {other.kind} count to a {self.kind} count")
        return Count(self.tokens + other.tokens, self.kind)


def ensure_same_kind(*counters: TokenCounter | Count) -> str:
    """The one estimate kind shared by all arguments; raises if they differ."""
    kinds = {c.estimate_kind if isinstance(c, TokenCounter) else c.kind for c in counters}
    if len(kinds) != 1:
        raise TokenizerError(f"token counts of different kinds mixed: {', '.join(sorted(kinds))}")
    return kinds.pop()
