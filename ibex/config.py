"""Settings from IBEX_CONTEXT_* environment variables, validated once at start-up.

The `Settings` class body is the one table of settings: each field is one
variable, annotated with its `Var` (the variable's name, how its raw value is
parsed and bounded, whether it is secret, and which layer config fields it
sets). The parser, `known_variables`, the typo check, redaction and the
composition root's translation into each layer's config struct
(`ibex.service.root`) all read that table, so a new setting is one field here
plus the code that uses it.

A default is written once. A targeted field (its `Var` names layer fields in
`to`) defaults to `UNSET`, typed `T | UnsetType`: the root passes only set
values, so the layer config struct's own field default applies, and
`ibex.service.root.effective_settings` reads it back for `ibex config` and the
docs checks. This module cannot import the layer structs (`ibex.ops.workers`
imports it, and the CLI must stay light), hence the sentinel rather than a
copied value; `_table` refuses a targeted field with any other default. An
untargeted field keeps its default here (None where the root computes one).

Every error names the variable so an operator can fix the unit file without
reading code; secret values are never echoed back.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import typing
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from ibex.errors import ConfigError, ConfigFileError
from ibex.netaddr import parse_allowed_san, split_host_port

__all__ = [
    "DURATIONS",
    "PREFIX",
    "TABLE",
    "UNSET",
    "ConfigError",
    "ConfigFileError",
    "Settings",
    "UnsetType",
    "Var",
    "format_duration",
    "known_variables",
    "layer_fields",
    "load_settings",
    "parse_duration",
    "redact_url",
    "unknown_variables",
]

PREFIX = "IBEX_CONTEXT_"
#: IBEX_CONTEXT_NONCE_KEY's least length (= ibex.assembly.nonce.MIN_KEY_CHARS).
NONCE_KEY_MIN_CHARS = 32
#: IBEX_CONTEXT_NONCE_MAX_AGE's default and bounds, seconds (= ibex.assembly.nonce's).
NONCE_MAX_AGE_DEFAULT = 1800.0
NONCE_MAX_AGE_MIN = 60.0
NONCE_MAX_AGE_MAX = 30 * 86400.0
# Variables read outside `load_settings` (the CLI client's token).
EXTRA_KNOWN = frozenset({"CLIENT_TOKEN"})
# Query parameters of a URL that carry a secret (redis-py reads `password`).
_SECRET_QUERY = re.compile(r"pass|secret|token|key|auth", re.IGNORECASE)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s|m|h)?\s*$")
#: Seconds per duration unit.
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

#: A parser: (the variable's full name, its raw non-blank value) -> the value, or ConfigError.
Parse = Callable[[str, str], Any]


def redact_url(value: str) -> str:
    """`value` with userinfo and password-like query parameters replaced by `<redacted>`.

    The userinfo is everything between `://` (or the start) and the LAST `@`:
    an unencoded password may hold `/`, `?`, `#` or `@`, which a URL parser
    reads as the start of the path, query or fragment and would leave on show.
    Over-redacting a host is harmless; echoing a password is not. Works on
    strings that are not URLs too (`host:port` comes back unchanged).
    """
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if "@" in rest:
        rest = "<redacted>@" + rest.rpartition("@")[2]
    rest, hashmark, fragment = rest.partition("#")
    base, qmark, query = rest.partition("?")
    if query:
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        except ValueError:
            query = "<redacted>"
        else:
            query = "&".join(
                f"{k}=<redacted>" if _SECRET_QUERY.search(k) else urllib.parse.urlencode({k: v})
                for k, v in pairs
            )
    return f"{scheme}{sep}{base}{qmark}{query}{hashmark}{fragment}"


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


def _int(name: str, raw: str, lo: int, hi: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}: must be between {lo} and {hi}, got {value}")
    return value


def _float(name: str, raw: str, lo: float, hi: float) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ConfigError(f"{name}: must be a finite number in [{lo}, {hi}], got {raw!r}")
    return value


def _bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in {"1", "true", "yes", "on"}:
        return True
    if v in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {raw!r}")


def _list(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def _sans(name: str, raw: str) -> tuple[str, ...]:
    """`DNS:name`, `URI:...`, `email:...`, `IP:addr` or a bare DNS name, comma-separated."""
    entries = _list(raw)
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


def _http_url(name: str, raw: str) -> str:
    return _url(name, raw, ("http", "https")).rstrip("/")


def _addr(name: str, raw: str) -> str:
    value = raw.strip()
    try:
        host, _ = split_host_port(value)
    except ValueError:
        host = ""
    if not host:
        raise ConfigError(f"{name}: expected host:port, got {raw!r}")
    return value


def _addrs(name: str, raw: str) -> tuple[str, ...]:
    return tuple(_addr(name, a) for a in _list(raw))


def _local_addr(name: str, raw: str) -> str:
    """host:port; a bare port binds loopback (an endpoint for a local scraper unless a
    host is named, which off loopback needs a token)."""
    bare = raw.strip()
    return _addr(name, f"127.0.0.1:{bare}" if bare.isdigit() else raw)


def _file(name: str, raw: str) -> str:
    value = raw.strip()
    if not os.path.exists(value):
        raise ConfigFileError(f"{name}: no such file or directory: {value!r}")
    return value


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _sha256_list(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated SHA-256 hex digests (several: rotation), lower-cased."""
    hashes = tuple(h.lower() for h in _list(raw))
    for h in hashes:
        if not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ConfigError(f"{name}: each entry must be 64 hex digits (a SHA-256)")
    return hashes


