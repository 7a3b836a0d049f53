"""estimate_v1's byte classes, as its table documents them.

The estimate's error against exact counts is pinned in test_tokens.py (the
corpus bound); these pin which class each byte falls in, since a byte moved to
a cheaper class can stay within the corpus bound for the texts measured and
still undercount another script.
"""

from __future__ import annotations

import pytest

from ibex.assembly.estimate import _byte_class, estimate_v1

ASCII = [
    ("a", "a"),
    ("z", "a"),
    ("A", "A"),
    ("Z", "A"),
    ("0", "0"),
    ("9", "0"),
    (" ", " "),
    ("\n", "n"),
    ("\r", "n"),
    ("\t", "t"),
    ("\x0b", "t"),
    ("/", "p"),
    (":", "p"),
    ("@", "p"),
    ("[", "p"),
    ("`", "p"),
    ("{", "p"),
]


@pytest.mark.parametrize(("char", "cls"), ASCII)
def test_ascii_classes(char: str, cls: str) -> None:
    assert _byte_class(ord(char)) == cls


# (first lead byte, last lead byte, class) from the module's table of UTF-8 lead bytes.
LEAD_BYTES = [
    (0x80, 0xBF, "c"),
    (0xC0, 0xCC, "l"),
    (0xCD, 0xCF, "g"),
    (0xD0, 0xD5, "y"),
    (0xD6, 0xDF, "h"),
    (0xE0, 0xE0, "i"),
    (0xE1, 0xE1, "j"),
    (0xE2, 0xE2, "s"),
    (0xE3, 0xE3, "k"),
    (0xE4, 0xE9, "z"),
    (0xEA, 0xED, "u"),
    (0xEE, 0xEF, "f"),
    (0xF0, 0xFF, "e"),
]


@pytest.mark.parametrize(("first", "last", "cls"), LEAD_BYTES)
def test_multibyte_classes(first: int, last: int, cls: str) -> None:
    assert {_byte_class(b) for b in range(first, last + 1)} == {cls}


@pytest.mark.parametrize(
    ("char", "cls"),
    [
        ("é", "l"),
        ("α", "g"),
        ("ж", "y"),
        ("ש", "h"),
        ("ก", "i"),
        ("ა", "j"),
        ("→", "s"),
        ("か", "k"),
        ("中", "z"),
        ("한", "u"),
        ("＜", "f"),
        ("😀", "e"),
    ],
)
def test_a_character_is_counted_once_at_its_lead_byte(char: str, cls: str) -> None:
    raw = char.encode("utf-8")
    assert _byte_class(raw[0]) == cls
    assert {_byte_class(b) for b in raw[1:]} <= {"c"}


def test_empty_text_costs_nothing_and_any_text_at_least_one() -> None:
    assert estimate_v1("") == 0
    assert estimate_v1(" ") == 1


def test_any_text_is_estimated_lone_surrogates_included() -> None:
    """A str that is not valid Unicode (a lone surrogate from a JSON escape) is still
    estimated, never an error: the estimate takes whatever text a request carries."""
    assert estimate_v1("\ud800") >= 1
    assert estimate_v1("a\udfffb") >= estimate_v1("ab")


def test_a_switch_from_lower_to_upper_case_costs_extra() -> None:
    """The same letters and runs, but camelCase (a switch at every letter) costs more than
    one run of lower case then one of upper case (a single switch)."""
    assert estimate_v1("aB" * 50) > estimate_v1("ab" * 25 + "AB" * 25)
