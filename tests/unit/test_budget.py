"""Budget arithmetic against the seed's formula, incl. tiny and huge windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex.assembly import budget as budget_mod
from ibex.assembly.budget import (
    compute_budget,
    context_ceiling,
    context_window,
    response_reserve,
)
from ibex.assembly.catalog import (
    UNKNOWN_MODEL_MAX_OUTPUT,
    Catalog,
    FamilyPolicy,
    ModelCapability,
    load_catalog,
    resolve_model,
)
from ibex.errors import InputError

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


# ---------------------------------------------------------------------------
# Budget boundaries, one side and the other: the seed's formula term by term.
#
# usable = W - reserve - safety - directive - messages - tools - overhead, with
# W = the model's window capped (never widened) by available_tokens > 0,
# reserve = max(500, min(floor(0.15 W), max_output, 4096)),
# safety = floor(W x family fraction); clamped at 0, constrained below 256.

FAM_X = FamilyPolicy(safety_buffer_fraction=0.05, encoding=None, name="fam-x")
NO_SAFETY = FamilyPolicy(safety_buffer_fraction=0.0, encoding=None, name="bare")


def cap_x(window: int, max_out: int = 100_000) -> ModelCapability:
    return ModelCapability("p", window, max_out, "fam-x", "m")


def budget(
    window: int,
    *,
    max_out: int = 100_000,
    family: FamilyPolicy = FAM_X,
    available: int = 0,
    directive: int = 0,
    messages: int = 0,
    tools: int = 0,
    overhead: int = 0,
    kind: str = "estimate_v1",
) -> budget_mod.TokenBudget:
    return compute_budget(
        cap_x(window, max_out),
        family,
        estimate_kind=kind,
        available_tokens=available,
        directive_tokens=directive,
        messages_tokens=messages,
        tool_schema_tokens=tools,
        formatter_overhead_tokens=overhead,
    )


def test_documented_constants() -> None:
    assert budget_mod.MIN_RESPONSE_RESERVE == 500
    assert budget_mod.MAX_RESPONSE_RESERVE == 4096
    assert budget_mod.RESERVE_FRACTION == 0.15
    assert budget_mod.CONSTRAINED_BELOW == 256
    assert UNKNOWN_MODEL_MAX_OUTPUT == 4096


@pytest.mark.parametrize(
    ("window", "available", "expected"),
    [
        (10_000, 0, 10_000),  # 0 = not set
        (10_000, 1, 1),
        (10_000, 9_999, 9_999),
        (10_000, 10_000, 10_000),
        (10_000, 10_001, 10_000),  # never widened
        (10_000, -5, 10_000),  # negative is refused by validation; here it is "not set"
    ],
)
def test_available_tokens_caps_but_never_widens(window: int, available: int, expected: int) -> None:
    assert context_window(cap_x(window), available) == expected
    assert budget(window, available=available).context_window == expected


@pytest.mark.parametrize(
    ("window", "max_out", "reserve"),
    [
        (1_000, 100_000, 500),  # 15 % = 150: the floor of 500
        (3_333, 100_000, 500),  # 499.95
        (3_334, 100_000, 500),  # 500.1
        (3_339, 100_000, 500),  # 500.85 is floored, not rounded
        (3_340, 100_000, 501),
        (10_000, 100_000, 1_500),
        (10_007, 100_000, 1_501),  # 1501.05
        (27_306, 100_000, 4_095),  # 4095.9
        (27_307, 100_000, 4_096),  # 4096.05: the cap
        (28_000, 100_000, 4_096),
        (1_000_000, 100_000, 4_096),
        (10_000, 1_000, 1_000),  # max output below 15 %
        (10_000, 1_499, 1_499),
        (10_000, 1_501, 1_500),
        (10_000, 499, 500),  # max output below the floor: the floor wins
        (10_000, 500, 500),
        (10_000, 501, 501),
        (100_000, 4_095, 4_095),
        (100_000, 4_097, 4_096),
    ],
)
def test_response_reserve_bounds(window: int, max_out: int, reserve: int) -> None:
    assert response_reserve(window, max_out) == reserve
    assert budget(window, max_out=max_out).response_reserve == reserve


@pytest.mark.parametrize(
    ("window", "fraction", "safety"),
    [
        (10_000, 0.05, 500),
        (10_019, 0.05, 500),  # 500.95 floored
        (10_020, 0.05, 501),
        (10_000, 0.0, 0),
        (10_000, 0.1, 1_000),
        (999, 0.01, 9),
    ],
)
def test_safety_buffer_is_the_floor_of_the_family_fraction(
    window: int, fraction: float, safety: int
) -> None:
    fam = FamilyPolicy(safety_buffer_fraction=fraction, name="f")
    assert budget(window, family=fam).safety_buffer == safety


def test_safety_buffer_uses_the_capped_window() -> None:
    b = budget(100_000, available=10_000)
    assert (b.context_window, b.response_reserve, b.safety_buffer) == (10_000, 1_500, 500)


def test_every_term_is_subtracted_once_and_reported() -> None:
    b = budget(10_000, directive=101, messages=203, tools=307, overhead=401, kind="exact")
    # 10000 - 1500 - 500 - 101 - 203 - 307 - 401
    assert b.usable_budget == 6_988
    assert (
        b.context_window,
        b.response_reserve,
        b.safety_buffer,
        b.directive_tokens,
        b.messages_tokens,
        b.tool_schema_tokens,
        b.formatter_overhead_tokens,
    ) == (10_000, 1_500, 500, 101, 203, 307, 401)
    assert b.tokenizer_family == "fam-x"
    assert b.estimate_kind == "exact"
    assert not b.constrained
    assert b.ceiling == 8_000


@pytest.mark.parametrize(
    ("usable", "constrained"),
    [(0, True), (1, True), (255, True), (256, False), (257, False), (5_000, False)],
)
def test_constrained_exactly_below_256(usable: int, constrained: bool) -> None:
    # window 10000: reserve 1500, safety 500, so 8000 before the content terms.
    b = budget(10_000, directive=8_000 - usable)
    assert b.usable_budget == usable
    assert b.constrained is constrained


@pytest.mark.parametrize("over", [1, 2, 1_000_000])
def test_usable_is_clamped_at_zero(over: int) -> None:
    b = budget(10_000, messages=8_000 + over)
    assert b.usable_budget == 0
    assert b.constrained
    assert b.ceiling == 8_000  # the ceiling ignores content: window - reserve - safety


def test_ceiling_is_clamped_at_zero() -> None:
    fam = FamilyPolicy(safety_buffer_fraction=0.4, name="f")
    b = budget(600, family=fam)  # 600 - 500 - 240 < 0
    assert (b.response_reserve, b.safety_buffer) == (500, 240)
    assert b.ceiling == 0
    assert b.usable_budget == 0


def test_context_ceiling_is_clamped_at_zero_like_the_budgets() -> None:
    """The pipeline's and the client's ceiling: the same rule, the same clamp."""
    fam = FamilyPolicy(safety_buffer_fraction=0.4, name="f")
    assert context_ceiling(cap_x(600), fam, 0) == 0
    assert context_ceiling(cap_x(600), FAM_X, 500) == 0  # 500 - 500 - 25
    assert context_ceiling(cap_x(600), FAM_X, 0) == 600 - 500 - 30


def test_a_budget_without_left_out_history_reports_none_dropped() -> None:
    """messages_dropped counts the oldest messages left out (contract, TokenBudget 12, 13):
    a budget told of none reports zero, not a default guess."""
    b = budget(10_000, messages=100)
    assert (b.messages_dropped, b.messages_dropped_tokens) == (0, 0)


# --------------------------------------------------------------------------- unknown models


def _catalog() -> Catalog:
    return Catalog(
        {"unknown": FamilyPolicy(0.05), "fam-x": FamilyPolicy(0.01, "o200k_base")},
        {"known-model": ModelCapability("p", 50_000, 2_000, "fam-x")},
    )


def test_unknown_model_is_sized_by_available_tokens() -> None:
    got = resolve_model(_catalog(), "mystery-1", 12_345)
    assert got == ModelCapability(
        provider="unknown",
        context_window=12_345,
        max_output_tokens=UNKNOWN_MODEL_MAX_OUTPUT,
        tokenizer_family="unknown",
        model_id="mystery-1",
    )
    assert got.max_output_tokens == 4096


def test_unknown_model_budget_uses_the_unknown_max_output() -> None:
    got = resolve_model(_catalog(), "mystery-1", 40_000)
    # 15 % of 40000 = 6000, above the unknown model's 4096 output cap
    assert response_reserve(got.context_window, got.max_output_tokens) == 4_096


@pytest.mark.parametrize("available", [0, -1])
def test_unknown_model_without_available_tokens_is_refused(available: int) -> None:
    with pytest.raises(InputError) as info:
        resolve_model(_catalog(), "mystery-1" + "x" * 100, available)
    assert info.value.field == "model"
    # The echoed name is cut at 64 characters.
    name = ("mystery-1" + "x" * 100)[:64]
    # It says what would be accepted: the known ids, the catalog setting, a window.
    assert str(info.value) == (
        f"model: unknown model {name!r} and available_tokens not set; known models: "
        "known-model (a dated id resolves to the known id it starts with); "
        "add models with IBEX_CONTEXT_CATALOG_PATH, or send available_tokens"
    )


def test_unknown_model_error_lists_a_bounded_number_of_known_models() -> None:
    """An operator catalog may add hundreds of models: the error names the first 20 in
    sorted order and counts the rest."""
    models = {f"m{i:03d}": ModelCapability("p", 50_000, 2_000, "fam-x") for i in range(45)}
    catalog = Catalog(
        {"unknown": FamilyPolicy(0.05), "fam-x": FamilyPolicy(0.01, "o200k_base")}, models
    )
    with pytest.raises(InputError) as info:
        resolve_model(catalog, "mystery", 0)
    listed = ", ".join(f"m{i:03d}" for i in range(20))
    assert f"known models: {listed} and 25 more (" in str(info.value)


def test_known_model_ignores_available_tokens_when_resolving() -> None:
    for available in (0, 1, 999_999):
        got = resolve_model(_catalog(), "known-model", available)
        assert (got.context_window, got.max_output_tokens, got.tokenizer_family) == (
            50_000,
            2_000,
            "fam-x",
        )