#: IBEX_CONTEXT_AUTH_TOKEN_ORGS: (token SHA-256, the orgs that token may act for), per entry.
TokenOrgs = tuple[tuple[str, tuple[str, ...]], ...]


def _token_orgs(name: str, raw: str) -> TokenOrgs:
    """`sha256=org-uuid[+org-uuid...]`, comma-separated; digests lower-cased, org ids in the
    canonical form requests' org ids are compared in (lower-case, hyphenated).

    An entry never echoes its digest back (the digests are as secret as
    AUTH_TOKENS_SHA256's): an error names the entry by its position.
    """
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for i, entry in enumerate(_list(raw), 1):
        digest, sep, orgs = entry.partition("=")
        digest = digest.strip().lower()
        if not sep or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ConfigError(f"{name}: entry {i} must be sha256=org-uuid[+org-uuid...]")
        if digest in seen:
            raise ConfigError(f"{name}: entry {i} names a token hash already bound")
        seen.add(digest)
        ids: list[str] = []
        for text in orgs.split("+"):
            try:
                org = str(uuid.UUID(text.strip())) if len(text) <= 64 else ""
            except ValueError:
                org = ""
            if not org:
                raise ConfigError(f"{name}: entry {i}: {text.strip()[:64]!r} is not an org UUID")
            if org not in ids:
                ids.append(org)
        out.append((digest, tuple(ids)))
    return tuple(out)


def _nonce_key(name: str, raw: str) -> str:
    if len(raw.strip()) < NONCE_KEY_MIN_CHARS:
        raise ConfigError(
            f"{name}: must be at least {NONCE_KEY_MIN_CHARS} characters "
            "(a random secret shared by every replica)"
        )
    return raw.strip()


_LEVELS = ("debug", "info", "warning", "error")
#: IBEX_CONTEXT_SECTION_ORDER's values (= ibex.assembly.output_format.SECTION_ORDERS).
SECTION_ORDERS = ("seed", "cache")


def _section_order(name: str, raw: str) -> str:
    order = raw.strip().lower()
    if order not in SECTION_ORDERS:
        raise ConfigError(
            f"{name}: expected one of {', '.join(SECTION_ORDERS)} (seed: the fixed order; "
            f"cache: what changes least first, for a provider's prompt cache), got {raw.strip()!r}"
        )
    return order


def _level(name: str, raw: str) -> str:
    level = raw.strip().lower()
    if level not in _LEVELS:
        raise ConfigError(f"{name}: expected one of {', '.join(_LEVELS)}")
    return level


def ints(lo: int, hi: int) -> Parse:
    """An integer in [lo, hi]."""
    return functools.partial(_int, lo=lo, hi=hi)


def floats(lo: float, hi: float) -> Parse:
    """A finite number in [lo, hi]."""
    return functools.partial(_float, lo=lo, hi=hi)


def urls(*schemes: str) -> Parse:
    """A URL with one of `schemes`."""
    return functools.partial(_url, schemes=schemes)


