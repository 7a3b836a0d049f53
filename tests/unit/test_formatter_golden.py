"""Whole rendered blocks against checked-in expected text (tests/unit/golden/*.txt).

The cases (tests/unit/golden/__init__.py) cover every section, the category
order, score and id ties, escaping of bodies and attributes, and the safety
sentence. After an intended formatter change: ``python -m tests.unit.golden
--update`` and review the diff.
"""

from __future__ import annotations

import pytest

from ibex.assembly import formatter as fmt
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
