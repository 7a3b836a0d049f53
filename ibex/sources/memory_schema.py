"""The memory service's response shape (contract section 2), decoded strictly.

Both the HTTP source and the local file source validate through these Structs,
so a memory reaches the pipeline only if every field is inside the contract.
One bad item fails the whole response: silently dropping or repairing it
would hide a confused retrieval.

Bounded work: only the first `limit` results (the number asked
for) are validated and turned into hits; the rest are skipped as raw JSON. A
memory whose content is over `max_content_bytes` (UTF-8) becomes a hit with
its content dropped and `oversized` set, which the pipeline excludes as
`failed` without ever counting its tokens: one huge memory must not fail, or
slow down, the whole branch. JSON nested deeper than msgspec's recursion limit
is a SourceError like any other malformed body, never a RecursionError.
"""

from __future__ import annotations

import math
import re
import sys
from datetime import datetime
from typing import Annotated, Final, Literal

import msgspec

from ibex.assembly.lru import ENTRY_OVERHEAD, ByteLRU, LRUInfo
from ibex.assembly.structs import MemoryHit
from ibex.assembly.validation import HYPHENATED_UUID
from ibex.sources.base import SourceError

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
UnitFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Rank = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]

DEFAULT_MAX_CONTENT_BYTES: Final = 32 * 1024

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})$"
)
# A memory id that is not a HYPHENATED_UUID is a malformed item (the branch fails), never a memory.
_VALID_IDS: set[str] = set()
_VALID_IDS_MAX: Final = 8192
_DETAIL_MAX = 160
# Timestamps already found valid: the same memories come back call after call, and
# the regex plus fromisoformat is a fifth of validating one. Bounded: cleared when
# full (a hostile service sending a new timestamp per memory costs one check each).
_VALID_TIMESTAMPS: set[str] = set()
_VALID_TIMESTAMPS_MAX: Final = 8192
_TIMESTAMP_MAX_CHARS: Final = 64  # longer is not RFC 3339 anyway; never cached


def check_rfc3339(value: str | None) -> None:
    """Raise ValueError unless value is None or a real RFC 3339 timestamp."""
    if value is None or value in _VALID_TIMESTAMPS:
        return
    if not _RFC3339.match(value):
        raise ValueError("created_at must be an RFC 3339 timestamp")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("created_at is not a valid date-time") from None
    if len(value) <= _TIMESTAMP_MAX_CHARS:
        if len(_VALID_TIMESTAMPS) >= _VALID_TIMESTAMPS_MAX:
            _VALID_TIMESTAMPS.clear()
        _VALID_TIMESTAMPS.add(value)


def check_memory_id(value: str) -> None:
    """Raise ValueError unless value is a canonical (hyphenated, 36-character) UUID.

    Memoised like the timestamps: the same memories come back call after call,
    and a set lookup is a tenth of the regex.
    """
    if value in _VALID_IDS:
        return
    if HYPHENATED_UUID.fullmatch(value) is None:
        raise ValueError("id must be a canonical UUID")
    if len(_VALID_IDS) >= _VALID_IDS_MAX:
        _VALID_IDS.clear()
    _VALID_IDS.add(value)


def check_unit(name: str, value: float | None) -> None:
    """Raise ValueError unless value is None or a finite number in [0, 1]."""
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a finite number in [0, 1]")


class MemoryFields(msgspec.Struct, frozen=True, kw_only=True):
    """The fields and checks of one memory, shared by the service's answer
    (`WireMemory`) and the local source file, which adds only where the tenant comes from."""

    id: NonEmptyStr
    content: str
    category: NonEmptyStr
    confidence: UnitFloat
    created_at: str | None = None
    usefulness: UnitFloat | None = None
    access_count: Count | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Meta bounds already reject out-of-range values; NaN slips past
        # comparisons, so check finiteness explicitly.
        check_memory_id(self.id)
        check_unit("confidence", self.confidence)
        check_unit("usefulness", self.usefulness)
        check_rfc3339(self.created_at)


class WireMemory(MemoryFields, frozen=True, kw_only=True):
    """`memory` object of one result; unknown keys are ignored for forward compatibility."""

    org_id: NonEmptyStr
    agent_id: NonEmptyStr


class WireResult(msgspec.Struct, frozen=True):
    memory: WireMemory
    similarity: float
    rank: Rank
    source: str
    composite_score: UnitFloat | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.similarity):
            raise ValueError("similarity must be finite")
        check_unit("composite_score", self.composite_score)


class WireData(msgspec.Struct, frozen=True):
    results: list[WireResult]


class WireResponse(msgspec.Struct, frozen=True):
    data: WireData


class _RawData(msgspec.Struct, frozen=True):
    results: list[msgspec.Raw]


class _RawResponse(msgspec.Struct, frozen=True):
    data: _RawData


_ONE_PASS_BYTES: Final = 64 * 1024
_DECODER = msgspec.json.Decoder(WireResponse)
_ENVELOPE = msgspec.json.Decoder(_RawResponse)
_RESULT = msgspec.json.Decoder(WireResult)


def content_over(content: str, max_bytes: int) -> bool:
    """True when content's UTF-8 encoding is longer than max_bytes (encodes only near the cap)."""
    n = len(content)
    if n > max_bytes:
        return True
    return 4 * n > max_bytes and len(content.encode("utf-8", "surrogatepass")) > max_bytes


