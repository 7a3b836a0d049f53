"""A variable's raw text to its typed value: durations with units, bounded numbers, lists,
URLs, addresses, files, digests.

A parser takes (the variable's full name, its raw non-blank value) and
returns the value or raises ConfigError naming the variable, so an operator
can fix the unit file without reading code; a secret's value is never echoed
back. `parser_for` picks the parser of a declared field from its type and
declaration (`ibex.envvar.env`): a duration from its unit, a number from its
bounds, a choice from its `Literal` type.
"""

from __future__ import annotations

import functools
import math
import os
import re
import types
import typing
import uuid
from collections.abc import Callable
from typing import Any, Literal

from ibex.envvar import Declared
from ibex.errors import ConfigError, ConfigFileError
from ibex.netaddr import parse_allowed_san, split_host_port
from ibex.ops.logs import redact_url

__all__ = [
    "MS",
    "UNITS",
    "WITH_UNIT",
    "Parse",
    "TokenOrgs",
    "addr",
    "addrs",
    "boolean",
    "choice",
    "file",
    "format_duration",
    "http_url",
    "local_addr",
    "nonce_key",
    "number",
    "parse_duration",
    "parser_for",
    "redact_url",
    "sans",
    "sha256_list",
    "text",
    "token_orgs",
    "urls",
]

#: A parser: (the variable's full name, its raw non-blank value) -> the value, or ConfigError.
Parse = Callable[[str, str], Any]

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Seconds per duration unit.
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(name: str, raw: str, *, bare: bool = True) -> float:
    """`45`, `45ms`, `0.2s`, `2m` or `1h` to seconds; a bare number is milliseconds.

    With `bare=False` a number without a unit is refused: for a setting whose
    documented unit is the second, reading `45` as milliseconds would silently
    turn 45 s into 45 ms. Non-finite, zero or negative is an error.
    """
    m = _DURATION.match(raw)
    if not m:
        raise ConfigError(f"{name}: expected a duration like 45ms, 0.2s or 2m, got {raw!r}")
    if m.group(2) is None and not bare:
        raise ConfigError(
            f"{name}: give a unit, e.g. 45ms or 5s (a bare number would be milliseconds), "
            f"got {raw!r}"
        )
    seconds = float(m.group(1)) * UNITS[m.group(2) or "ms"]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}: duration must be finite and > 0, got {raw!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """`seconds` as `parse_duration` reads it back: milliseconds below a second, else seconds."""
    value, unit = (seconds * 1000.0, "ms") if seconds < 1.0 else (seconds, "s")
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return f"{text}{unit}"


# Durations take a unit (ms, s, m, h). A bare number is milliseconds (`MS`); a setting
# documented in seconds refuses it (`WITH_UNIT`) rather than read `45` as 45 ms.
MS: Parse = functools.partial(parse_duration, bare=True)
WITH_UNIT: Parse = functools.partial(parse_duration, bare=False)


def _number(name: str, raw: str, kind: type[float], lo: float, hi: float) -> float:
    try:
        value = kind(raw.strip())
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name}: expected {expected}, got {raw!r}") from None
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ConfigError(f"{name}: must be between {lo} and {hi}, got {raw.strip()}")
    return value


def number(kind: type[float], lo: float, hi: float) -> Parse:
    """An integer (`kind` int) or a finite number (float) in [lo, hi]."""
    return functools.partial(_number, kind=kind, lo=lo, hi=hi)


