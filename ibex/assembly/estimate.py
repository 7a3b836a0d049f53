"""``estimate_v1``: a labelled, conservative token estimate for families without an
offline tokenizer (``claude``, ``unknown``).

It is a weighted sum of UTF-8 byte classes (ASCII letters, digits,
punctuation, whitespace, and the script block named by each multi-byte lead
byte: Latin, Greek, Cyrillic, Hebrew/Arabic, Indic/Thai, symbols, kana, CJK,
Hangul, emoji) plus run features (words, digit runs, case and letter/digit
switches, indentation). The weights were fitted to overestimate, against
max(cl100k_base, o200k_base) exact counts on a hand-written corpus:
``python -m benchmarks.token_estimate`` measures it (per category in
docs/performance.md). Its worst undercount there sets
``ESTIMATE_MAX_UNDERCOUNT``, which the catalog turns into the family's safety
margin. Random text is not covered: memories are natural text. The reference
is OpenAI's vocabularies, not Claude's (not public), so the margin is a
measured bound against those, not a guarantee for every vendor tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

ESTIMATE_V1 = "estimate_v1"

#: Measured worst relative undercount of estimate_v1 on the corpus (0.043), rounded up.
ESTIMATE_MAX_UNDERCOUNT = 0.05


def _byte_class(b: int) -> str:
    """One letter per byte: ASCII kinds, or the script block a UTF-8 lead byte opens."""
    if b < 0x80:
        c = chr(b)
        if "a" <= c <= "z":
            return "a"
        if "A" <= c <= "Z":
            return "A"
        if "0" <= c <= "9":
            return "0"
        if c == " ":
            return " "
        if c in "\r\n":
            return "n"
        if c.isspace():
            return "t"
        return "p"
    for upper, cls in (
        (0xBF, "c"),  # continuation byte: its character is counted at the lead byte
        (0xCC, "l"),  # Latin-1, Latin extended, IPA
        (0xCF, "g"),  # combining marks, Greek
        (0xD5, "y"),  # Cyrillic, Armenian
        (0xDF, "h"),  # Hebrew, Arabic, Syriac, Thaana, NKo
        (0xE0, "i"),  # Indic scripts, Thai, Lao, Tibetan
        (0xE1, "j"),  # Myanmar, Georgian, Jamo, Latin extended additional (Vietnamese)
        (0xE2, "s"),  # general punctuation, symbols, arrows, dingbats
        (0xE3, "k"),  # CJK punctuation, kana, CJK extension A
        (0xE9, "z"),  # CJK unified ideographs
        (0xED, "u"),  # Yi, Hangul syllables
        (0xEF, "f"),  # private use, compatibility ideographs, fullwidth, variation selectors
    ):
        if b <= upper:
            return cls
    return "e"  # four-byte: emoji, historic scripts, CJK extension B+


def _table(fn: Callable[[int], str]) -> bytes:
    return bytes(ord(fn(b)) for b in range(256))


_CLASS = _table(_byte_class)
_RUN_OF = {"a": "a", "A": "a", "0": "0", " ": " ", "p": "p"}
_RUN = _table(lambda b: _RUN_OF.get(_byte_class(b), "."))

# Tokens per byte of each class (fitted, then rounded up).
_CLASS_WEIGHTS: tuple[tuple[bytes, float], ...] = (
    (b"a", 0.26),
    (b"A", 0.44),
    (b"0", 0.34),
    (b" ", 0.02),
    (b"n", 0.20),
    (b"t", 1.04),
    (b"p", 0.87),
    (b"l", 1.01),
    (b"g", 1.08),
    (b"y", 0.49),
    (b"h", 1.21),
    (b"i", 1.32),
    (b"j", 1.69),
    (b"s", 2.24),
    (b"k", 1.06),
    (b"z", 1.66),
    (b"u", 1.38),
    (b"f", 0.69),
    (b"e", 3.09),
)
_W_WORD, _W_LETTER_DIGIT, _W_DIGIT_RUN, _W_PUNCT_RUN, _W_INDENT = 0.18, 0.26, 0.99, 0.17, 1.77
# Patterns in the run map (prefixed with "."), each a non-self-overlapping pair or
# triple, so bytes.count finds every occurrence: a run start, a switch, an indent.
_RUN_WEIGHTS: tuple[tuple[bytes, float], ...] = (
    (b".a", _W_WORD),
    (b" a", _W_WORD),
    (b"pa", _W_WORD),
    (b"0a", _W_WORD + _W_LETTER_DIGIT),
    (b"a0", _W_DIGIT_RUN + _W_LETTER_DIGIT),
    (b".0", _W_DIGIT_RUN),
    (b" 0", _W_DIGIT_RUN),
    (b"p0", _W_DIGIT_RUN),
    (b".p", _W_PUNCT_RUN),
    (b" p", _W_PUNCT_RUN),
    (b"ap", _W_PUNCT_RUN),
    (b"0p", _W_PUNCT_RUN),
    (b".  ", _W_INDENT),
    (b"a  ", _W_INDENT),
    (b"0  ", _W_INDENT),
    (b"p  ", _W_INDENT),
)
_W_CASE_SWITCH = 0.64  # lower followed by upper: camelCase, base64


def estimate_v1(text: str) -> int:
    """Conservative token estimate from byte classes; see the module docstring for its error.

    Pure C-level passes (`bytes.translate`, `bytes.count`), no per-character Python.
    """
    if not text:
        return 0
    raw = text.encode("utf-8", "surrogatepass")
    classes = raw.translate(_CLASS)
    total = _W_CASE_SWITCH * classes.count(b"aA")
    for code, weight in _CLASS_WEIGHTS:
        total += weight * classes.count(code)
    runs = b"." + raw.translate(_RUN)
    for pattern, weight in _RUN_WEIGHTS:
        total += weight * runs.count(pattern)
    return max(1, math.ceil(total))
