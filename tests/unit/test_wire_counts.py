"""Counting repeated fields on the wire (ibex.service.edge.wire_counts) against the real decoder.

The walk must read protobuf as upb (the server's decoder) does: for any bytes upb
decodes, the walk accepts them and counts each repeated field's elements as upb
does; what it calls malformed, upb refuses. Hypothesis builds requests field by
field (known and unknown numbers, every wire type, nested messages and groups,
overlong varints) and corrupts some of them.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ibex.assembly.feedback_rules import MAX_FEEDBACK_IDS
from ibex.assembly.validation import MAX_SEARCH_CATEGORIES, MAX_SEARCH_TAGS
from ibex.errors import InputError, OverLimitError
from ibex.service import pb
from ibex.service.edge.wire_counts import (
    UNKNOWN_SLACK,
    check_counts,
    count_repeated,
    request_rules,
    rules_for,
)

ASSEMBLE = request_rules(
    pb.AssembleContextRequest,
    {"recent_messages": (512, "messages"), "tool_schemas": (128, "entries")},
)
SEARCH = request_rules(
    pb.SearchMemoriesRequest,
    {"categories": (MAX_SEARCH_CATEGORIES, "entries"), "tags": (MAX_SEARCH_TAGS, "entries")},
)
FEEDBACK = request_rules(pb.RecordMemoryFeedbackRequest, {"memory_ids": (MAX_FEEDBACK_IDS, "ids")})
TYPES = {
    "assemble": (pb.AssembleContextRequest, ASSEMBLE),
    "search": (pb.SearchMemoriesRequest, SEARCH),
    "feedback": (pb.RecordMemoryFeedbackRequest, FEEDBACK),
}


def varint(n: int, pad: int = 0) -> bytes:
    """`n` as a varint, with `pad` redundant continuation bytes (still valid up to 10)."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n or pad:
            out.append(b | 0x80)
            if not n:
                pad -= 1
                if not pad:
                    out.append(0)
                    return bytes(out)
        else:
            out.append(b)
            return bytes(out)


def ld(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


# --- the walk against upb -------------------------------------------------------------------

# The repeated fields (1, 6, 7, 8, 14) drawn more often, so counts are often non-zero.
NUMBERS = st.sampled_from(
    [1, 1, 2, 3, 5, 6, 6, 7, 7, 8, 8, 8, 9, 13, 14, 14, 14, 15, 16, 99, 2047, (1 << 29) - 1]
)


@st.composite
def fields(draw: st.DrawFn, depth: int = 0) -> bytes:
    """One field: any number, any wire type, a payload of the right shape (mostly)."""
    number = draw(NUMBERS)
    wire = draw(st.sampled_from([0, 0, 1, 2, 2, 2, 2, 3, 5] + ([4, 6] if depth else [])))
    tag = varint(number << 3 | wire, draw(st.sampled_from([0, 0, 0, 1, 4])))
    if wire == 0:
        return tag + varint(draw(st.integers(0, (1 << 64) - 1)), draw(st.integers(0, 1)))
    if wire == 1:
        return tag + draw(st.binary(min_size=8, max_size=8))
    if wire == 5:
        return tag + draw(st.binary(min_size=4, max_size=4))
    if wire == 2:
        kind = draw(st.sampled_from(["fields", "text", "text", "empty", "bytes"]))
        if kind == "fields" and depth < 3:
            payload = b"".join(draw(st.lists(fields(depth + 1), max_size=4)))
        elif kind == "empty":
            payload = b""
        elif kind == "text":  # valid UTF-8: what a string field must hold
            payload = draw(st.text(max_size=4)).encode()
        else:
            payload = draw(st.binary(max_size=6))
        return tag + varint(len(payload), draw(st.sampled_from([0, 0, 1]))) + payload
    if wire == 3 and depth < 3:
        inner = b"".join(draw(st.lists(fields(depth + 1), max_size=3)))
        end_number = draw(st.sampled_from([number, number, number, 12]))
        return tag + inner + varint(end_number << 3 | 4)
    return tag


@st.composite
def wire_messages(draw: st.DrawFn) -> bytes:
    data = b"".join(draw(st.lists(fields(), max_size=12)))
    corruption = draw(st.sampled_from(["none", "none", "none", "truncate", "flip"]))
    if data and corruption == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif data and corruption == "flip":
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    return data


def decoded_counts(message_class: Any, data: bytes) -> dict[str, int] | None:
    """What upb makes of `data`: each repeated field's length, or None if it refuses."""
    try:
        message = message_class.FromString(data)
    except DecodeError:
        return None
    return {
        f.name: len(getattr(message, f.name)) for f in message.DESCRIPTOR.fields if f.is_repeated
    }


@pytest.mark.parametrize("kind", list(TYPES))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=wire_messages())
# Field number 0 inside an unknown group: upb skips it (each with its own wire type).
@example(data=bytes.fromhex("0b00080008000c0c"))
@example(data=bytes.fromhex("0b02000c0b03040c0b05000000000c"))
@example(data=bytes.fromhex("0b040c"))  # an end-group of field 0 closing group 1: refused
def test_the_walk_reads_what_upb_reads(kind: str, data: bytes) -> None:
    message_class, rules = TYPES[kind]
    expected = decoded_counts(message_class, data)
    try:
        counted = count_repeated(data, rules)
    except InputError as exc:
        assert str(exc) == "request: not a valid protobuf message"
        assert expected is None, "the walk refused what upb decodes"
        return
    if expected is not None:
        assert counted == expected


