"""Stage 3, pricing: each candidate's exact cost, the tokens of its memory block.

A memory's cost is the sum of four counts: the opening tag's two parts, the
escaped body and the closing tag. The body and the tag suffix are looked up in
the token-count and escaped-body caches (four lookups behind a dozen calls per
memory), and the same hot memories come back request after request, so the sum
itself is kept too: `PriceTable`, one per counter and format, by the memory's
content and tag suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from ibex.assembly.history import Counter, DeferredCache
from ibex.assembly.output_format import BODY_CACHE_MAX_CHARS, Format
from ibex.assembly.structs import ScoredMemory

__all__ = ["PriceKey", "PriceTable", "commit_prices", "price", "price_table", "pricer"]

#: Characters of keys (contents and tag suffixes) one table holds before it is cleared.
PRICE_TABLE_CHARS = 1 << 21
#: Tables one counter keeps (one per format in use); all are dropped when one more is needed.
PRICE_TABLES = 16

PriceKey = tuple[str, str]  # (content, the opening tag's suffix)


class PriceTable:
    """Memory costs already summed, by (content, tag suffix), for one counter and format.

    Only sums whose tag-suffix and body counts came from the shared caches are
    entered, so a counter that keeps no cache (or a cache turned off, or a text too
    long to cache) is never bypassed. The opening tag's prefix and the closing tag,
    the same in every entry, are counted once per `pricer`, cached or not. Bounded
    in the characters of its keys: cleared whole when the next entry would pass
    PRICE_TABLE_CHARS (the same memories refill it on their next request).
    Entered from worker threads too (the pipeline runs in one for large texts):
    each dict operation is atomic, and two racing entries can only leave `chars`
    off by one key's length until the next clear.
    """

    __slots__ = ("chars", "prices")

    def __init__(self) -> None:
        self.prices: dict[PriceKey, int] = {}
        self.chars = 0

    def put_many(self, items: Iterable[tuple[PriceKey, int]]) -> None:
        prices = self.prices
        for key, n in items:
            size = len(key[0]) + len(key[1])
            if size > BODY_CACHE_MAX_CHARS or key in prices:
                continue
            if self.chars + size > PRICE_TABLE_CHARS:
                prices.clear()
                self.chars = 0
            prices[key] = n
            self.chars += size


def price_table(counter: Counter, fmt: Format) -> PriceTable:
    """The table of `counter` and `fmt`, held by the counter (`price_tables`, a dict a
    counter may carry: ibex.assembly.tokens's do), so it lives as long as the counts it
    sums. A counter without one gets a new, unshared table each time."""
    tables: dict[Format, PriceTable] | None = getattr(counter, "price_tables", None)
    if tables is None:
        return PriceTable()
    table = tables.get(fmt)
    if table is None:
        if len(tables) >= PRICE_TABLES:
            tables.clear()
        table = tables[fmt] = PriceTable()
    return table


def commit_prices(counter: Counter, fmt: Format, pending: list[tuple[PriceKey, int]]) -> None:
    """Enter the sums a request priced from cached counts, once it is known to fit."""
    if pending:
        price_table(counter, fmt).put_many(pending)
        pending.clear()


def pricer(
    counter: Counter,
    fmt: Format,
    deferred: DeferredCache | None = None,
    pending: list[tuple[PriceKey, int]] | None = None,
) -> Callable[[ScoredMemory], ScoredMemory]:
    """A candidate with its token_estimate: the cost of its block's pieces.

    The table's sum when it has one. Else the pieces are counted: through
    `deferred` when given (it keeps new counts and bodies out of the caches until
    committed), and a sum made only of cached counts goes to `pending`, for
    `commit_prices`; without it, by `counter` and `fmt` straight to their caches
    (the path of a branch not priced while retrieval waited: it reads the table
    and enters nothing).
    The opening piece is priced as its two parts (see
    ibex.assembly.output_format); memory blocks carry no nonce, so every count is
    cacheable by text.
    """
    if deferred is None:
        count, body = counter.count, fmt.body_piece
    else:
        count, body = deferred.count, deferred.body
    fixed = count(fmt.memory_open_prefix) + count(fmt.memory_close)
    suffix = fmt.memory_open_suffix
    known = price_table(counter, fmt).prices.get
    replace = msgspec.structs.replace
    # The previous candidate's content, suffix and cost: a hit's scored variants (one
    # per schema) share both objects, so its pieces are counted once; a
    # `DeferredCache` counts what is not cached yet every time it is asked.
    last_content: str | None = None
    last_suffix: str | None = None
    last_tokens = 0

    def priced(m: ScoredMemory) -> ScoredMemory:
        nonlocal last_content, last_suffix, last_tokens
        content, tag = m.content, suffix(m)
        if content is last_content and tag is last_suffix:
            return replace(m, token_estimate=last_tokens)
        n = known((content, tag))
        if n is None:
            if deferred is None or pending is None:
                n = fixed + count(tag) + count(body(content))
            else:
                staged = len(deferred.counts) + len(deferred.bodies)
                n = fixed + count(tag) + count(body(content))
                if len(deferred.counts) + len(deferred.bodies) == staged:
                    pending.append(((content, tag), n))
        last_content, last_suffix, last_tokens = content, tag, n
        return replace(m, token_estimate=n)

    return priced


def price(candidates: list[ScoredMemory], counter: Counter, fmt: Format) -> list[ScoredMemory]:
    """Stage 3: each candidate's token_estimate (`pricer`, straight to the caches)."""
    priced = pricer(counter, fmt)
    return [priced(m) for m in candidates]
