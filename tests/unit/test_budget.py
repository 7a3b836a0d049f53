"""Budget arithmetic against the seed's formula, incl. tiny and huge windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex.assembly.budget import compute_budget, context_window, response_reserve
from ibex.assembly.catalog import FamilyPolicy, ModelCapability, load_catalog

FAMILY = FamilyPolicy(safety_buffer_fraction=0.01, encoding="o200k_base", name="o200k_base")


def cap(window: int, max_out: int) -> ModelCapability:
    return ModelCapability("openai", window, max_out, "o200k_base", "m")


@pytest.mark.parametrize(
    "window,max_out,available,exp_window,exp_reserve,exp_safety",
    [
        (128_000, 16_384, 0, 128_000, 4096, 1280),  # 15% = 19200, capped at 4096
        (16_385, 4_096, 0, 16_385, 2457, 163),  # 15% of 16385
        (128_000, 16_384, 8_000, 8_000, 1200, 80),  # available_tokens caps the window
        (128_000, 16_384, 1_000_000, 128_000, 4096, 1280),  # ...but never widens it
        (2_000, 4_096, 0, 2_000, 500, 20),  # floor of 500
        (1_047_576, 32_768, 0, 1_047_576, 4096, 10475),
        (200_000, 300, 0, 200_000, 500, 2000),  # max_output below the floor: floor wins
    ],
)
def test_terms(
    window: int, max_out: int, available: int, exp_window: int, exp_reserve: int, exp_safety: int
) -> None:
    b = compute_budget(
        cap(window, max_out),
        FAMILY,
        estimate_kind="exact",
        available_tokens=available,
        directive_tokens=100,
        messages_tokens=200,
        tool_schema_tokens=30,
        formatter_overhead_tokens=20,
    )
    assert (b.context_window, b.response_reserve, b.safety_buffer) == (
        exp_window,
        exp_reserve,
        exp_safety,
    )
    assert b.usable_budget == max(0, exp_window - exp_reserve - exp_safety - 350)
    assert b.constrained == (b.usable_budget < 256)
    assert b.tokenizer_family == "o200k_base" and b.estimate_kind == "exact"


def test_tiny_window_clamps_to_zero_and_is_constrained() -> None:
    b = compute_budget(
        cap(600, 100),
        FAMILY,
        estimate_kind="exact",
        available_tokens=0,
        directive_tokens=500,
        messages_tokens=0,
        tool_schema_tokens=0,
        formatter_overhead_tokens=0,
    )
    assert b.usable_budget == 0 and b.constrained
    assert b.ceiling == 600 - 500 - 6


@given(
    st.integers(1, 2_000_000),
    st.integers(1, 200_000),
    st.integers(0, 3_000_000),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
)
def test_usable_never_negative_and_reserve_bounded(
    window: int, max_out: int, available: int, directive: int, history: int
) -> None:
    b = compute_budget(
        cap(window, max_out),
        FAMILY,
        estimate_kind="exact",
        available_tokens=available,
        directive_tokens=directive,
        messages_tokens=history,
        tool_schema_tokens=0,
        formatter_overhead_tokens=0,
    )
    assert b.usable_budget >= 0
    assert 500 <= b.response_reserve <= 4096
    assert b.context_window == context_window(cap(window, max_out), available)
    assert b.response_reserve == response_reserve(b.context_window, max_out)
    assert b.usable_budget <= max(0, b.ceiling - directive - history)


def test_catalog_prefix_resolution_and_required_models() -> None:
    c = load_catalog()
    assert c.resolve("gpt-4o-2024-08-06").model_id == "gpt-4o"  # type: ignore[union-attr]
    assert c.resolve("gpt-4o-mini-2024-07-18").model_id == "gpt-4o-mini"  # type: ignore[union-attr]
    assert c.resolve("gpt-4") is None
    assert c.resolve("gpt-4ox") is None
    expect = {
        "gpt-4o": (128000, 16384, "o200k_base"),
        "gpt-4.1-mini": (1047576, 32768, "o200k_base"),
        "o4-mini": (200000, 100000, "o200k_base"),
        "gpt-5": (400000, 128000, "o200k_base"),
        "gpt-4-turbo": (128000, 4096, "cl100k_base"),
        "gpt-3.5-turbo": (16385, 4096, "cl100k_base"),
        "claude-haiku-4-5": (200000, 64000, "claude"),
    }
    for model, (w, o, fam) in expect.items():
        got = c.resolve(model)
        assert got is not None
        assert (got.context_window, got.max_output_tokens, got.tokenizer_family) == (w, o, fam)
