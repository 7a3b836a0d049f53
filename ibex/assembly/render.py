"""Stage 5, rendering: the final text within the ceiling, and its verified count.

`tokens_used` is the sum of the final text's piece counts, which is the text's
exact count when every join is a pre-tokeniser split (the format's
`counts_add_up`, checked on the final pieces); otherwise the whole text is
re-counted. While the text is over the ceiling the lowest-value memory is
dropped and the block formatted again.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ibex.assembly.fixed_sections import FixedSections
from ibex.assembly.history import Counter
from ibex.assembly.output_format import Format, SectionOrder
from ibex.assembly.structs import AssemblyRequest, Directive, ScoredMemory
from ibex.errors import TooLargeError

__all__ = ["RenderedContext", "render_within_ceiling"]


class RenderedContext(msgspec.Struct, frozen=True, gc=False):
    """The final text, its verified count, the memories it holds and those dropped to fit."""

    text: str
    tokens_used: int
    ordered: list[ScoredMemory]
    dropped: list[ScoredMemory]


def render_within_ceiling(
    request: AssemblyRequest,
    directive: Directive | None,
    nonce: str,
    fixed: FixedSections,
    packed: Sequence[ScoredMemory],
    counter: Counter,
    model: str,
    fmt: Format,
    order: SectionOrder = "seed",
) -> RenderedContext:
    """Stage 5: format, verify the count, and drop the lowest-value memory while over."""
    ceiling = fixed.budget.ceiling
    kept = list(packed)
    dropped: list[ScoredMemory] = []
    base = fixed.directive_tokens + fixed.history_tokens + fixed.tool_tokens
    with_memories = fixed.overhead_tokens
    if fixed.safety_fixed:
        base += fixed.safety_tokens
    else:
        with_memories += fixed.safety_tokens
    while True:
        ordered = fmt.memory_order(kept)
        pieces = fmt.render_pieces(
            directive=directive,
            messages=fixed.messages,
            memories=ordered,
            tool_schemas=request.tool_schemas,
            nonce=nonce,
            order=order,
        )
        text = "".join(pieces)
        if fmt.counts_add_up(pieces):
            # The text's count is the sum of its pieces' (for the default format:
            # every join is a pre-tokeniser split; exact families, an upper bound
            # for estimate_v1): no need to re-tokenise ~15k characters per request.
            tokens_used = base
            if ordered:
                tokens_used += with_memories + sum([m.token_estimate for m in ordered])
        else:
            tokens_used = _exact_len(counter, text)
        if tokens_used <= ceiling:
            return RenderedContext(text, tokens_used, ordered, dropped)
        if not kept:
            raise TooLargeError(
                "recent_messages",
                f"directive, history and tools take {tokens_used} tokens, more than the "
                f"{ceiling} the model {model!r} leaves for context",
            )
        # A merge at a join made the text longer than its pieces: drop the
        # lowest-value memory (last in score order) and format again.
        dropped.append(kept.pop())


def _exact_len(counter: Counter, text: str) -> int:
    """Count a text that carries the nonce (unique per request) without caching it."""
    return counter.count_uncached(text)
