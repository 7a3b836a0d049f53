"""Stage 1, the fixed sections: what every answer carries whatever memories fit.

Directive, tools, the history that fits and the memories section's markup are
counted once per request, and the budget left for memories follows from them.
The oldest history messages are left out until the rest fits (see
ibex.assembly.history); a request that cannot fit is refused here with a
`TooLargeError` naming the sizes.
"""

from __future__ import annotations

import functools

import msgspec

from ibex.assembly.budget import compute_budget, context_ceiling
from ibex.assembly.catalog import FamilyPolicy, ModelCapability
from ibex.assembly.history import Counter, DeferredCache, dropped_tokens, fit_history, without_empty
from ibex.assembly.output_format import Format, SectionOrder, safety_emitted
from ibex.assembly.structs import AssemblyRequest, Directive, Message, TokenBudget
from ibex.errors import TooLargeError

__all__ = ["FixedSections", "count_fixed_sections"]


class FixedSections(msgspec.Struct, frozen=True, gc=False):
    """What every answer carries whatever memories fit, counted once, and the budget."""

    directive_tokens: int  # the directive section alone
    safety_tokens: int  # the safety sentence, emitted with memories (or `safety_fixed`)
    history_tokens: int
    tool_tokens: int
    overhead_tokens: int  # the memories section's open and close, emitted only with memories
    budget: TokenBudget
    messages: tuple[Message, ...]  # the history that fits: the newest messages
    # The safety sentence is written with or without memories (the `cache` order with
    # a directive, tools or history; see ibex.assembly.output_format.safety_emitted).
    safety_fixed: bool = False


def count_fixed_sections(
    request: AssemblyRequest,
    directive: Directive | None,
    nonce: str,
    cap: ModelCapability,
    family: FamilyPolicy,
    counter: Counter,
    fmt: Format,
    order: SectionOrder = "seed",
) -> FixedSections:
    """Stage 1: count directive, tools, the history that fits and markup; the budget left.

    The oldest history messages are left out until the rest fits (counted
    newest first, never past the ceiling; see ibex.assembly.history). New
    counts and escaped bodies are cached only once the request is known to
    fit, so a refused request leaves every cache as it was. In the `cache`
    order a kept history brings the safety sentence with it, so the history
    fits in what is left after it too.
    """
    deferred = DeferredCache(counter, fmt)
    # Pieces carrying the nonce: a decimal nonce costs what zeros of its width
    # cost, so those counts are cached once; any other nonce is new every
    # request and counted uncached (see DeferredCache.with_nonce).
    safety_tokens = deferred.with_nonce(fmt.safety_piece, nonce)
    directive_tokens = 0
    if directive is not None:
        body = deferred.body(directive.content)
        if body:
            directive_tokens = (
                deferred.with_nonce(functools.partial(fmt.directive_open, directive), nonce)
                + deferred.count(body)
                + deferred.count(fmt.directive_close)
            )
    tool_tokens = 0
    if request.tool_schemas:
        per_tool = deferred.count(fmt.tool_open) + deferred.count(fmt.tool_close)
        tool_tokens = deferred.with_nonce(fmt.tools_open, nonce) + deferred.count(fmt.tools_close)
        for schema in request.tool_schemas:
            body = deferred.body(schema)
            tool_tokens += per_tool + (deferred.count(body) if body else 0)
    overhead = deferred.with_nonce(fmt.memories_open, nonce) + deferred.count(fmt.memories_close)
    ceiling = context_ceiling(cap, family, request.available_tokens)
    # What the history fits beside: the directive and tools, and in the `cache` order
    # the safety sentence, which any kept history brings (`safety_emitted`).
    beside = directive_tokens + tool_tokens
    after = f"directive ({directive_tokens}) and tools ({tool_tokens})"
    if order == "cache":
        beside += safety_tokens
        after = (
            f"directive ({directive_tokens}), tools ({tool_tokens}) "
            f"and safety sentence ({safety_tokens})"
        )
    room = ceiling - beside
    messages = without_empty(request.recent_messages)
    fit = fit_history(counter, messages, nonce, room, deferred)
    safety_fixed = safety_emitted(
        order, memories=False, others=bool(directive_tokens or tool_tokens or fit.kept)
    )
    fixed_tokens = directive_tokens + tool_tokens + fit.tokens
    if safety_fixed:
        fixed_tokens += safety_tokens
    model = cap.model_id or request.model
    dropped = len(messages) - len(fit.kept)
    if dropped and not fit.kept:
        raise TooLargeError(
            "recent_messages",
            f"the newest message alone needs at least {fit.overflow} tokens; the model "
            f"{model!r} leaves {max(0, room)} of its {ceiling}-token context ceiling after the "
            f"{after}",
        )
    if dropped and request.options.reject_history_overflow:
        raise TooLargeError(
            "recent_messages",
            f"the history needs at least {fit.tokens + fit.overflow} tokens; the model "
            f"{model!r} leaves {max(0, room)} of its {ceiling}-token context ceiling after the "
            f"{after}, and reject_history_overflow is set",
        )
    if fixed_tokens > ceiling:
        raise TooLargeError(
            "recent_messages",
            f"directive, history and tools{' with the safety sentence' if safety_fixed else ''} "
            f"take {fixed_tokens} tokens, more than the {ceiling} the model {model!r} leaves "
            "for context",
        )
    deferred.commit()
    budget = compute_budget(
        cap,
        family,
        estimate_kind=counter.estimate_kind,
        available_tokens=request.available_tokens,
        directive_tokens=directive_tokens + safety_tokens,
        messages_tokens=fit.tokens,
        tool_schema_tokens=tool_tokens,
        formatter_overhead_tokens=overhead,
        messages_dropped=dropped,
        messages_dropped_tokens=(
            dropped_tokens(counter, messages[:dropped], ceiling, fmt) if dropped else 0
        ),
    )
    return FixedSections(
        directive_tokens=directive_tokens,
        safety_tokens=safety_tokens,
        history_tokens=fit.tokens,
        tool_tokens=tool_tokens,
        overhead_tokens=overhead,
        budget=budget,
        messages=fit.kept,
        safety_fixed=safety_fixed,
    )
