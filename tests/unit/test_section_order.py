"""IBEX_CONTEXT_SECTION_ORDER: `seed` (the default) and `cache` keep every formatting rule.

design.md, Formatting: the fixed order is directive (+ safety), history,
memories, tools; the opt-in `cache` order puts what changes least first
(directive, tools, safety, history, memories), and both orders keep every
other rule: the nonce on every section, escaping, budget truth (the exact
token count of `assembled_context` equals `tokens_used`, within the ceiling),
byte-identical output for identical inputs and nonce. In the `cache` order the
safety sentence sits in front of the history, so it is written whenever any
section is (ibex.assembly.output_format.safety_emitted): a turn without memories
must not change the prefix a provider caches.
"""

from __future__ import annotations

import re

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from ibex.assembly import output_format as format_mod
from ibex.assembly import xml_format as fmt
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.pipeline import (
    DEFAULT_CONFIG,
    AssemblyInputs,
    PipelineConfig,
    assemble_pure,
)
from ibex.assembly.prepare import EarlyAssembly
from ibex.assembly.structs import (
    AssemblyOptions,
    AssemblyRequest,
    AssemblyResult,
    Directive,
    Message,
)
from ibex.assembly.tokens import EXACT, Tokenizers
from ibex.config import PREFIX, SECTION_ORDERS, ConfigError, load_settings
from ibex.errors import TooLargeError
from ibex.service.root import effective_settings, layer_config, open_assembler
from ibex.sources.local_file import SAMPLE_AGENT_ID, SAMPLE_ORG_ID
from tests.unit.test_pipeline import EXACT_MODELS, NONCE, hit, inputs, request, scenarios

SEED = PipelineConfig(section_order="seed")
CACHE = PipelineConfig(section_order="cache")
# The sections in the order design.md gives for each.
ORDERS = {
    "seed": ["directive", "safety", "history", "memories", "tools"],
    "cache": ["directive", "tools", "safety", "history", "memories"],
}
SECTION_OPEN = re.compile(r"^<(directive|tools|safety|history|memories)( [^>\n]*)?>$", re.M)
TOOLS = ('{"name": "search_runbooks", "parameters": {"query": "string"}}', '{"name": "x"}')
DIRECTIVE = Directive("Answer as the support assistant.\nCite the runbook.", version_id="v1")


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    tk = Tokenizers(None, 65536)
    tk.preload(EXACT_MODELS.values())
    return tk


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def assemble(
    inp: AssemblyInputs,
    catalog: Catalog,
    tokenizers: Tokenizers,
    config: PipelineConfig,
    prepared: EarlyAssembly | None = None,
) -> AssemblyResult | None:
    """The result, or None when the fixed sections do not fit."""
    try:
        return assemble_pure(
            inp, catalog=catalog, tokenizers=tokenizers, config=config, early=prepared
        )
    except TooLargeError as exc:
        assert exc.field == "recent_messages"
        return None


def sections(text: str) -> list[tuple[str, str]]:
    """(element, attributes) of each section the block opens, in order."""
    return [(m[1], m[2] or "") for m in SECTION_OPEN.finditer(text)]


def check_block(
    result: AssemblyResult, inp: AssemblyInputs, tokenizers: Tokenizers, order: str
) -> list[str]:
    """Budget truth, the nonce on every section, the order's section sequence."""
    text = result.assembled_context
    enc = tokenizers.encoding(EXACT_MODELS[inp.request.model])
    assert result.budget.estimate_kind == EXACT
    assert result.tokens_used == len(enc.encode_ordinary(text))
    assert result.tokens_used <= result.budget.ceiling
    assert (
        result.directive_tokens
        + result.history_tokens
        + result.tool_tokens
        + result.formatter_tokens
        + result.memory_tokens
        == result.tokens_used
    )
    found = sections(text)
    names = [name for name, _ in found]
    assert names == [n for n in ORDERS[order] if n in names]  # each at most once, in order
    for name, attrs in found:
        assert attrs.startswith(f' nonce="{inp.nonce}"'), (name, attrs)
    assert ("memories" in names) == bool(result.memories_used)
    if result.memories_used:
        assert "safety" in names
    return names