def to_hit(
    result: WireResult,
    branch: Literal["hot", "cold"],
    max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES,
) -> MemoryHit:
    """A validated wire result as the pipeline's MemoryHit, tenant fields kept.

    Content over `max_content_bytes` is dropped and the hit flagged `oversized`.
    """
    m = result.memory
    n = len(m.content)  # content_over, inlined: this runs for every hit
    oversized = n > max_content_bytes or (
        4 * n > max_content_bytes and content_over(m.content, max_content_bytes)
    )
    return MemoryHit(
        memory_id=m.id,
        org_id=m.org_id,
        agent_id=m.agent_id,
        content="" if oversized else m.content,
        category=m.category,
        confidence=float(m.confidence),
        similarity=float(result.similarity),
        rank=result.rank,
        source=result.source,
        branch=branch,
        created_at=m.created_at,
        usefulness=None if m.usefulness is None else float(m.usefulness),
        access_count=m.access_count,
        tags=m.tags,
        oversized=oversized,
        composite_score=None if result.composite_score is None else float(result.composite_score),
    )


#: Bytes one decoded hit is counted at besides its content: the struct, its id, tenant,
#: category, source and timestamp strings (about 400 on 64-bit CPython, rounded up).
HIT_BYTES: Final = 512
DEFAULT_DECODED_CACHE_BYTES: Final = 4 * 1024 * 1024

AnswerKey = tuple[bytes, str, int | None]


def _answer_size(key: AnswerKey, hits: tuple[MemoryHit, ...]) -> int:
    return (
        sys.getsizeof(key[0])
        + sum(sys.getsizeof(h.content) + HIT_BYTES for h in hits)
        + ENTRY_OVERHEAD
    )


class DecodedAnswers:
    """Decoded answers by their exact bytes, bounded in bytes.

    The hot endpoint answers an agent with the same memories call after call
    until they change, and validating a 20-memory answer is most of a branch's
    CPU. A hit is reused only for byte-identical answers (the tenant fields are
    in those bytes; the tenant filter still runs on every call), and a body that
    fails to decode is never stored: the next copy fails the same way.
    """

    __slots__ = ("_lru",)

    def __init__(self, max_bytes: int = DEFAULT_DECODED_CACHE_BYTES) -> None:
        self._lru: ByteLRU[AnswerKey, tuple[MemoryHit, ...]] = ByteLRU(
            max_bytes, sizeof=_answer_size
        )

    def decode(
        self,
        body: bytes,
        branch: Literal["hot", "cold"],
        *,
        limit: int | None = None,
        max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES,
    ) -> list[MemoryHit]:
        """`decode_hits`, from the cache when these exact bytes were decoded before.

        `max_content_bytes` must be the same for every call (one per source).
        """
        key = (body, branch, limit)
        hits = self._lru.get(key)
        if hits is None:
            hits = tuple(
                decode_hits(body, branch, limit=limit, max_content_bytes=max_content_bytes)
            )
            self._lru.put(key, hits)
        return list(hits)

    def info(self) -> LRUInfo:
        return self._lru.info()


def decode_hits(
    body: bytes,
    branch: Literal["hot", "cold"],
    *,
    limit: int | None = None,
    max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES,
) -> list[MemoryHit]:
    """Decode a response body into at most `limit` hits, or raise SourceError; never partial.

    msgspec's messages name the JSON path and expected type, never the value,
    so they are safe to carry in the branch detail.
    """
    try:
        results = _first_results(body, limit)
        hits = [to_hit(r, branch, max_content_bytes) for r in results]
    except msgspec.ValidationError as exc:
        raise SourceError(_detail(f"{branch}: bad response shape: {exc}")) from None
    except msgspec.DecodeError as exc:
        raise SourceError(_detail(f"{branch}: invalid JSON: {exc}")) from None
    except RecursionError:
        raise SourceError(f"{branch}: invalid JSON: nested too deeply") from None
    return hits


def _first_results(body: bytes, limit: int | None) -> list[WireResult]:
    """The first `limit` results, validated; later ones are never validated.

    A small body (the usual answer: 20 memories are about 20 KiB) is decoded in
    one pass, which is cheapest. A larger one, or one that fails validation
    (the bad item may lie past the limit), goes item by item: the results are
    split as raw JSON and only the first `limit` are decoded, so the work is
    bounded by what was asked for, not by what was sent.
    """
    n = None if limit is None else max(0, limit)
    if len(body) <= _ONE_PASS_BYTES:
        try:
            return _DECODER.decode(body).data.results[:n]
        except msgspec.ValidationError:
            pass
    out: list[WireResult] = []
    for i, raw in enumerate(_ENVELOPE.decode(body).data.results[:n]):
        try:
            out.append(_RESULT.decode(raw))
        except msgspec.ValidationError as exc:
            raise msgspec.ValidationError(_at_item(str(exc), i)) from None
    return out


def _at_item(text: str, i: int) -> str:
    """An item's error path (`$.memory.id`) as the response's (`$.data.results[i].memory.id`)."""
    at = f"$.data.results[{i}]"
    return text.replace("- at `$", f"- at `{at}") if "- at `$" in text else f"{text} - at `{at}`"


def _detail(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."
