"""Stage 3, pricing: each candidate's exact cost, the tokens of its memory block."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ibex.assembly.history import Counter
from ibex.assembly.output_format import Format
from ibex.assembly.structs import ScoredMemory

__all__ = ["price", "pricer"]


def pricer(
    count: Callable[[str], int], body: Callable[[str], str], fmt: Format
) -> Callable[[ScoredMemory], ScoredMemory]:
    """A candidate with its token_estimate: the cost of its block's pieces.

    The opening piece is priced as its two parts (see ibex.assembly.output_format);
    memory blocks carry no nonce, so every count is cacheable by text. `count`
    and `body` (the escaped body piece) are the counter's and the format's, or a
    `DeferredCache`'s, which keeps new entries out of the caches until committed.
    """
    fixed = count(fmt.memory_open_prefix) + count(fmt.memory_close)
    suffix = fmt.memory_open_suffix
    replace = msgspec.structs.replace
    # The previous candidate's content and its body's count: a hit's scored variants
    # (one per schema) share their content object, so its body is escaped and
    # counted once; a `DeferredCache` counts what is not cached yet every time it is asked.
    last_content: str | None = None
    last_tokens = 0

    def priced(m: ScoredMemory) -> ScoredMemory:
        nonlocal last_content, last_tokens
        if m.content is not last_content:
            last_content, last_tokens = m.content, count(body(m.content))
        return replace(m, token_estimate=fixed + count(suffix(m)) + last_tokens)

    return priced


def price(candidates: list[ScoredMemory], counter: Counter, fmt: Format) -> list[ScoredMemory]:
    """Stage 3: each candidate's token_estimate (`pricer`, straight to the caches)."""
    priced = pricer(counter.count, fmt.body_piece, fmt)
    return [priced(m) for m in candidates]
