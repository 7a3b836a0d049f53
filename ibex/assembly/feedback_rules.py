"""RecordMemoryFeedback's input rules and its idempotency key, pure.

Validated like AssembleContext (canonical UUIDs, bounded strings, errors naming
the field), before any I/O. Memory ids are canonicalised, then de-duplicated
and sorted: the same memory listed twice (or in another letter case) is one
piece of feedback about it, and the order the proxy lists them in carries no
meaning.

The idempotency key is a hash of the feedback itself, not a random value: a
retry by the daemon, and a retry of the whole call by the proxy, send the
same key, so the memory service counts the feedback once however often it
arrives.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Final

import msgspec

from ibex.assembly.validation import MAX_ID_LENGTH, canonical_uuid
from ibex.errors import InputError

FEEDBACK_KINDS: Final = ("positive", "negative", "neutral")
MAX_FEEDBACK_IDS: Final = 100
KEY_SCHEMA: Final = "ibex-feedback-v1"


class Feedback(msgspec.Struct, frozen=True):
    """One validated feedback call: canonical org, distinct sorted canonical ids."""

    org_id: str
    memory_ids: tuple[str, ...]
    feedback: str
    session_id: str = ""
    trace_id: str = ""


class ScoreUpdate(msgspec.Struct, frozen=True):
    """How one memory's score moved, as the memory service reported it."""

    memory_id: str
    previous_score: float
    new_score: float


def validate_feedback(
    *,
    org_id: str,
    memory_ids: Sequence[str],
    feedback: str,
    session_id: str = "",
    trace_id: str = "",
) -> Feedback:
    """A `Feedback`, or InputError (INVALID_ARGUMENT) naming the field."""
    org = canonical_uuid("org_id", org_id)
    if feedback not in FEEDBACK_KINDS:
        raise InputError("feedback", "must be one of positive, negative, neutral")
    for name, value in (("session_id", session_id), ("trace_id", trace_id)):
        if len(value) > MAX_ID_LENGTH:
            raise InputError(name, f"longer than {MAX_ID_LENGTH} characters")
    if not memory_ids:
        raise InputError("memory_ids", "at least one memory id is required")
    # Bounded before any id is parsed: a million ids cost one len().
    if len(memory_ids) > MAX_FEEDBACK_IDS:
        raise InputError("memory_ids", f"more than {MAX_FEEDBACK_IDS} ids")
    ids = {canonical_uuid(f"memory_ids[{i}]", m) for i, m in enumerate(memory_ids)}
    return Feedback(
        org_id=org,
        memory_ids=tuple(sorted(ids)),
        feedback=feedback,
        session_id=session_id,
        trace_id=trace_id,
    )


def idempotency_key(fb: Feedback) -> str:
    """sha256 hex of a canonical encoding of the feedback: stable, order-independent.

    The encoding is a JSON array (ASCII, no spaces) of a schema tag, org,
    session, trace, kind and the sorted ids, so no two different feedbacks
    encode alike (JSON quotes every string; no separator can be forged).
    """
    canonical = json.dumps(
        [KEY_SCHEMA, fb.org_id, fb.session_id, fb.trace_id, fb.feedback, sorted(fb.memory_ids)],
        ensure_ascii=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
