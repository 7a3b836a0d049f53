"""Request validation, table-driven: every field, every bound, both sides of each bound.

The contract: malformed ids, non-finite or negative weights and oversize
inputs are refused before any I/O, and the error names the field and the
limit (INVALID_ARGUMENT, count and size caps included: RESOURCE_EXHAUSTED is
for overload and for input that cannot fit even after trimming). Ids come back in
lower-case canonical form, because the Redis key and the tenant filter compare
them byte for byte. Text limits are in bytes *and* characters: multi-byte text
under the character limit must still hit the byte limit.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from ibex.assembly.candidates import MAX_MEMORIES_HARD_CAP, SearchFilter
from ibex.assembly.structs import AssemblyOptions, AssemblyRequest, Message, SearchRequest
from ibex.assembly.validation import (
    MAX_ID_LENGTH,
    MAX_ROLE_LENGTH,
    SEARCH_DEFAULT_LIMIT,
    RequestLimits,
    canonical_uuid,
    validate_request,
    validate_search,
)
from ibex.errors import InputError, OverLimitError, TooLargeError
from ibex.testing.samples import AGENT, ORG

VERSION = "00000000-0000-4000-8000-00000000d1d1"
SMALL = RequestLimits(max_history_messages=3, max_text_bytes=12, max_tool_schemas=2)


def req(**kw: Any) -> AssemblyRequest:
    base: dict[str, Any] = {"org_id": ORG, "agent_id": AGENT}
    base.update(kw)
    return AssemblyRequest(**base)


def refused(request: AssemblyRequest, limits: RequestLimits = SMALL) -> InputError:
    with pytest.raises(InputError) as info:
        validate_request(request, limits)
    return info.value


def test_defaults_are_the_documented_limits() -> None:
    assert RequestLimits() == RequestLimits(
        max_history_messages=512, max_text_bytes=1024 * 1024, max_tool_schemas=128
    )
    assert (MAX_ID_LENGTH, MAX_ROLE_LENGTH) == (256, 64)


def test_a_valid_request_comes_back_unchanged_but_for_canonical_ids() -> None:
    r = req(
        org_id=ORG.upper(),
        agent_id="{" + AGENT.upper() + "}",
        directive_version_id="urn:uuid:" + VERSION.upper(),
        query="q",
        model="gpt-4o",
        session_id="s",
        available_tokens=10,
        recent_messages=(Message("user", "hi"),),
        tool_schemas=("{}",),
        options=AssemblyOptions(relevance_weight=1.0, max_memories=3),
        request_id="r",
        trace_id="t",
        span_id="p",
    )
    out = validate_request(r, SMALL)
    assert (out.org_id, out.agent_id, out.directive_version_id) == (ORG, AGENT, VERSION)
    assert out == msgspec.structs.replace(
        r, org_id=ORG, agent_id=AGENT, directive_version_id=VERSION
    )


# --------------------------------------------------------------------------- ids


@pytest.mark.parametrize("field", ["org_id", "agent_id"])
@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        (ORG, ORG),
        (ORG.upper(), ORG),  # upper case would otherwise filter the tenant's own memories
        (ORG.replace("-", ""), ORG),
        ("{" + ORG + "}", ORG),
        ("urn:uuid:" + ORG, ORG),
    ],
)
def test_required_ids_are_canonicalised(field: str, given: str, canonical: str) -> None:
    out = validate_request(req(**{field: given}), SMALL)
    assert getattr(out, field) == canonical


@pytest.mark.parametrize("field", ["org_id", "agent_id"])
@pytest.mark.parametrize("bad", ["", "not-a-uuid", ORG[:-1], ORG + "0", "g" * 32])
def test_required_ids_must_be_uuids(field: str, bad: str) -> None:
    err = refused(req(**{field: bad}))
    assert type(err) is InputError
    assert err.field == field
    assert str(err).startswith(f"{field}: ")


def test_missing_and_malformed_ids_say_which() -> None:
    assert "is required" in str(refused(req(org_id="")))
    assert "is not a valid UUID" in str(refused(req(org_id="x")))


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("", ""), (VERSION, VERSION), (VERSION.upper(), VERSION), ("{" + VERSION + "}", VERSION)],
)
def test_directive_version_id_is_optional_and_canonicalised(given: str, canonical: str) -> None:
    assert validate_request(req(directive_version_id=given), SMALL).directive_version_id == (
        canonical
    )


@pytest.mark.parametrize("bad", ["v1", VERSION + "x", VERSION[:-2]])
def test_directive_version_id_when_given_must_be_a_uuid(bad: str) -> None:
    err = refused(req(directive_version_id=bad))
    assert type(err) is InputError
    assert err.field == "directive_version_id"


def test_canonical_uuid_length_guard_is_64_characters() -> None:
    # uuid.UUID strips any number of "urn:" prefixes, so these parse; the guard
    # refuses anything over 64 characters before the parser sees it.
    at_limit = "urn:" * 7 + ORG
    assert len(at_limit) == 64
    assert canonical_uuid("org_id", at_limit) == ORG
    over = "urn:" * 7 + "-" + ORG
    assert len(over) == 65
    with pytest.raises(InputError, match="org_id: is not a valid UUID"):
        canonical_uuid("org_id", over)


def test_canonical_uuid_optional_empty_and_required_empty() -> None:
    assert canonical_uuid("x", "", required=False) == ""
    with pytest.raises(InputError, match="x: is required"):
        canonical_uuid("x", "")
    with pytest.raises(InputError, match="x: is not a valid UUID"):
        canonical_uuid("x", "nope", required=False)


# --------------------------------------------------------------------------- scalars


@pytest.mark.parametrize("field", ["session_id", "request_id", "trace_id", "span_id", "model"])
@pytest.mark.parametrize("char", ["a", "é", "😀"])  # characters, not bytes, are limited
def test_opaque_string_lengths(field: str, char: str) -> None:
    ok = validate_request(req(**{field: char * MAX_ID_LENGTH}), SMALL)
    assert getattr(ok, field) == char * MAX_ID_LENGTH
    err = refused(req(**{field: char * (MAX_ID_LENGTH + 1)}))
    assert type(err) is InputError
    assert err.field == field
    assert "256" in str(err)


@pytest.mark.parametrize(("tokens", "ok"), [(-1, False), (0, True), (1, True), (2**31 - 1, True)])
def test_available_tokens_must_not_be_negative(tokens: int, ok: bool) -> None:
    if ok:
        assert validate_request(req(available_tokens=tokens), SMALL).available_tokens == tokens
    else:
        err = refused(req(available_tokens=tokens))
        assert type(err) is InputError
        assert err.field == "available_tokens"


WEIGHTS = ["recency_weight", "relevance_weight", "usefulness_weight", "confidence_weight"]


@pytest.mark.parametrize("name", WEIGHTS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, -1e-300, -math.ulp(0.0)])
def test_weights_must_be_finite_and_not_negative(name: str, value: float) -> None:
    err = refused(req(options=AssemblyOptions(**{name: value})))
    assert type(err) is InputError
    assert err.field == f"options.{name}"


@pytest.mark.parametrize("name", WEIGHTS)
@pytest.mark.parametrize("value", [0.0, -0.0, math.ulp(0.0), 0.5, 1.0, 1e300])
def test_finite_non_negative_weights_pass(name: str, value: float) -> None:
    out = validate_request(req(options=AssemblyOptions(**{name: value})), SMALL)
    assert getattr(out.options, name) == value


@pytest.mark.parametrize(("cap", "ok"), [(-1, False), (0, True), (1, True), (1000, True)])
def test_max_memories_must_not_be_negative(cap: int, ok: bool) -> None:
    r = req(options=AssemblyOptions(max_memories=cap))
    if ok:
        assert validate_request(r, SMALL).options.max_memories == cap
    else:
        err = refused(r)
        assert type(err) is InputError
        assert err.field == "options.max_memories"


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5])
def test_history_message_count_limit(count: int) -> None:
    r = req(recent_messages=tuple(Message("user", "m") for _ in range(count)))
    if count <= SMALL.max_history_messages:
        assert len(validate_request(r, SMALL).recent_messages) == count
    else:
        err = refused(r)
        assert type(err) is OverLimitError and err.status == "INVALID_ARGUMENT"
        assert err.field == "recent_messages"
        assert "3" in str(err)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4])
def test_tool_schema_count_limit(count: int) -> None:
    r = req(tool_schemas=tuple("{}" for _ in range(count)))
    if count <= SMALL.max_tool_schemas:
        assert len(validate_request(r, SMALL).tool_schemas) == count
    else:
        err = refused(r)
        assert type(err) is OverLimitError and err.status == "INVALID_ARGUMENT"
        assert err.field == "tool_schemas"


def test_default_count_limits_bite_one_past_the_limit() -> None:
    limits = RequestLimits()
    msgs = tuple(Message("user", "") for _ in range(512))
    assert validate_request(req(recent_messages=msgs), limits).recent_messages == msgs
    assert refused(req(recent_messages=(*msgs, Message("user", ""))), limits).field == (
        "recent_messages"
    )
    tools = tuple("" for _ in range(128))
    assert validate_request(req(tool_schemas=tools), limits).tool_schemas == tools
    assert refused(req(tool_schemas=(*tools, "")), limits).field == "tool_schemas"


# --------------------------------------------------------------------------- text sizes

# (text, fits in 12 bytes): ASCII both sides, then multi-byte text whose
# character count is under the limit while its UTF-8 size is over it.
TEXTS = [
    ("", True),
    ("a" * 11, True),
    ("a" * 12, True),
    ("a" * 13, False),
    ("é" * 6, True),  # 6 chars, 12 bytes
    ("é" * 7, False),  # 7 chars, 14 bytes
    ("€" * 4, True),  # 4 chars, 12 bytes
    ("€" * 4 + "a", False),  # 5 chars, 13 bytes
    ("😀" * 3, True),  # 3 chars, 12 bytes
    ("😀" * 3 + "a", False),  # 4 chars, 13 bytes
    ("\ud800" * 4, True),  # lone surrogates: 3 bytes each, counted, never a crash
    ("\ud800" * 5, False),
]


def _sized(field: str, text: str) -> AssemblyRequest:
    if field == "query":
        return req(query=text)
    if field == "content":
        return req(recent_messages=(Message("user", "ok"), Message("assistant", text)))
    return req(tool_schemas=("{}", text))


FIELD_NAMES = {
    "query": "query",
    "content": "recent_messages[1].content",
    "tool": "tool_schemas[1]",
}


@pytest.mark.parametrize("field", list(FIELD_NAMES))
@pytest.mark.parametrize(("text", "fits"), TEXTS)
def test_text_byte_limit(field: str, text: str, fits: bool) -> None:
    r = _sized(field, text)
    if fits:
        assert validate_request(r, SMALL) == r
    else:
        err = refused(r)
        assert type(err) is OverLimitError and err.status == "INVALID_ARGUMENT"
        assert err.field == FIELD_NAMES[field]
        assert "12 bytes" in str(err)


@pytest.mark.parametrize(
    ("role", "ok"),
    [("", True), ("r" * 63, True), ("r" * 64, True), ("r" * 65, False), ("é" * 64, True)],
)
def test_message_role_length(role: str, ok: bool) -> None:
    r = req(recent_messages=(Message("user", "a"), Message(role, "b")))
    if ok:
        assert validate_request(r, SMALL).recent_messages[1].role == role
    else:
        err = refused(r)
        assert type(err) is InputError
        assert not isinstance(err, (OverLimitError, TooLargeError))
        assert err.field == "recent_messages[1].role"
        assert "64" in str(err)


# --------------------------------------------------------------------------- messages

# The caller sees these strings (INVALID_ARGUMENT details):
# each names the field and the bound that was broken.
MESSAGES = [
    (req(org_id=""), "org_id: is required (a UUID)"),
    (req(agent_id="nope"), "agent_id: is not a valid UUID"),
    (req(agent_id="urn:" * 8 + AGENT), "agent_id: is not a valid UUID"),
    (req(directive_version_id="v"), "directive_version_id: is not a valid UUID"),
    (req(available_tokens=-1), "available_tokens: must be >= 0"),
    (req(span_id="s" * 257), "span_id: longer than 256 characters"),
    (
        req(options=AssemblyOptions(confidence_weight=math.nan)),
        "options.confidence_weight: must be a finite number >= 0",
    ),
    (
        req(options=AssemblyOptions(max_memories=-1)),
        "options.max_memories: must be >= 0 (0 = no cap)",
    ),
    (
        req(recent_messages=tuple(Message("u", "") for _ in range(4))),
        "recent_messages: more than 3 messages",
    ),
    (req(tool_schemas=("", "", "")), "tool_schemas: more than 2 entries"),
    (req(query="q" * 13), "query: exceeds 12 bytes"),
    (
        req(recent_messages=(Message("r" * 65, ""),)),
        "recent_messages[0].role: longer than 64 characters",
    ),
    (req(tool_schemas=("é" * 7,)), "tool_schemas[0]: exceeds 12 bytes"),
]


@pytest.mark.parametrize(("request_", "message"), MESSAGES)
def test_error_messages_name_the_field_and_the_bound(
    request_: AssemblyRequest, message: str
) -> None:
    assert str(refused(request_)) == message


# --------------------------------------------------------------------------- SearchMemories


def search(**kw: Any) -> SearchFilter:
    base: dict[str, Any] = {"org_id": ORG, "agent_id": AGENT, "query": "deploy"}
    base.update(kw)
    return validate_search(SearchRequest(**base), SMALL)


def test_search_ids_are_canonical_and_the_limit_defaults_and_caps() -> None:
    flt = search(org_id=ORG.upper(), categories=("a", "a"), tags=("t",), min_similarity=0.5)
    assert flt == SearchFilter(
        org_id=ORG,
        agent_id=AGENT,
        limit=SEARCH_DEFAULT_LIMIT,
        min_similarity=0.5,
        categories=frozenset({"a"}),
        tags=frozenset({"t"}),
        query="deploy",
    )
    assert SEARCH_DEFAULT_LIMIT == 10 and MAX_MEMORIES_HARD_CAP == 100
    assert search(limit=3).limit == 3
    assert search(limit=MAX_MEMORIES_HARD_CAP).limit == MAX_MEMORIES_HARD_CAP
    assert search(limit=MAX_MEMORIES_HARD_CAP + 1).limit == MAX_MEMORIES_HARD_CAP
    assert search(min_similarity=0.0).min_similarity == 0.0
    assert search(min_similarity=1.0).min_similarity == 1.0
    assert search(query="x" * 12).query == "x" * 12  # at the byte limit
    at_bounds = search(categories=tuple(f"c{i}" for i in range(64)), tags=("x" * 256,) * 64)
    assert len(at_bounds.categories) == 64 and at_bounds.tags == frozenset({"x" * 256})


@pytest.mark.parametrize(
    ("fields", "field", "error"),
    [
        ({"org_id": "acme"}, "org_id", InputError),
        ({"agent_id": ""}, "agent_id", InputError),
        ({"query": ""}, "query", InputError),
        ({"query": " \n\t"}, "query", InputError),
        ({"query": "x" * 13}, "query", OverLimitError),
        ({"query": "é" * 7}, "query", OverLimitError),  # 7 characters, 14 bytes
        ({"limit": -1}, "limit", InputError),
        ({"min_similarity": -0.01}, "limit", InputError),
        ({"min_similarity": 1.01}, "limit", InputError),
        ({"min_similarity": math.nan}, "limit", InputError),
        ({"min_similarity": math.inf}, "limit", InputError),
        ({"categories": ("c",) * 65}, "categories", OverLimitError),
        ({"tags": ("t",) * 65}, "tags", OverLimitError),
        ({"tags": ("t", "x" * 257)}, "tags[1]", InputError),
        ({"categories": ("x" * 257,)}, "categories[0]", InputError),
        ({"session_id": "s" * 257}, "session_id", InputError),
    ],
)
def test_search_refusals_name_the_field(fields: dict[str, Any], field: str, error: type) -> None:
    with pytest.raises(InputError) as info:
        search(**fields)
    assert type(info.value) is error
    assert info.value.field == field


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": "  "}, "query: is required"),
        ({"limit": -1}, "limit: must be >= 0 and min_similarity in [0, 1]"),
        ({"min_similarity": 1.5}, "limit: must be >= 0 and min_similarity in [0, 1]"),
        ({"categories": ("c",) * 65}, "categories: more than 64 entries"),
        ({"tags": ("t",) * 65}, "tags: more than 64 entries"),
        ({"tags": ("x" * 257,)}, "tags[0]: longer than 256 characters"),
    ],
)
def test_search_refusals_name_the_field_and_the_rule(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as info:
        search(**change)
    assert str(info.value) == message