def boolean(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in {"1", "true", "yes", "on"}:
        return True
    if v in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {raw!r}")


def _choice(name: str, raw: str, values: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in values:
        raise ConfigError(f"{name}: expected one of {', '.join(values)}, got {raw.strip()!r}")
    return value


def choice(*values: str) -> Parse:
    """One of `values` (case-insensitive, given back lower-case)."""
    return functools.partial(_choice, values=values)


def _items(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def sans(name: str, raw: str) -> tuple[str, ...]:
    """`DNS:name`, `URI:...`, `email:...`, `IP:addr` or a bare DNS name, comma-separated."""
    entries = _items(raw)
    for entry in entries:
        try:
            parse_allowed_san(entry)
        except ValueError as exc:
            raise ConfigError(f"{name}: {entry!r}: {exc}") from None
    return entries


def _url(name: str, raw: str, schemes: tuple[str, ...]) -> str:
    value = raw.strip()
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    if scheme not in schemes:
        raise ConfigError(f"{name}: expected a URL with scheme {'/'.join(schemes)}")
    return value


def urls(*schemes: str) -> Parse:
    """A URL with one of `schemes`."""
    return functools.partial(_url, schemes=schemes)


def http_url(name: str, raw: str) -> str:
    return _url(name, raw, ("http", "https")).rstrip("/")


def addr(name: str, raw: str) -> str:
    value = raw.strip()
    try:
        host, _ = split_host_port(value)
    except ValueError:
        host = ""
    if not host:
        raise ConfigError(f"{name}: expected host:port, got {raw!r}")
    return value


def addrs(name: str, raw: str) -> tuple[str, ...]:
    return tuple(addr(name, a) for a in _items(raw))


def local_addr(name: str, raw: str) -> str:
    """host:port; a bare port binds loopback (an endpoint for a local scraper unless a
    host is named, which off loopback needs a token)."""
    bare = raw.strip()
    return addr(name, f"127.0.0.1:{bare}" if bare.isdigit() else raw)


def file(name: str, raw: str) -> str:
    value = raw.strip()
    if not os.path.exists(value):
        raise ConfigFileError(f"{name}: no such file or directory: {value!r}")
    return value


def text(name: str, raw: str) -> str:
    return raw.strip()


def sha256_list(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated SHA-256 hex digests (several: rotation), lower-cased."""
    hashes = tuple(h.lower() for h in _items(raw))
    for h in hashes:
        if not _SHA256.fullmatch(h):
            raise ConfigError(f"{name}: each entry must be 64 hex digits (a SHA-256)")
    return hashes


#: IBEX_CONTEXT_AUTH_TOKEN_ORGS: (token SHA-256, the orgs that token may act for), per entry.
TokenOrgs = tuple[tuple[str, tuple[str, ...]], ...]


def token_orgs(name: str, raw: str) -> TokenOrgs:
    """`sha256=org-uuid[+org-uuid...]`, comma-separated; digests lower-cased, org ids in the
    canonical form requests' org ids are compared in (lower-case, hyphenated).

    An entry never echoes its digest back (the digests are as secret as
    AUTH_TOKENS_SHA256's): an error names the entry by its position.
    """
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for i, entry in enumerate(_items(raw), 1):
        digest, sep, orgs = entry.partition("=")
        digest = digest.strip().lower()
        if not sep or not _SHA256.fullmatch(digest):
            raise ConfigError(f"{name}: entry {i} must be sha256=org-uuid[+org-uuid...]")
        if digest in seen:
            raise ConfigError(f"{name}: entry {i} names a token hash already bound")
        seen.add(digest)
        ids: list[str] = []
        for org_text in orgs.split("+"):
            try:
                org = str(uuid.UUID(org_text.strip())) if len(org_text) <= 64 else ""
            except ValueError:
                org = ""
            if not org:
                raise ConfigError(
                    f"{name}: entry {i}: {org_text.strip()[:64]!r} is not an org UUID"
                )
            if org not in ids:
                ids.append(org)
        out.append((digest, tuple(ids)))
    return tuple(out)


def _nonce_key(name: str, raw: str, min_chars: int) -> str:
    if len(raw.strip()) < min_chars:
        raise ConfigError(
            f"{name}: must be at least {min_chars} characters "
            "(a random secret shared by every replica)"
        )
    return raw.strip()


def nonce_key(min_chars: int) -> Parse:
    """A secret of at least `min_chars` characters (surrounding blanks dropped)."""
    return functools.partial(_nonce_key, min_chars=min_chars)


def parser_for(d: Declared) -> Parse:
    """The parser of a declared field: its own `parse`, else one its declaration and type
    imply (a duration from its unit, a bounded number, a boolean, a `Literal` choice).

    TypeError when the type says nothing a parser can follow (give `parse=`), or a
    number has no bounds (every number an operator gives is bounded).
    """
    if d.parse is not None:
        return d.parse
    if d.unit is not None:
        return MS if d.unit == "ms" else WITH_UNIT
    kind = _without_none(d.type)
    if kind is bool:
        return boolean
    if typing.get_origin(kind) is Literal:
        return choice(*typing.get_args(kind))
    if kind in (int, float):
        if d.bounds is None:
            raise TypeError(f"{d.variable}: a number needs bounds=(lo, hi)")
        return number(kind, *d.bounds)
    raise TypeError(f"{d.variable}: no parser follows from {kind!r}; give parse=")


def _without_none(kind: Any) -> Any:
    """`T` for `T | None`, else `kind` itself."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind
