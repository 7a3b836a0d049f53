"""The body escaper against Unicode's own data, not a hand list.

The `regex` module carries its own (newer) copy of the Unicode character
database, so it is an independent oracle for the properties the escaper must
cover: every `Default_Ignorable_Code_Point`, assigned or not, every format
(Cf) and private-use (Co) character, whatever the Python build's `unicodedata`
version. The angle-bracket look-alikes have no Unicode property; they are the
characters Unicode's confusables map to `<` or `>` plus the mathematical and
modifier look-alikes named in issue 20.
"""

from __future__ import annotations

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex.assembly.formatter import escape_attr, escape_body

DEFAULT_IGNORABLE = regex.compile(r"\p{Default_Ignorable_Code_Point}")
HIDDEN = regex.compile(r"[\p{Default_Ignorable_Code_Point}\p{Cf}\p{Co}]")
EMOJI = "\U0001f600"  # an astral character: the escaper takes its other path


EVERY_CODE_POINT = "".join(map(chr, range(0x110000)))


def _code_points(pattern: regex.Pattern[str]) -> list[str]:
    return pattern.findall(EVERY_CODE_POINT)


ALL_DEFAULT_IGNORABLE = _code_points(DEFAULT_IGNORABLE)
ALL_HIDDEN = _code_points(HIDDEN)


def _escaped_alone(ch: str, *, astral: bool) -> bool:
    tail = EMOJI if astral else ""
    return escape_body(f"a{ch}b{tail}") == f"a&#x{ord(ch):X};b{tail}"


def test_the_oracle_knows_the_property() -> None:
    # The ranges issue 20 names, and the long-standing ones, are in the oracle's data.
    for cp in (0x00AD, 0x180B, 0x180F, 0x2065, 0xFFF0, 0xFFF8, 0xE0080, 0xE00FF, 0xE01F0, 0xE0FFF):
        assert DEFAULT_IGNORABLE.match(chr(cp)), hex(cp)
    assert len(ALL_DEFAULT_IGNORABLE) >= 4174
    assert not DEFAULT_IGNORABLE.match("a") and not DEFAULT_IGNORABLE.match(" ")


@pytest.mark.parametrize("astral", [False, True], ids=["bmp text", "text with an astral char"])
def test_every_default_ignorable_code_point_becomes_a_reference(astral: bool) -> None:
    missed = [
        f"U+{ord(c):04X}" for c in ALL_DEFAULT_IGNORABLE if not _escaped_alone(c, astral=astral)
    ]
    assert missed == []


@pytest.mark.parametrize("astral", [False, True], ids=["bmp text", "text with an astral char"])
def test_every_format_and_private_use_character_of_the_oracle_is_escaped(astral: bool) -> None:
    text = "x" + "".join(ALL_HIDDEN) + (EMOJI if astral else "")
    left = set(escape_body(text)) & set(ALL_HIDDEN)
    assert sorted(f"U+{ord(c):04X}" for c in left) == []


LOOK_ALIKES = {
    # issue 20 row 12
    "\u227a": "PRECEDES",
    "\u227b": "SUCCEEDS",
    "\u22d6": "LESS-THAN WITH DOT",
    "\u22d7": "GREATER-THAN WITH DOT",
    "\u02f1": "MODIFIER LETTER LOW LEFT ARROWHEAD",
    "\u02f2": "MODIFIER LETTER LOW RIGHT ARROWHEAD",
    "\u2aa1": "DOUBLE NESTED LESS-THAN",
    "\u2aa2": "DOUBLE NESTED GREATER-THAN",
    # Unicode confusables.txt: the characters it maps to U+003C or U+003E
    "\u02c2": "MODIFIER LETTER LEFT ARROWHEAD",
    "\u02c3": "MODIFIER LETTER RIGHT ARROWHEAD",
    "\u1438": "CANADIAN SYLLABICS PA",
    "\u1433": "CANADIAN SYLLABICS PO",
    "\u16b2": "RUNIC LETTER KAUNA",
    "\u2039": "SINGLE LEFT-POINTING ANGLE QUOTATION MARK",
    "\u203a": "SINGLE RIGHT-POINTING ANGLE QUOTATION MARK",
    "\u276e": "HEAVY LEFT-POINTING ANGLE QUOTATION MARK ORNAMENT",
    "\u276f": "HEAVY RIGHT-POINTING ANGLE QUOTATION MARK ORNAMENT",
    "\U00016f3f": "MIAO LETTER ARCHAIC ZZA",
    "\U0001d236": "GREEK INSTRUMENTAL NOTATION SYMBOL-40",
    "\U0001d237": "GREEK INSTRUMENTAL NOTATION SYMBOL-42",
}


@pytest.mark.parametrize("ch", list(LOOK_ALIKES), ids=list(LOOK_ALIKES.values()))
def test_angle_bracket_look_alikes_become_references(ch: str) -> None:
    assert regex.match(rf"\N{{{LOOK_ALIKES[ch]}}}", ch)  # the name is the character's own
    for astral in (False, True):
        assert _escaped_alone(ch, astral=astral)
    assert ch not in escape_attr(f"id{ch}")


def test_astral_text_takes_no_other_decision_for_bmp_characters() -> None:
    """Text with an astral character is scanned with the full class, other text with
    its BMP part: every BMP character must come out the same either way."""
    for cp in range(0x10000):
        ch = chr(cp)
        plain = escape_body(f"x{ch}y")
        assert escape_body(f"x{ch}y{EMOJI}") == plain + EMOJI, f"U+{cp:04X}"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_no_hidden_character_or_angle_bracket_survives(text: str) -> None:
    escaped = escape_body(text)
    assert not HIDDEN.search(escaped)
    assert not set(escaped) & {"<", ">", *LOOK_ALIKES}
