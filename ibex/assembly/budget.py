"""The token budget: what is left for memories once everything else is reserved."""

from __future__ import annotations

from ibex.assembly.catalog import FamilyPolicy, ModelCapability
from ibex.assembly.structs import TokenBudget

MIN_RESPONSE_RESERVE = 500
MAX_RESPONSE_RESERVE = 4096
RESERVE_FRACTION = 0.15
CONSTRAINED_BELOW = 256


def context_window(capability: ModelCapability, available_tokens: int) -> int:
    """The caller may cap the window (available_tokens > 0), never widen it."""
    if available_tokens > 0:
        return min(capability.context_window, available_tokens)
    return capability.context_window


def response_reserve(window: int, max_output_tokens: int) -> int:
    return max(
        MIN_RESPONSE_RESERVE,
        min(int(window * RESERVE_FRACTION), max_output_tokens, MAX_RESPONSE_RESERVE),
    )


def context_ceiling(
    capability: ModelCapability, family: FamilyPolicy, available_tokens: int
) -> int:
    """The most the assembled context may take: the window less reserve and safety."""
    window = context_window(capability, available_tokens)
    reserve = response_reserve(window, capability.max_output_tokens)
    return max(0, window - reserve - int(window * family.safety_buffer_fraction))


def compute_budget(
    capability: ModelCapability,
    family: FamilyPolicy,
    *,
    estimate_kind: str,
    available_tokens: int,
    directive_tokens: int,
    messages_tokens: int,
    tool_schema_tokens: int,
    formatter_overhead_tokens: int,
    messages_dropped: int = 0,
    messages_dropped_tokens: int = 0,
) -> TokenBudget:
    """Every term of the seed's budget formula; usable is clamped at zero."""
    window = context_window(capability, available_tokens)
    reserve = response_reserve(window, capability.max_output_tokens)
    safety = int(window * family.safety_buffer_fraction)
    usable = (
        window
        - reserve
        - safety
        - directive_tokens
        - messages_tokens
        - tool_schema_tokens
        - formatter_overhead_tokens
    )
    usable = max(0, usable)
    return TokenBudget(
        context_window=window,
        response_reserve=reserve,
        safety_buffer=safety,
        directive_tokens=directive_tokens,
        messages_tokens=messages_tokens,
        tool_schema_tokens=tool_schema_tokens,
        formatter_overhead_tokens=formatter_overhead_tokens,
        usable_budget=usable,
        constrained=usable < CONSTRAINED_BELOW,
        tokenizer_family=family.name,
        estimate_kind=estimate_kind,
        messages_dropped=messages_dropped,
        messages_dropped_tokens=messages_dropped_tokens,
    )