def group(number: int, inner: bytes, end: int | None = None) -> bytes:
    """A group of `number` holding `inner`, closed by an end-group of `end` (its own)."""
    return varint(number << 3 | 3) + inner + varint((number if end is None else end) << 3 | 4)


@pytest.mark.parametrize(
    ("data", "messages"),
    [
        (group(99, group(98, b"") + group(98, group(97, b""))), 0),
        # Inside a group, field numbers are the group's: field 8 is no recent message.
        (group(99, ld(8, b"") * 600), 0),
        (ld(8, b"") + group(99, ld(8, b"")) + ld(8, b""), 2),
        # Field number 0 is skipped inside a group, as upb does, and refused outside one.
        (group(99, varint(0) + b"\x01" + ld(0, b"ab") + group(0, b"")), 0),
        (varint(0) + b"\x01", None),
        (group(99, group(98, b""), end=98), None),  # the outer group closed by the inner's end
        (group(99, group(98, b"", end=99)), None),  # the inner group closed by the outer's end
        (varint(99 << 3 | 4), None),  # an end-group with no group open
        (group(99, b"")[:-1], None),  # a group left open at the end
        (group(99, group(98, b"")[:-1]), None),  # a nested group left open at the end
        (ld(8, group(1, b"")[:-1]), None),  # a group left open at the end of a message
        (ld(8, varint(1 << 3 | 3)) + varint(1 << 3 | 4), None),  # and closed outside it
    ],
    ids=[
        "nested groups",
        "a group's fields are its own",
        "fields around a group",
        "field 0 inside a group",
        "field 0 outside a group",
        "mismatched outer end",
        "mismatched inner end",
        "stray end-group",
        "group left open",
        "nested group left open",
        "group open at a message's end",
        "group closed outside its message",
    ],
)
def test_groups_are_read_as_the_wire_format_says(data: bytes, messages: int | None) -> None:
    """A group runs from its start tag to the end-group of the same number, groups nest,
    and what they hold is their field's value (protobuf encoding spec, "Groups").
    `messages`: the recent_messages counted, None where the bytes are no message."""
    counts = None if messages is None else {"recent_messages": messages, "tool_schemas": 0}
    assert decoded_counts(pb.AssembleContextRequest, data) == counts, "upb reads it so"
    if counts is None:
        with pytest.raises(InputError, match="not a valid protobuf message"):
            count_repeated(data, ASSEMBLE)
        return
    assert count_repeated(data, ASSEMBLE) == counts


@st.composite
def assemble_requests(draw: st.DrawFn) -> Any:
    return pb.AssembleContextRequest(
        agent_id=draw(st.text(max_size=8)),
        org_id="0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d",
        query=draw(st.text(max_size=20)),
        available_tokens=draw(st.integers(-(2**31), 2**31 - 1)),
        recent_messages=[
            {"role": r, "content": c}
            for r, c in draw(
                st.lists(st.tuples(st.text(max_size=4), st.text(max_size=8)), max_size=530)
            )
        ],
        tool_schemas=draw(st.lists(st.text(max_size=6), max_size=140)),
        options={"max_memories": draw(st.integers(0, 100)), "recency_weight": 0.5},
        principal_context={"org_id": "o", "issued_at": {"seconds": draw(st.integers(0, 2**40))}},
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=assemble_requests())
def test_a_valid_request_is_refused_exactly_when_a_count_is_over_its_bound(request: Any) -> None:
    data = request.SerializeToString()
    over = [
        (name, limit)
        for name, limit in (("recent_messages", 512), ("tool_schemas", 128))
        if len(getattr(request, name)) > limit
    ]
    if not over:
        check_counts(data, ASSEMBLE)
        return
    with pytest.raises(OverLimitError) as info:
        check_counts(data, ASSEMBLE)
    # The first field over its bound on the wire (serialisation is in field-number order).
    name, limit = over[0]
    unit = "messages" if name == "recent_messages" else "entries"
    assert str(info.value) == f"{name}: more than {limit} {unit}"


