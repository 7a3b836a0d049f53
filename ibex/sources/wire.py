"""The memory service's response shape (contract section 2), decoded strictly.

Both the HTTP source and the local file source validate through these Structs,
so a memory reaches the pipeline only if every field is inside the contract.
One bad item fails the whole response: silently dropping or repairing it
would hide a confused retrieval.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Literal

import msgspec

from ibex.assembly.structs import MemoryHit
from ibex.sources.base import SourceError

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
UnitFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Rank = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})$"
)
_DETAIL_MAX = 160


def check_rfc3339(value: str | None) -> None:
    """Raise ValueError unless value is None or a real RFC 3339 timestamp."""
    if value is None:
        return
    if not _RFC3339.match(value):
        raise ValueError("created_at must be an RFC 3339 timestamp")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("created_at is not a valid date-time") from None


def check_unit(name: str, value: float | None) -> None:
    """Raise ValueError unless value is None or a finite number in [0, 1]."""
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a finite number in [0, 1]")


class WireMemory(msgspec.Struct, frozen=True):
    """`memory` object of one result; unknown keys are ignored for forward compatibility."""

    id: NonEmptyStr
    org_id: NonEmptyStr
    agent_id: NonEmptyStr
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
        check_unit("confidence", self.confidence)
        check_unit("usefulness", self.usefulness)
        check_rfc3339(self.created_at)


class WireResult(msgspec.Struct, frozen=True):
    memory: WireMemory
    similarity: float
    rank: Rank
    source: str

    def __post_init__(self) -> None:
        if not math.isfinite(self.similarity):
            raise ValueError("similarity must be finite")


class WireData(msgspec.Struct, frozen=True):
    results: list[WireResult]


class WireResponse(msgspec.Struct, frozen=True):
    data: WireData


_DECODER = msgspec.json.Decoder(WireResponse)


def to_hit(result: WireResult, branch: Literal["hot", "cold"]) -> MemoryHit:
    """A validated wire result as the pipeline's MemoryHit, tenant fields kept."""
    m = result.memory
    return MemoryHit(
        memory_id=m.id,
        org_id=m.org_id,
        agent_id=m.agent_id,
        content=m.content,
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
    )


def decode_hits(body: bytes, branch: Literal["hot", "cold"]) -> list[MemoryHit]:
    """Decode a whole response body or raise SourceError; never a partial list.

    msgspec's messages name the JSON path and expected type, never the value,
    so they are safe to carry in the branch detail.
    """
    try:
        response = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise SourceError(_detail(f"{branch}: bad response shape: {exc}")) from None
    except msgspec.DecodeError as exc:
        raise SourceError(_detail(f"{branch}: invalid JSON: {exc}")) from None
    return [to_hit(r, branch) for r in response.data.results]


def _detail(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."