# Durations take a unit (ms, s, m, h). A bare number is milliseconds (`MS`); a setting
# documented in seconds refuses it (`WITH_UNIT`) rather than read `45` as 45 ms.
MS: Parse = functools.partial(parse_duration, bare=True)
WITH_UNIT: Parse = functools.partial(parse_duration, bare=False)
MiB = 1024 * 1024
GiB = 1024 * MiB


class Var(msgspec.Struct, frozen=True):
    """One row of the settings table (the metadata of a `Settings` field).

    `to` names the layer config fields the value sets, as `StructName.field`;
    `ibex.service.root` builds each layer's config from them, so the layer
    never sees `Settings`. A field the root computes (a default derived from
    another value) names no target and is translated by hand there.
    """

    suffix: str
    parse: Parse
    to: tuple[str, ...] = ()
    secret: bool = False


def var(suffix: str, parse: Parse, *to: str, secret: bool = False) -> Var:
    """A row: IBEX_CONTEXT_`suffix`, parsed by `parse`, setting the layer fields `to`."""
    return Var(suffix, parse, to, secret)


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Configuration, one field per variable. Durations are seconds (floats).

    A targeted field is `UNSET` until its variable is given: its default is the
    layer config's own (`ibex.service.root.effective_settings` shows it).
    """

    # retrieval
    timeout: Annotated[float | UnsetType, var("TIMEOUT", MS, "RetrievalConfig.timeout")] = UNSET
    deadline: Annotated[float | UnsetType, var("DEADLINE_MS", MS, "RetrievalConfig.deadline")] = (
        UNSET
    )
    directive_timeout: Annotated[
        float | UnsetType, var("DIRECTIVE_TIMEOUT_MS", MS, "RetrievalConfig.directive_timeout")
    ] = UNSET
    hot_timeout: Annotated[
        float | UnsetType, var("HOT_TIMEOUT_MS", MS, "RetrievalConfig.hot_timeout")
    ] = UNSET
    cold_timeout: Annotated[
        float | UnsetType, var("COLD_TIMEOUT_MS", MS, "RetrievalConfig.cold_timeout")
    ] = UNSET
    pipeline_headroom: Annotated[
        float | UnsetType, var("PIPELINE_HEADROOM_MS", MS, "RetrievalConfig.pipeline_headroom")
    ] = UNSET
    hot_limit: Annotated[
        int | UnsetType, var("HOT_LIMIT", ints(1, 100), "RetrievalConfig.hot_limit")
    ] = UNSET
    cold_limit: Annotated[
        int | UnsetType, var("COLD_LIMIT", ints(1, 100), "RetrievalConfig.cold_limit")
    ] = UNSET
    min_confidence: Annotated[
        float | UnsetType,
        var(
            "MIN_CONFIDENCE",
            floats(0.0, 1.0),
            "RetrievalConfig.min_confidence",
        ),
    ] = UNSET
    # admission
    min_answer: Annotated[
        float | UnsetType, var("MIN_ANSWER_MS", MS, "AdmissionConfig.min_answer")
    ] = UNSET
    min_useful: Annotated[
        float | UnsetType, var("MIN_USEFUL_MS", MS, "AdmissionConfig.min_useful")
    ] = UNSET
    queue_target: Annotated[
        float | UnsetType, var("QUEUE_TARGET_MS", MS, "AdmissionConfig.queue_target")
    ] = UNSET
    queue_interval: Annotated[
        float | UnsetType, var("QUEUE_INTERVAL_MS", MS, "AdmissionConfig.queue_interval")
    ] = UNSET
    request_read_timeout: Annotated[
        float | UnsetType, var("REQUEST_READ_TIMEOUT", WITH_UNIT, "AdmissionConfig.read_timeout")
    ] = UNSET
    max_in_flight: Annotated[
        int | UnsetType, var("MAX_IN_FLIGHT", ints(1, 100_000), "AdmissionConfig.max_in_flight")
    ] = UNSET
    max_in_flight_bytes: Annotated[
        int | UnsetType,
        var("MAX_IN_FLIGHT_BYTES", ints(1024, 64 * GiB), "AdmissionConfig.max_in_flight_bytes"),
    ] = UNSET
    # None: a quarter of MAX_IN_FLIGHT_BYTES (computed by the root)
    max_caller_in_flight_bytes: Annotated[
        int | None, var("MAX_CALLER_IN_FLIGHT_BYTES", ints(1024, 64 * GiB))
    ] = None
    max_unauthenticated_bytes: Annotated[
        int | UnsetType,
        var(
            "MAX_UNAUTHENTICATED_BYTES",
            ints(1024, 1 * GiB),
            "AdmissionConfig.max_unauthenticated_bytes",
        ),
    ] = UNSET
    max_concurrent_assemblies: Annotated[
        int | UnsetType,
        var("MAX_CONCURRENT_ASSEMBLIES", ints(1, 100_000), "AdmissionConfig.max_concurrent"),
    ] = UNSET
    # None: half of MAX_CONCURRENT_ASSEMBLIES (computed by the root)
    max_org_assemblies: Annotated[int | None, var("MAX_ORG_ASSEMBLIES", ints(1, 100_000))] = None
    max_queue_wait: Annotated[
        float | UnsetType, var("MAX_QUEUE_WAIT", WITH_UNIT, "AdmissionConfig.max_queue_wait")
    ] = UNSET
    # memory service
    memory_base_url: Annotated[str | None, var("MEMORY_BASE_URL", _http_url)] = None
    memory_api_token: Annotated[str | None, var("MEMORY_API_TOKEN", _text, secret=True)] = None
    memory_pool_size: Annotated[int, var("MEMORY_POOL_SIZE", ints(1, 4096))] = 32
    memory_max_content_bytes: Annotated[int, var("MEMORY_MAX_CONTENT_BYTES", ints(1, 64 * MiB))] = (
        32 * 1024
    )
    memory_max_response_bytes: Annotated[int, var("MEMORY_MAX_RESPONSE_BYTES", ints(1024, GiB))] = (
        4 * MiB
    )
    # directives: Redis and the cache in front of it
    redis_url: Annotated[str | None, var("REDIS_URL", urls("redis", "rediss", "unix"))] = None
    directive_cache_entries: Annotated[
        int | UnsetType,
        var("DIRECTIVE_CACHE_ENTRIES", ints(0, 10_000_000), "DirectiveCacheConfig.max_entries"),
    ] = UNSET
    directive_cache_bytes: Annotated[
        int | UnsetType,
        var("DIRECTIVE_CACHE_BYTES", ints(0, 4 * GiB), "DirectiveCacheConfig.max_bytes"),
    ] = UNSET
    directive_cache_ttl: Annotated[
        float | UnsetType, var("DIRECTIVE_CACHE_TTL", WITH_UNIT, "DirectiveCacheConfig.ttl")
    ] = UNSET
    directive_cache_max_age: Annotated[
        float | UnsetType, var("DIRECTIVE_CACHE_MAX_AGE", WITH_UNIT, "DirectiveCacheConfig.max_age")
    ] = UNSET
    redis_sentinels: Annotated[tuple[str, ...], var("REDIS_SENTINELS", _addrs)] = ()
    redis_sentinel_master: Annotated[str | None, var("REDIS_SENTINEL_MASTER", _text)] = None
    redis_sentinel_password: Annotated[
        str | None, var("REDIS_SENTINEL_PASSWORD", _text, secret=True)
    ] = None
    redis_cluster: Annotated[bool, var("REDIS_CLUSTER", _bool)] = False
    local_source_path: Annotated[str | None, var("LOCAL_SOURCE_PATH", _file)] = None
    # the pure core
    packer_dp_cell_ceiling: Annotated[
        int | UnsetType,
        var("PACKER_DP_CELL_CEILING", ints(1, 50_000_000), "PipelineConfig.dp_cell_ceiling"),
    ] = UNSET
    packer_max_consecutive_skips: Annotated[
        int | UnsetType,
        var(
            "PACKER_MAX_CONSECUTIVE_SKIPS",
            ints(0, 1_000_000),
            "PipelineConfig.max_consecutive_skips",
        ),
    ] = UNSET
    formatter_nonce_bytes: Annotated[
        int | UnsetType, var("FORMATTER_NONCE_BYTES", ints(8, 64), "PipelineConfig.nonce_bytes")
    ] = UNSET
    section_order: Annotated[
        str | UnsetType, var("SECTION_ORDER", _section_order, "PipelineConfig.section_order")
    ] = UNSET
    nonce_key: Annotated[str | None, var("NONCE_KEY", _nonce_key, secret=True)] = None
    # A session nonce's lifetime; its bounds are checked in `load_settings`.
    nonce_max_age: Annotated[float, var("NONCE_MAX_AGE", WITH_UNIT)] = NONCE_MAX_AGE_DEFAULT
    catalog_path: Annotated[str | None, var("CATALOG_PATH", _file)] = None
    tiktoken_dir: Annotated[str | None, var("TIKTOKEN_DIR", _file)] = None
    token_cache_entries: Annotated[int, var("TOKEN_CACHE_ENTRIES", ints(0, 10_000_000))] = 65536
    token_cache_bytes: Annotated[int, var("TOKEN_CACHE_BYTES", ints(0, 4 * GiB))] = 32 * MiB
    # request bounds
    max_message_bytes: Annotated[
        int | UnsetType,
        var("MAX_MESSAGE_BYTES", ints(1024, 256 * MiB), "EdgeConfig.max_message_bytes"),
    ] = UNSET
    max_history_messages: Annotated[
        int | UnsetType,
        var("MAX_HISTORY_MESSAGES", ints(0, 100_000), "RequestLimits.max_history_messages"),
    ] = UNSET
    max_text_bytes: Annotated[
        int | UnsetType, var("MAX_TEXT_BYTES", ints(1, 64 * MiB), "RequestLimits.max_text_bytes")
    ] = UNSET
    max_tool_schemas: Annotated[
        int | UnsetType, var("MAX_TOOL_SCHEMAS", ints(0, 10_000), "RequestLimits.max_tool_schemas")
    ] = UNSET
    # listening, callers, TLS
    grpc_addr: Annotated[str, var("GRPC_ADDR", _addr)] = "127.0.0.1:9092"
    auth_tokens_sha256: Annotated[
        tuple[str, ...], var("AUTH_TOKENS_SHA256", _sha256_list, secret=True)
    ] = ()
    # Tokens bound to orgs; a token not listed acts for any org (checked in `load_settings`).
    auth_token_orgs: Annotated[TokenOrgs, var("AUTH_TOKEN_ORGS", _token_orgs, secret=True)] = ()
    require_principal: Annotated[bool, var("REQUIRE_PRINCIPAL", _bool)] = False
    tls_cert: Annotated[str | None, var("TLS_CERT", _file)] = None
    tls_key: Annotated[str | None, var("TLS_KEY", _file)] = None
    tls_client_ca: Annotated[str | None, var("TLS_CLIENT_CA", _file)] = None
    tls_allowed_sans: Annotated[tuple[str, ...], var("TLS_ALLOWED_SANS", _sans)] = ()
    allow_insecure: Annotated[bool, var("ALLOW_INSECURE", _bool)] = False
    # connections and draining
    drain_grace: Annotated[
        float | UnsetType, var("DRAIN_GRACE", WITH_UNIT, "DaemonConfig.drain_grace")
    ] = UNSET
    # None: min(1024, RLIMIT_NOFILE soft - 64) at start-up
    max_connections: Annotated[int | None, var("MAX_CONNECTIONS", ints(1, 1_000_000))] = None
    # None: MAX_CONNECTIONS // 4, at least 1
    max_connections_per_peer: Annotated[
        int | None, var("MAX_CONNECTIONS_PER_PEER", ints(1, 1_000_000))
    ] = None
    connection_auth_timeout: Annotated[
        float | UnsetType,
        var("CONNECTION_AUTH_TIMEOUT", WITH_UNIT, "ConnectionsConfig.auth_timeout"),
    ] = UNSET
    connection_first_call_grace: Annotated[
        float | UnsetType,
        var("CONNECTION_FIRST_CALL_GRACE", WITH_UNIT, "ConnectionsConfig.first_call_grace"),
    ] = UNSET
    # new connections per second per peer IP
    connection_rate_per_peer: Annotated[
        float | UnsetType,
        var("CONNECTION_RATE_PER_PEER", floats(0.1, 1_000_000.0), "ConnectionsConfig.peer_rate"),
    ] = UNSET
    tls_handshake_timeout: Annotated[
        float | UnsetType,
        var("TLS_HANDSHAKE_TIMEOUT", WITH_UNIT, "ConnectionsConfig.tls_handshake_timeout"),
    ] = UNSET
    connection_idle_timeout: Annotated[
        float | UnsetType,
        var("CONNECTION_IDLE_TIMEOUT", WITH_UNIT, "ConnectionsConfig.idle_timeout"),
    ] = UNSET
    max_connection_age: Annotated[
        float | UnsetType, var("MAX_CONNECTION_AGE", WITH_UNIT, "ConnectionsConfig.max_age")
    ] = UNSET
    # None: DRAIN_GRACE
    max_connection_age_grace: Annotated[
        float | None, var("MAX_CONNECTION_AGE_GRACE", WITH_UNIT)
    ] = None
    # processes, metrics, logs
    workers: Annotated[int, var("WORKERS", ints(1, 256))] = 1
    worker_port_base: Annotated[int | None, var("WORKER_PORT_BASE", ints(1, 65535))] = None
    metrics_addr: Annotated[str | None, var("METRICS_ADDR", _local_addr)] = None
    metrics_token_sha256: Annotated[
        tuple[str, ...], var("METRICS_TOKEN_SHA256", _sha256_list, secret=True)
    ] = ()
    log_level: Annotated[str, var("LOG_LEVEL", _level)] = "info"

    def redacted(self) -> dict[str, Any]:
        """The set settings as a dict with secrets replaced, for `ibex config` and logs.

        Besides the table's secret fields, every URL-valued setting loses its
        userinfo and any password-like query parameter (`redis://:pw@host`,
        `?password=...`). An unset targeted field is left out (its value is the
        layer's default, which this module cannot see).
        """
        out: dict[str, Any] = {
            k: v for k, v in msgspec.structs.asdict(self).items() if v is not UNSET
        }
        for name, value in out.items():
            if not value:
                continue
            if name in SECRET_FIELDS:
                out[name] = "<redacted>" if isinstance(value, str) else ["<redacted>"] * len(value)
            elif isinstance(value, str) and "://" in value:
                out[name] = redact_url(value)
            elif isinstance(value, (tuple, list)):
                out[name] = [redact_url(v) if isinstance(v, str) else v for v in value]
        return out

    @property
    def redis_configured(self) -> bool:
        """Directives come from Redis (one endpoint, Sentinel or Cluster)."""
        return self.redis_url is not None or bool(self.redis_sentinels)

    def worker_port(self, index: int) -> int | None:
        """Worker `index`'s own port, WORKER_PORT_BASE + index (None when the base is unset).

        A worker process knows its slot but not the supervisor's worker count."""
        return None if self.worker_port_base is None else self.worker_port_base + index

    def worker_ports(self) -> tuple[int, ...]:
        """Every worker's own port (empty when the base is unset)."""
        ports = (self.worker_port(i) for i in range(self.workers))
        return tuple(p for p in ports if p is not None)

    def check_worker_ports(self) -> None:
        """ConfigError when the per-worker ports leave the port range or hit another port."""
        ports = self.worker_ports()
        if not ports:
            return
        name = PREFIX + "WORKER_PORT_BASE"
        if ports[-1] > 65535:
            raise ConfigError(f"{name}: {ports[0]} + {len(ports)} workers passes port 65535")
        taken = {"GRPC_ADDR": self.grpc_addr, "METRICS_ADDR": self.metrics_addr}
        for setting, addr in taken.items():
            port = split_host_port(addr)[1] if addr else None
            if port in ports:
                raise ConfigError(
                    f"{name}: worker ports {ports[0]}..{ports[-1]} include "
                    f"{PREFIX}{setting}'s port {port}"
                )


def _table() -> dict[str, Var]:
    hints = typing.get_type_hints(Settings, include_extras=True)
    defaults = {f.name: f.default for f in msgspec.structs.fields(Settings)}
    table: dict[str, Var] = {}
    for field in Settings.__struct_fields__:
        rows = [m for m in getattr(hints[field], "__metadata__", ()) if isinstance(m, Var)]
        if len(rows) != 1:
            raise TypeError(f"Settings.{field} needs exactly one Var")
        if bool(rows[0].to) != (defaults[field] is UNSET):
            raise TypeError(f"Settings.{field}: UNSET is the default of targeted fields only")
        table[field] = rows[0]
    return table


#: Settings field -> its row: the one table every reader of the settings uses.
TABLE: Mapping[str, Var] = _table()
SECRET_FIELDS = frozenset(field for field, row in TABLE.items() if row.secret)
#: The duration settings (values in seconds, shown with a unit by `ibex config`).
DURATIONS = frozenset(field for field, row in TABLE.items() if row.parse in (MS, WITH_UNIT))


def layer_fields(struct: str) -> dict[str, str]:
    """The fields of layer config `struct` (by class name) that settings set: field -> setting."""
    out: dict[str, str] = {}
    for setting, row in TABLE.items():
        for target in row.to:
            owner, _, field = target.partition(".")
            if owner == struct:
                out[field] = setting
    return out


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment, raising ConfigError on the first bad value.

    Each variable of the table is parsed by its row's parser (an empty value
    counts as unset); combinations are checked afterwards.
    """
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}
    for field, row in TABLE.items():
        raw = env.get(PREFIX + row.suffix)
        if raw is not None and raw.strip() != "":
            kw[field] = row.parse(PREFIX + row.suffix, raw)

    if bool(kw.get("tls_cert")) != bool(kw.get("tls_key")):
        raise ConfigError(f"{PREFIX}TLS_CERT and {PREFIX}TLS_KEY must be set together")
    if kw.get("tls_client_ca") and not kw.get("tls_cert"):
        raise ConfigError(f"{PREFIX}TLS_CLIENT_CA requires {PREFIX}TLS_CERT and {PREFIX}TLS_KEY")
    if kw.get("memory_base_url") and not kw.get("memory_api_token"):
        raise ConfigError(f"{PREFIX}MEMORY_API_TOKEN: required when {PREFIX}MEMORY_BASE_URL is set")
    _check_redis(kw)
    known = set(kw.get("auth_tokens_sha256", ()))
    for i, (digest, _) in enumerate(kw.get("auth_token_orgs", ()), 1):
        if digest not in known:
            raise ConfigError(
                f"{PREFIX}AUTH_TOKEN_ORGS: entry {i} binds a token hash that is not in "
                f"{PREFIX}AUTH_TOKENS_SHA256"
            )
    max_age = kw.get("nonce_max_age", NONCE_MAX_AGE_DEFAULT)
    if not NONCE_MAX_AGE_MIN <= max_age <= NONCE_MAX_AGE_MAX:
        raise ConfigError(
            f"{PREFIX}NONCE_MAX_AGE: must be between 1m and {NONCE_MAX_AGE_MAX / 3600:g}h, "
            f"got {format_duration(max_age)}"
        )
    settings = Settings(**kw)
    settings.check_worker_ports()
    return settings


def _check_redis(kw: Mapping[str, Any]) -> None:
    """Sentinel and Cluster settings that only make sense together."""
    sentinels, master = kw.get("redis_sentinels"), kw.get("redis_sentinel_master")
    if sentinels and not master:
        raise ConfigError(
            f"{PREFIX}REDIS_SENTINEL_MASTER: required when {PREFIX}REDIS_SENTINELS is set"
        )
    if (master or kw.get("redis_sentinel_password")) and not sentinels:
        raise ConfigError(
            f"{PREFIX}REDIS_SENTINELS: required with {PREFIX}REDIS_SENTINEL_MASTER/_PASSWORD"
        )
    url = kw.get("redis_url")
    if sentinels and url is not None and url.split("://", 1)[0].lower() == "unix":
        raise ConfigError(
            f"{PREFIX}REDIS_URL: with {PREFIX}REDIS_SENTINELS it gives the data nodes' "
            "password, db and TLS (redis:// or rediss://), not a unix socket"
        )
    if kw.get("redis_cluster"):
        if sentinels:
            raise ConfigError(
                f"{PREFIX}REDIS_CLUSTER: a cluster has no sentinels; unset {PREFIX}REDIS_SENTINELS"
            )
        if url is None or url.split("://", 1)[0].lower() not in ("redis", "rediss"):
            raise ConfigError(
                f"{PREFIX}REDIS_CLUSTER: needs {PREFIX}REDIS_URL naming a seed node "
                "(redis:// or rediss://)"
            )


def known_variables() -> frozenset[str]:
    """Every `IBEX_CONTEXT_*` name the daemon or the CLI reads."""
    return frozenset(PREFIX + s for s in (*EXTRA_KNOWN, *(row.suffix for row in TABLE.values())))


def unknown_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """`IBEX_CONTEXT_*` variables nothing reads (likely typos), each with the closest known name."""
    env = os.environ if env is None else env
    known = known_variables()
    out: list[tuple[str, str | None]] = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            out.append((name, close[0] if close else None))
    return out
