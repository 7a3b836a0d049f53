"""A large body is escaped slice by slice, ASCII text by the ASCII cut of the class:
exactly the result of one pass of the whole class."""

from __future__ import annotations

import random

from ibex.assembly import xml_format as fmt
from ibex.assembly.xml_format import escape_body


def one_pass(text: str) -> str:
    """The reference: the whole text through the body regex at once."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    text = fmt._BODY_UNSAFE.sub(fmt._ref, text)
    return "&#x2F;" + text[1:] if text.startswith("/") else text


def test_slicing_never_changes_the_escaped_text() -> None:
    rng = random.Random(5)
    unsafe = "&<>\x00\x1b\u202e\u200b\ufeff\U000e0041\u2028\ufe0f\ue000\u3008"
    alphabet = "abc xyz 中文 {}\"'\n\t" + unsafe
    n = 3 * fmt._ESCAPE_SLICE + 17
    text = "/" + "".join(rng.choice(alphabet) for _ in range(n))
    # Unsafe characters right at every slice boundary, and a CRLF across one.
    chars = list(text)
    for i in range(fmt._ESCAPE_SLICE - 1, len(chars), fmt._ESCAPE_SLICE):
        chars[i] = "<"
    chars[fmt._ESCAPE_SLICE - 1 : fmt._ESCAPE_SLICE + 1] = ["\r", "\n"]
    text = "".join(chars)
    assert len(text) > fmt._ESCAPE_SLICE
    assert escape_body(text) == one_pass(text)
    assert "&#x202E;" in escape_body(text) and "&lt;" in escape_body(text)


def test_ascii_text_is_escaped_exactly_as_by_the_whole_class() -> None:
    every = "".join(chr(c) for c in range(1, 128)) * 3
    text = f"x{every}x"
    assert text.isascii()
    assert escape_body(text) == one_pass(text)
    big = "a" + every * (fmt._ESCAPE_SLICE // len(every) + 2)
    assert escape_body(big) == one_pass(big)
    for c in range(128):  # the derived ASCII class is the whole class on ASCII
        ch = chr(c)
        assert bool(fmt._BODY_UNSAFE_ASCII.match(ch)) == bool(fmt._BODY_UNSAFE.match(ch))
