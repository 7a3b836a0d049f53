"""The directive envelope the proxy writes into Redis (contract section 3), sans-IO.

A cached value is JSON `{"v": 1, "content": str, "injection_mode": str,
"version_id": uuid}` under the key `<org_id>:directive:<agent_id>`. A missing
key is success without a directive; an unknown injection mode is read as
`system_first`; anything else that breaks the contract (another `v`, not JSON,
not UTF-8, wrong types, too large) is a SourceError whose message names a
reason, a type or a path, never the value. Bytes in, a Directive out: no
client, no loop, so every rule of the format is tested without a server.
"""

from __future__ import annotations

import uuid
from typing import Any, Final, cast

import msgspec

from ibex.assembly.structs import INJECTION_MODES, Directive, InjectionMode
from ibex.errors import SourceError

__all__ = ["ENVELOPE_VERSION", "MAX_VALUE_BYTES", "decode_directive", "directive_key"]

ENVELOPE_VERSION: Final = 1
# Default bound on one cached value; the source may set its own.
MAX_VALUE_BYTES: Final = 1024 * 1024
_MODES: Final[frozenset[str]] = frozenset(INJECTION_MODES)


class _Envelope(msgspec.Struct, frozen=True):
    """The cached value as the proxy writes it; injection_mode is checked after decode."""

    v: int
    content: str
    injection_mode: str = "system_first"
    version_id: uuid.UUID | None = None


class _VersionProbe(msgspec.Struct):
    """Only the version, to tell "newer format" from "broken value" on the error path."""

    v: Any = None


_decode_envelope = msgspec.json.Decoder(_Envelope).decode
_decode_probe = msgspec.json.Decoder(_VersionProbe).decode


def directive_key(org_id: str, agent_id: str) -> str:
    """`{org_id}:directive:{agent_id}` with lower-case canonical UUIDs."""
    try:
        org = uuid.UUID(org_id)
        agent = uuid.UUID(agent_id)
    except (ValueError, TypeError, AttributeError):
        raise SourceError("directive key: org_id and agent_id must be UUIDs") from None
    return f"{org}:directive:{agent}"


def decode_directive(raw: bytes | None, max_bytes: int = MAX_VALUE_BYTES) -> Directive | None:
    """The directive a cached value holds: None for a missing key (`raw` None),
    SourceError (with no content in it) if the value breaks the contract."""
    if raw is None:
        return None
    if len(raw) > max_bytes:
        raise SourceError(f"directive value: {len(raw)} bytes exceeds the limit")
    try:
        # msgspec checks UTF-8 only in the strings it keeps; the contract wants the
        # whole value valid, and checking it costs about a microsecond per 4 KiB.
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError("directive value: not UTF-8") from None
    try:
        env = _decode_envelope(raw)
    except msgspec.DecodeError as exc:
        raise SourceError(_decode_failure(raw, exc)) from None
    except RecursionError:  # msgspec's depth limit, even inside an ignored key
        raise SourceError("directive value: malformed JSON (nested too deeply)") from None
    if env.v != ENVELOPE_VERSION:
        raise SourceError(_unsupported_version(env.v))
    mode: InjectionMode = "system_first"
    if env.injection_mode in _MODES:
        mode = cast(InjectionMode, env.injection_mode)
    version = str(env.version_id) if env.version_id is not None else None
    return Directive(content=env.content, injection_mode=mode, version_id=version)


def _unsupported_version(v: int) -> str:
    """The error for another envelope version; JSON allows any number of digits, so the
    version is named by its first 20 characters (a 64-bit integer's) only."""
    return f"directive value: unsupported envelope version {str(v)[:20]}"


def _decode_failure(raw: bytes, exc: msgspec.DecodeError) -> str:
    """A short, content-free reason. msgspec's messages name only paths and types."""
    try:
        probe = _decode_probe(raw)
    except (msgspec.DecodeError, RecursionError):
        return "directive value: malformed JSON or not an object"
    v = probe.v
    if isinstance(v, int) and not isinstance(v, bool) and v != ENVELOPE_VERSION:
        return _unsupported_version(v)
    if isinstance(exc, msgspec.ValidationError):
        # e.g. "Expected `str`, got `int` - at `$.content`": a type and a path, no value.
        return f"directive value: {str(exc)[:120]}"
    return "directive value: malformed JSON"
