"""Whole rendered blocks against checked-in expected text (tests/unit/golden/*.txt).

The cases (tests/unit/golden/__init__.py), each in both section orders, cover
every section, the category order, score and id ties, escaping of bodies and
attributes, and the safety sentence. After an intended formatter change:
``python -m tests.unit.golden --update`` and review the diff.
"""

from __future__ import annotations

import re

import pytest

from ibex.assembly import xml_format as fmt
from tests.unit.golden import CASES, NONCE, main_check, read_golden


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_block_matches_the_golden_file(name: str) -> None:
    assert CASES[name]() == read_golden(name)


def test_goldens_are_pieces_that_join_cleanly() -> None:
    # The golden text is also what render_pieces joins, piece by piece.
    for name in CASES:
        text = read_golden(name)
        assert text == "" or text.endswith("\n")
        assert "\r" not in text


def test_the_empty_block_is_empty() -> None:
    assert read_golden("empty") == ""


def test_safety_sentence_names_the_nonce_and_only_with_memories() -> None:
    assert read_golden("memories_only").startswith(fmt.safety_piece(NONCE))
    assert "<safety" not in read_golden("no_memories")


def test_regeneration_helper_reports_no_drift() -> None:
    assert main_check() == 0


def _section_tags(text: str) -> list[str]:
    """The section elements' names in the order the block opens them."""
    return re.findall(r"^<(directive|tools|safety|history|memories) ", text, re.MULTILINE)


@pytest.mark.parametrize("name", ["full", "memories_only", "injection", "empty"])
def test_cache_order_holds_the_seed_blocks_sections_byte_for_byte(name: str) -> None:
    # The same elements with the same bytes inside them; only their order differs.
    seed, cache = read_golden(name), read_golden(f"cache_{name}")
    assert sorted(seed.splitlines()) == sorted(cache.splitlines())
    assert len(seed) == len(cache)


def test_cache_order_is_directive_tools_safety_history_memories() -> None:
    # design.md, Formatting: what changes least first.
    assert _section_tags(read_golden("full")) == [
        "directive",
        "safety",
        "history",
        "memories",
        "tools",
    ]
    assert _section_tags(read_golden("cache_full")) == [
        "directive",
        "tools",
        "safety",
        "history",
        "memories",
    ]


def test_cache_order_writes_the_safety_sentence_without_memories_too() -> None:
    # Its place is in front of the history, so it must not come and go with the memories.
    text = read_golden("cache_no_memories")
    assert _section_tags(text) == ["directive", "tools", "safety", "history"]
    assert fmt.safety_piece(NONCE) in text
    assert read_golden("cache_memories_only") == read_golden("memories_only")
    assert read_golden("cache_empty") == ""
