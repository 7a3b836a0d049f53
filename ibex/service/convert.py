"""Wire messages (upb classes from ibex.service.pb) to and from the pipeline's structs.

The pipeline never sees generated classes, so a protobuf library change stays
in this module and the server. A struct and its message share field names
(tests/unit/test_proto.py pins them), so each crossing copies the fields by
name in one msgspec call; nested messages are passed as dicts, which upb builds in C.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import msgspec

from ibex.assembly.candidates import SearchResult
from ibex.assembly.structs import AssemblyRequest, AssemblyResult, SearchRequest
from ibex.service import pb

_S = TypeVar("_S", bound=msgspec.Struct)


def _from_message(struct: type[_S], message: Any) -> Callable[[Any], _S]:
    """A reader of `struct` from a `message` that has a field of each of its names.

    One attrgetter reads the singular fields; repeated containers are copied to
    lists (msgspec takes no other sequence); one `msgspec.convert` builds the
    struct, nested messages by attribute. A field added to the struct is read
    with no edit here; a struct field the message lacks fails at import.
    """
    names = struct.__struct_fields__
    by_name = message.DESCRIPTOR.fields_by_name
    repeated = tuple(n for n in names if by_name[n].is_repeated)
    singular = tuple(n for n in names if n not in repeated)
    read_singular = attrgetter(*singular)

    def read(msg: Any) -> _S:
        values = dict(zip(singular, read_singular(msg), strict=True))
        for name in repeated:
            values[name] = list(getattr(msg, name))
        return msgspec.convert(values, struct, from_attributes=True)

    return read


request_from_proto = _from_message(AssemblyRequest, pb.AssembleContextRequest)
search_from_proto = _from_message(SearchRequest, pb.SearchMemoriesRequest)

# AssemblyResult's fields that the response carries under the same name.
_RESPONSE_FIELDS = tuple(
    n
    for n in AssemblyResult.__struct_fields__
    if n in pb.AssembleContextResponse.DESCRIPTOR.fields_by_name
)


def response_to_proto(r: AssemblyResult) -> Any:
    """The wire response: one `msgspec.to_builtins` of the whole result (a C walk, the
    nested structs as dicts), the fields the message carries, and the included count."""
    values = msgspec.to_builtins(r)
    return pb.AssembleContextResponse(
        memories_included=r.memories_included, **{n: values[n] for n in _RESPONSE_FIELDS}
    )


def branches_header(r: AssemblyResult) -> str:
    """`directive=success;hot=timeout;cold=success`: loggable without parsing the body."""
    return ";".join(f"{b.source}={b.status}" for b in r.branches)


def search_to_proto(found: SearchResult, search_time_ms: int) -> Any:
    """The wire response: the ranked hits, the caller's own candidates, the time taken."""
    memories = [
        pb.Memory(
            id=h.hit.memory_id,
            content=h.hit.content,
            category=h.hit.category,
            confidence=h.hit.confidence,
            composite_score=h.score,
            retrieval_count=h.hit.access_count or 0,
            created_at=h.hit.created_at or "",
        )
        for h in found.hits
    ]
    return pb.SearchMemoriesResponse(
        memories=memories,
        total_candidates=found.own_candidates,
        search_time_ms=search_time_ms,
    )