# --- the refusals the issue names -----------------------------------------------------------


def test_two_million_empty_messages_are_refused_naming_the_field_and_limit() -> None:
    data = ld(2, b"0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d") + ld(8, b"") * 2_090_000
    assert len(data) < 4 * 1024 * 1024
    with pytest.raises(OverLimitError, match=r"^recent_messages: more than 512 messages$"):
        check_counts(data, ASSEMBLE)


@pytest.mark.parametrize(
    ("rules", "number", "message"),
    [
        (ASSEMBLE, 14, "tool_schemas: more than 128 entries"),
        (SEARCH, 6, f"categories: more than {MAX_SEARCH_CATEGORIES} entries"),
        (SEARCH, 7, f"tags: more than {MAX_SEARCH_TAGS} entries"),
        (FEEDBACK, 1, f"memory_ids: more than {MAX_FEEDBACK_IDS} ids"),
    ],
    ids=["tool_schemas", "categories", "tags", "memory_ids"],
)
def test_every_repeated_field_has_its_bound(rules: Any, number: int, message: str) -> None:
    limit = int(message.split("more than ")[1].split()[0])
    check_counts(ld(number, b"x") * limit, rules)
    with pytest.raises(OverLimitError) as info:
        check_counts(ld(number, b"x") * 2_000_000, rules)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "data",
    [
        ld(8, ld(3, b"") * 1_000_000),  # unknown fields inside one message
        ld(8, ld(2, b"") * 1_000_000),  # one message's content, repeated
        ld(13, ld(8, b"") * 1_000_000),  # the principal's issued_at, repeated
        ld(13, ld(8, varint(1 << 3) + b"\x01") * 1_000_000),  # and its seconds
        ld(99, b"") * 1_000_000,  # unknown fields at the top
        ld(9, b"") * 1_000_000,  # options, repeated
        (varint(99 << 3 | 3) + varint(99 << 3 | 4)) * 1_000_000,  # empty groups
    ],
    ids=[
        "unknown in a message",
        "content repeated",
        "timestamps",
        "timestamp seconds",
        "unknown at the top",
        "options repeated",
        "groups",
    ],
)
def test_millions_of_fields_anywhere_are_refused(data: bytes) -> None:
    """Each is one field or none upb keeps, but millions of fields it decodes one by one."""
    with pytest.raises(OverLimitError) as info:
        check_counts(data, ASSEMBLE)
    assert str(info.value) == f"request: more than {ASSEMBLE.max_fields} protobuf fields"


def test_the_largest_valid_request_fits_the_field_budget() -> None:
    """Every repeated field at its bound, every field of every message set once, and a
    few unknown fields per message: accepted."""
    principal = {
        "org_id": "o",
        "principal_id": "p",
        "agent_id": "a",
        "principal_type": "user",
        "authz_snapshot_id": "s",
        "authz_snapshot_digest": "d",
        "authority": "x",
        "issued_at": {"seconds": 1, "nanos": 1},
        "expires_at": {"seconds": 2, "nanos": 1},
        "request_id": "r",
        "trace_id": "t",
        "source": "s",
        "permissions": 7,
        "token_id": "k",
    }
    message = ld(1, b"user") + ld(2, b"hi") + ld(77, b"new") * UNKNOWN_SLACK
    data = (
        pb.AssembleContextRequest(
            agent_id="a",
            org_id="o",
            session_id="s",
            query="q",
            model="m",
            directive_version_id="v",
            available_tokens=5,
            options={
                "skip_cold_memories": True,
                "skip_hot_memories": True,
                "recency_weight": 1,
                "relevance_weight": 1,
                "usefulness_weight": 1,
                "confidence_weight": 1,
                "max_memories": 3,
                "reject_history_overflow": True,
            },
            request_id="r",
            trace_id="t",
            span_id="s",
            principal_context=principal,
            tool_schemas=["{}"] * 128,
        ).SerializeToString()
        + ld(8, message) * 512
        + ld(77, b"new") * UNKNOWN_SLACK
    )
    assert len(pb.AssembleContextRequest.FromString(data).recent_messages) == 512
    check_counts(data, ASSEMBLE)


def test_a_repeated_field_without_a_bound_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="tags: repeated without a bound"):
        rules_for(pb.SearchMemoriesRequest.DESCRIPTOR, {"categories": (1, "entries")})