# --------------------------------------------------------------------------- properties


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(list(EXACT_MODELS)))
def test_both_orders_keep_budget_truth_nonce_and_sections(
    tokenizers: Tokenizers, catalog: Catalog, inp: AssemblyInputs
) -> None:
    seed = assemble(inp, catalog, tokenizers, SEED)
    cache = assemble(inp, catalog, tokenizers, CACHE)
    # The cache order holds the safety sentence beside any history, so it never fits
    # more than the seed order does.
    if seed is None:
        assert cache is None
        return
    seed_names = check_block(seed, inp, tokenizers, "seed")
    if cache is None:
        return
    cache_names = check_block(cache, inp, tokenizers, "cache")
    # Byte-identical for identical inputs and nonce, in each order.
    again = assemble(inp, catalog, tokenizers, CACHE)
    assert again is not None and again.assembled_context == cache.assembled_context
    # The cache order's safety sentence comes with any section.
    others = {"directive", "tools", "history", "memories"}
    assert ("safety" in cache_names) == bool(others & set(cache_names))
    if seed.budget.messages_dropped == cache.budget.messages_dropped:
        # The same history fits: the same sections (and the safety sentence, which the
        # cache order adds without memories) holding the same memories.
        assert set(cache_names) == set(seed_names) | ({"safety"} & set(cache_names))
        assert cache.memories_used == seed.memories_used
        assert cache.budget == seed.budget
        extra = 0 if "safety" in seed_names or "safety" not in cache_names else 1
        safety = cache.directive_tokens - seed.directive_tokens
        assert (safety > 0) == bool(extra)
        assert cache.tokens_used == seed.tokens_used + safety
        if not extra:
            seed_lines = seed.assembled_context.splitlines()
            assert sorted(cache.assembled_context.splitlines()) == sorted(seed_lines)


# --------------------------------------------------------------------------- examples


def turn(history: list[Message], *, with_memories: bool) -> AssemblyInputs:
    opts = AssemblyOptions(
        skip_hot_memories=not with_memories, skip_cold_memories=not with_memories
    )
    cold = [hit(f"m{i:02d}", f"Deploy note {i}: drain one node at a time.") for i in range(6)]
    return inputs(
        request(messages=history, tools=TOOLS, options=opts),
        cold=cold,
        directive=DIRECTIVE,
    )


def stable_part(text: str) -> str:
    """What the next turn may repeat: all up to the end of the last history message."""
    return text[: text.index("</history>\n")]


@pytest.mark.parametrize("first,second", [(True, True), (True, False), (False, True)])
def test_cache_order_next_turn_starts_with_directive_tools_safety_and_history(
    tokenizers: Tokenizers, catalog: Catalog, first: bool, second: bool
) -> None:
    history = [Message("user", "How do I deploy billing?"), Message("assistant", "From main.")]
    one = assemble(turn(history, with_memories=first), catalog, tokenizers, CACHE)
    longer = [*history, Message("user", "And roll back?"), Message("assistant", "Redeploy.")]
    two = assemble(turn(longer, with_memories=second), catalog, tokenizers, CACHE)
    assert one is not None and two is not None
    assert bool(one.memories_used) == first and bool(two.memories_used) == second
    prefix = stable_part(one.assembled_context)
    assert [n for n, _ in sections(prefix)] == ["directive", "tools", "safety", "history"]
    assert two.assembled_context.startswith(prefix)


def test_seed_order_next_turn_shares_no_tools(tokenizers: Tokenizers, catalog: Catalog) -> None:
    # The contrast the cache order exists for: in the seed order the tools follow the
    # memories, which change from turn to turn, so no shared prefix reaches them.
    history = [Message("user", "How do I deploy billing?"), Message("assistant", "From main.")]
    one = assemble(turn(history, with_memories=True), catalog, tokenizers, SEED)
    longer = [*history, Message("user", "And roll back?"), Message("assistant", "Redeploy.")]
    two = assemble(turn(longer, with_memories=True), catalog, tokenizers, SEED)
    assert one is not None and two is not None
    a, b = one.assembled_context, two.assembled_context
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    assert "<tools " not in a[:shared]
    assert a.index("<tools ") > a.index("<memories ")


def test_cache_order_without_memories_still_says_what_the_nonce_means(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    history = [Message("user", "hello")]
    seed = assemble(turn(history, with_memories=False), catalog, tokenizers, SEED)
    cache = assemble(turn(history, with_memories=False), catalog, tokenizers, CACHE)
    assert seed is not None and cache is not None
    assert "<safety " not in seed.assembled_context
    assert [n for n, _ in sections(cache.assembled_context)] == [
        "directive",
        "tools",
        "safety",
        "history",
    ]
    # The sentence is counted as the directive's (as in the seed order with memories).
    assert cache.tokens_used > seed.tokens_used
    assert cache.directive_tokens > seed.directive_tokens


def test_work_done_early_gives_the_same_answer_in_the_cache_order(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    inp = turn([Message("user", "hello")], with_memories=True)
    plain = assemble(inp, catalog, tokenizers, CACHE)
    for made_with in (CACHE, SEED):
        prepared = EarlyAssembly(
            inp.request,
            inp.nonce,
            inp.now,
            catalog=catalog,
            tokenizers=tokenizers,
            config=made_with,
        )
        prepared.directive(inp.directive)
        prepared.hits("cold", inp.cold)
        early = assemble(inp, catalog, tokenizers, CACHE, prepared)
        assert early is not None and plain is not None
        assert early.assembled_context == plain.assembled_context
        assert msgspec.structs.replace(early, metrics=plain.metrics) == plain


def test_a_cache_order_refusal_counts_the_safety_sentence_in_the_room_left(
    tokenizers: Tokenizers, catalog: Catalog
) -> None:
    # In the cache order a kept history brings the safety sentence, so the history fits
    # in what the directive, tools and that sentence leave of the ceiling.
    enc = tokenizers.encoding("o200k_base")

    def count(pieces: list[str]) -> int:
        return len(enc.encode_ordinary("".join(pieces)))

    d = count(fmt.directive_section(DIRECTIVE, NONCE))
    t = count(fmt.tools_section(list(TOOLS), NONCE))
    s = count([fmt.safety_piece(NONCE)])
    ceiling = 1480  # window 2000, reserve 500, o200k_base's 1 % safety buffer
    huge = [Message("user", "the history that never ends " * 400)]
    inp = inputs(request(available_tokens=2000, messages=huge, tools=TOOLS), directive=DIRECTIVE)
    with pytest.raises(TooLargeError) as info:
        assemble_pure(inp, catalog=catalog, tokenizers=tokenizers, config=CACHE)
    assert (
        f"leaves {ceiling - d - t - s} of its {ceiling}-token context ceiling after the "
        f"directive ({d}), tools ({t}) and safety sentence ({s})"
    ) in str(info.value)


# --------------------------------------------------------------------------- the setting


def test_the_default_is_the_seed_order() -> None:
    assert DEFAULT_CONFIG.section_order == "seed"
    assert layer_config(PipelineConfig, load_settings({})).section_order == "seed"
    assert effective_settings(load_settings({}))[PREFIX + "SECTION_ORDER"] == "seed"


@pytest.mark.parametrize("raw,order", [("cache", "cache"), (" Cache ", "cache"), ("seed", "seed")])
def test_the_setting_reaches_the_pipeline(raw: str, order: str) -> None:
    settings = load_settings({PREFIX + "SECTION_ORDER": raw})
    assert layer_config(PipelineConfig, settings).section_order == order


@pytest.mark.parametrize("raw", ["fixed", "cached", "seed,cache", "1"])
def test_an_unknown_order_is_refused_naming_the_variable_and_the_values(raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({PREFIX + "SECTION_ORDER": raw})
    message = str(caught.value)
    assert "IBEX_CONTEXT_SECTION_ORDER" in message
    assert "seed, cache" in message


def test_the_settings_values_are_the_formats_orders() -> None:
    assert SECTION_ORDERS == format_mod.SECTION_ORDERS == ("seed", "cache")


@pytest.mark.parametrize("order", ["seed", "cache"])
async def test_the_daemons_assembler_writes_the_configured_order(
    autojump_clock: trio.testing.MockClock, order: str
) -> None:
    # From the variable to the answer, on the bundled sample (directive and memories).
    settings = load_settings({PREFIX + "SECTION_ORDER": order})
    async with open_assembler(settings) as assembler:
        result = await assembler.assemble(
            AssemblyRequest(
                agent_id=SAMPLE_AGENT_ID,
                org_id=SAMPLE_ORG_ID,
                query="how do I deploy billing",
                model="gpt-4o",
                recent_messages=(Message("user", "hello"),),
                tool_schemas=TOOLS,
            )
        )
    names = [n for n, _ in sections(result.assembled_context)]
    assert names == ORDERS[order]
