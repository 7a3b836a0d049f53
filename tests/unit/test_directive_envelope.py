"""The directive envelope codec without a server (contract section 3).

Value: JSON `{"v": 1, "content", "injection_mode", "version_id"}`. Missing key:
success, no directive. Unknown injection_mode: system_first. Wrong v, non-JSON,
non-UTF-8, wrong types: a branch error (SourceError) that never echoes the value.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.directive_envelope import MAX_VALUE_BYTES, decode_directive, directive_key

SECRET = "top secret directive text"
VERSION = "6f1c1b9e-8a61-4a55-9d6b-3f2b0c1d2e3f"
ORG = "5B6F0A4E-1D2C-4E8F-9A0B-1C2D3E4F5A6B"
AGENT = "0f1e2d3c4b5a49688776655443322110"


def envelope(**fields: Any) -> bytes:
    value: dict[str, Any] = {"v": 1, "content": SECRET, "injection_mode": "system_append"}
    value.update(fields)
    return json.dumps(value).encode()


def test_missing_key_is_no_directive() -> None:
    assert decode_directive(None) is None


@pytest.mark.parametrize("mode", ["system_first", "system_append", "user_prepend"])
def test_a_well_formed_value_is_its_directive(mode: str) -> None:
    got = decode_directive(envelope(injection_mode=mode, version_id=VERSION.upper()))
    assert got == Directive(content=SECRET, injection_mode=mode, version_id=VERSION)


def test_optional_fields_default_and_unknown_keys_are_ignored() -> None:
    raw = json.dumps({"v": 1, "content": "", "extra": {"nested": [1, 2]}}).encode()
    assert decode_directive(raw) == Directive(content="", injection_mode="system_first")
    assert decode_directive(envelope(version_id=None)) == Directive(
        content=SECRET, injection_mode="system_append", version_id=None
    )


@pytest.mark.parametrize("mode", ["system_sideways", "", "SYSTEM_FIRST"])
def test_unknown_injection_mode_is_system_first(mode: str) -> None:
    got = decode_directive(envelope(injection_mode=mode))
    assert got is not None
    assert got.injection_mode == "system_first"
    assert got.content == SECRET


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        pytest.param(envelope(v=2), "unsupported envelope version 2", id="wrong-v"),
        pytest.param(envelope(v=0), "unsupported envelope version 0", id="v-zero"),
        pytest.param(envelope(v="1"), r"\$\.v", id="v-as-string"),
        pytest.param(envelope(v=True), r"\$\.v", id="v-as-bool"),
        pytest.param(json.dumps({"content": SECRET}).encode(), "v", id="v-missing"),
        pytest.param(b"not json " + SECRET.encode(), "malformed JSON", id="non-json"),
        pytest.param(envelope()[:-5], "malformed JSON", id="truncated"),
        pytest.param(b"[1, 2]", "malformed JSON or not an object", id="json-array"),
        pytest.param(b'"' + SECRET.encode() + b'"', "not an object", id="json-string"),
        pytest.param(b"", "malformed JSON", id="empty"),
        pytest.param(envelope().replace(b"top", b"\xff\xfe"), "not UTF-8", id="non-utf8"),
        # msgspec alone would skip it: the bad byte sits in a key the envelope ignores.
        pytest.param(b'{"v": 1, "content": "ok", "x": "\xff"}', "not UTF-8", id="bad-byte-unread"),
        pytest.param(envelope(content=7), r"\$\.content", id="content-not-str"),
        pytest.param(envelope(content=None), r"\$\.content", id="content-null"),
        pytest.param(json.dumps({"v": 1}).encode(), "content", id="content-missing"),
        pytest.param(envelope(injection_mode=1), "injection_mode", id="mode-not-str"),
        pytest.param(envelope(version_id=12), "version_id", id="version-id-not-str"),
        pytest.param(envelope(version_id="v7"), "version_id", id="version-id-not-uuid"),
        pytest.param(b"[" * 100_000, "malformed JSON", id="nested-too-deeply"),
    ],
)  # fmt: skip
def test_contract_violations_are_source_errors_without_content(raw: bytes, reason: str) -> None:
    with pytest.raises(SourceError, match=reason) as info:
        decode_directive(raw)
    message = str(info.value)
    assert message.startswith("directive value: ")
    assert SECRET not in message
    assert "top" not in message
    assert len(message) <= 160


def test_a_newer_version_with_another_shape_is_named_as_a_version() -> None:
    """A v2 envelope may change the fields; the error says "version", not "type"."""
    raw = json.dumps({"v": 2, "content": {"parts": [SECRET]}}).encode()
    with pytest.raises(SourceError, match="unsupported envelope version 2"):
        decode_directive(raw)


@pytest.mark.parametrize(
    "raw",
    [
        envelope(v=int("7" * 200)),  # a well-formed envelope of another version
        json.dumps({"v": int("7" * 200)}).encode(),  # another version with another shape
    ],
    ids=["well-formed", "other-shape"],
)
def test_a_huge_version_is_named_by_its_first_20_characters(raw: bytes) -> None:
    """JSON numbers have no length limit: the error stays short whichever path names it."""
    with pytest.raises(SourceError) as info:
        decode_directive(raw)
    assert str(info.value) == "directive value: unsupported envelope version " + "7" * 20


def test_a_value_over_the_bound_is_refused_before_decoding() -> None:
    raw = envelope(content="x" * 2000)
    assert decode_directive(raw, max_bytes=len(raw)) is not None
    with pytest.raises(SourceError, match=f"{len(raw)} bytes exceeds the limit"):
        decode_directive(raw, max_bytes=len(raw) - 1)
    big = envelope(content="x" * MAX_VALUE_BYTES)
    with pytest.raises(SourceError, match="exceeds the limit"):
        decode_directive(big)


def test_the_key_uses_lower_case_canonical_uuids() -> None:
    org, agent = str(uuid.UUID(ORG)), str(uuid.UUID(AGENT))
    assert directive_key(ORG, AGENT) == f"{org}:directive:{agent}"
    assert directive_key(ORG, AGENT) == directive_key(org, agent)
    assert "{" not in directive_key(ORG, AGENT)  # no Redis Cluster hash tag


@pytest.mark.parametrize(("org", "agent"), [("org-1", AGENT), (ORG, ""), (ORG, "x" * 40)])
def test_a_key_from_non_uuids_is_a_source_error(org: str, agent: str) -> None:
    with pytest.raises(SourceError) as info:
        directive_key(org, agent)
    assert str(info.value) == "directive key: org_id and agent_id must be UUIDs"  # no input echoed
