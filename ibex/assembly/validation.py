"""Request validation shared by the gRPC server and in-process callers.

Runs before any I/O, so a malformed request costs nothing downstream and the
caller learns which field is wrong.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Annotated, Final

import msgspec

from ibex.assembly.candidates import MAX_MEMORIES_HARD_CAP, SearchFilter
from ibex.assembly.structs import AssemblyRequest, SearchRequest
from ibex.envvar import env
from ibex.errors import InputError, OverLimitError

MAX_ID_LENGTH = 256
MAX_ROLE_LENGTH = 64
SEARCH_DEFAULT_LIMIT = 10  # SearchMemories' limit when the caller sends 0
#: SearchMemories' filters: entries each, and characters an entry. A memory has one
#: category and a handful of tags, so a filter of more names nothing more.
MAX_SEARCH_CATEGORIES = 64
MAX_SEARCH_TAGS = 64
MAX_LABEL_LENGTH = MAX_ID_LENGTH


class RequestLimits(msgspec.Struct, frozen=True):
    """Per-request input bounds; each field declares the variable that sets it, and its
    default serves the daemon and a core used alone."""

    max_history_messages: Annotated[
        int, env("IBEX_CONTEXT_MAX_HISTORY_MESSAGES", bounds=(0, 100_000))
    ] = 512
    max_text_bytes: Annotated[
        int, env("IBEX_CONTEXT_MAX_TEXT_BYTES", bounds=(1, 64 * 1024 * 1024))
    ] = 1024 * 1024
    max_tool_schemas: Annotated[int, env("IBEX_CONTEXT_MAX_TOOL_SCHEMAS", bounds=(0, 10_000))] = 128


# The contract's memory ids are UUIDs written 8-4-4-4-12 (hex digits of either case):
# the proxy drops any other id from its evidence and feedback names memories by it.
HYPHENATED_UUID: Final = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)


def uuid_text(value: str) -> str | None:
    """The lower-case canonical form of a UUID in any form `uuid.UUID` reads, else None."""
    if len(value) > 64:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def canonical_uuid(field: str, value: str, *, required: bool = True) -> str:
    """Lower-case canonical form; the Redis key and the tenant filter compare these."""
    if not value:
        if required:
            raise InputError(field, "is required (a UUID)")
        return ""
    text = uuid_text(value)
    if text is None:
        raise InputError(field, "is not a valid UUID")
    return text


def _text(field: str, value: str, limit: int) -> None:
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        raise OverLimitError(field, f"exceeds {limit} bytes")


def validate_request(request: AssemblyRequest, limits: RequestLimits) -> AssemblyRequest:
    """A copy with canonical ids, or InputError naming the field (and the limit it breaks).

    Count and size caps are INVALID_ARGUMENT (`OverLimitError`): only an input
    that cannot fit even after trimming is RESOURCE_EXHAUSTED, and that is the
    pipeline's call, once the model's window is known.
    """
    org_id = canonical_uuid("org_id", request.org_id)
    agent_id = canonical_uuid("agent_id", request.agent_id)
    version = canonical_uuid("directive_version_id", request.directive_version_id, required=False)
    if request.available_tokens < 0:
        raise InputError("available_tokens", "must be >= 0")
    for name in ("session_id", "request_id", "trace_id", "span_id", "model"):
        if len(getattr(request, name)) > MAX_ID_LENGTH:
            raise InputError(name, f"longer than {MAX_ID_LENGTH} characters")
    opts = request.options
    for name in ("recency_weight", "relevance_weight", "usefulness_weight", "confidence_weight"):
        w = getattr(opts, name)
        if not math.isfinite(w) or w < 0:
            raise InputError(f"options.{name}", "must be a finite number >= 0")
    if opts.max_memories < 0:
        raise InputError("options.max_memories", "must be >= 0 (0 = no cap)")
    if len(request.recent_messages) > limits.max_history_messages:
        raise OverLimitError("recent_messages", f"more than {limits.max_history_messages} messages")
    if len(request.tool_schemas) > limits.max_tool_schemas:
        raise OverLimitError("tool_schemas", f"more than {limits.max_tool_schemas} entries")
    _text("query", request.query, limits.max_text_bytes)
    for i, msg in enumerate(request.recent_messages):
        _text(f"recent_messages[{i}].content", msg.content, limits.max_text_bytes)
        if len(msg.role) > MAX_ROLE_LENGTH:
            raise InputError(
                f"recent_messages[{i}].role", f"longer than {MAX_ROLE_LENGTH} characters"
            )
    for i, schema in enumerate(request.tool_schemas):
        _text(f"tool_schemas[{i}]", schema, limits.max_text_bytes)
    return msgspec.structs.replace(
        request, org_id=org_id, agent_id=agent_id, directive_version_id=version
    )


def validate_search(request: SearchRequest, limits: RequestLimits) -> SearchFilter:
    """SearchMemories' filter with canonical ids and a capped limit, or InputError naming
    the field (OverLimitError for a query over the text limit)."""
    org_id = canonical_uuid("org_id", request.org_id)
    agent_id = canonical_uuid("agent_id", request.agent_id)
    if not request.query.strip():
        raise InputError("query", "is required")
    _text("query", request.query, limits.max_text_bytes)
    if len(request.session_id) > MAX_ID_LENGTH:
        raise InputError("session_id", f"longer than {MAX_ID_LENGTH} characters")
    for name, values, most in (
        ("categories", request.categories, MAX_SEARCH_CATEGORIES),
        ("tags", request.tags, MAX_SEARCH_TAGS),
    ):
        if len(values) > most:
            raise OverLimitError(name, f"more than {most} entries")
        for i, value in enumerate(values):
            if len(value) > MAX_LABEL_LENGTH:
                raise InputError(f"{name}[{i}]", f"longer than {MAX_LABEL_LENGTH} characters")
    similarity = request.min_similarity
    if request.limit < 0 or not math.isfinite(similarity) or not (0.0 <= similarity <= 1.0):
        raise InputError("limit", "must be >= 0 and min_similarity in [0, 1]")
    return SearchFilter(
        org_id=org_id,
        agent_id=agent_id,
        limit=min(request.limit or SEARCH_DEFAULT_LIMIT, MAX_MEMORIES_HARD_CAP),
        min_similarity=similarity,
        categories=frozenset(request.categories),
        tags=frozenset(request.tags),
        query=request.query,
    )
