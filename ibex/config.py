"""Settings from IBEX_CONTEXT_* environment variables, validated once at start-up.

Every error names the variable so an operator can fix the unit file without
reading code; secret values are never echoed back.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import msgspec

from ibex.errors import ConfigError

__all__ = [
    "PREFIX",
    "ConfigError",
    "Settings",
    "known_variables",
    "load_settings",
    "parse_duration",
    "redact_url",
    "unknown_variables",
]

PREFIX = "IBEX_CONTEXT_"
SECRET_FIELDS = frozenset(
    {
        "memory_api_token",
        "auth_tokens_sha256",
        "redis_sentinel_password",
        "nonce_key",
        "metrics_token_sha256",
    }
)
#: IBEX_CONTEXT_NONCE_KEY's least length (= ibex.assembly.nonce.MIN_KEY_CHARS).
NONCE_KEY_MIN_CHARS = 32
# Variables read outside `load_settings` (the CLI client's token).
EXTRA_KNOWN = frozenset({"CLIENT_TOKEN"})
# Query parameters of a URL that carry a secret (redis-py reads `password`).
_SECRET_QUERY = re.compile(r"pass|secret|token|key|auth", re.IGNORECASE)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s)?\s*$")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Effective configuration. Durations are seconds (floats)."""

    timeout: float = 0.045
    deadline: float = 0.040
    directive_timeout: float = 0.005
    hot_timeout: float = 0.015
    cold_timeout: float = 0.045
    pipeline_headroom: float = 0.010
    min_answer: float = 0.002
    min_useful: float = 0.020
    queue_target: float = 0.005
    queue_interval: float = 0.100
    request_read_timeout: float = 5.0
    memory_base_url: str | None = None
    memory_api_token: str | None = None
    memory_pool_size: int = 32
    memory_max_content_bytes: int = 32 * 1024
    memory_max_response_bytes: int = 4 * 1024 * 1024
    hot_limit: int = 20
    cold_limit: int = 20
    min_confidence: float = 0.0
    redis_url: str | None = None
    directive_cache_entries: int = 10_000
    directive_cache_bytes: int = 16 * 1024 * 1024
    directive_cache_ttl: float = 1.0
    directive_cache_max_age: float = 2.0
    redis_sentinels: tuple[str, ...] = ()
    redis_sentinel_master: str | None = None
    redis_sentinel_password: str | None = None
    redis_cluster: bool = False
    local_source_path: str | None = None
    grpc_addr: str = "127.0.0.1:9092"
    packer_dp_cell_ceiling: int = 70 * 6251
    packer_max_consecutive_skips: int = 5
    formatter_nonce_bytes: int = 16
    nonce_key: str | None = None
    catalog_path: str | None = None
    tiktoken_dir: str | None = None
    token_cache_entries: int = 65536
    token_cache_bytes: int = 32 * 1024 * 1024
    auth_tokens_sha256: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_allowed_sans: tuple[str, ...] = ()
    allow_insecure: bool = False
    max_in_flight: int = 256
    max_in_flight_bytes: int = 64 * 1024 * 1024
    max_concurrent_assemblies: int = 16
    max_org_assemblies: int | None = None  # None: half of MAX_CONCURRENT_ASSEMBLIES
    max_queue_wait: float = 1.0
    max_message_bytes: int = 4 * 1024 * 1024
    max_history_messages: int = 512
    max_text_bytes: int = 1024 * 1024
    max_tool_schemas: int = 128
    drain_grace: float = 10.0
    max_connections: int | None = None  # None: min(1024, RLIMIT_NOFILE soft - 64) at start-up
    max_connections_per_peer: int | None = None  # None: MAX_CONNECTIONS // 4, at least 1
    connection_auth_timeout: float = 10.0
    tls_handshake_timeout: float = 5.0
    connection_idle_timeout: float = 300.0
    max_connection_age: float | None = None
    max_connection_age_grace: float | None = None  # None: DRAIN_GRACE
    workers: int = 1
    worker_port_base: int | None = None
    metrics_addr: str | None = None
    metrics_token_sha256: tuple[str, ...] = ()
    log_level: str = "info"

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with secrets replaced, for `ibex config` and logs.

        Besides the secret fields, every URL-valued setting loses its userinfo
        and any password-like query parameter (`redis://:pw@host`,
        `?password=...`).
        """
        out: dict[str, Any] = msgspec.structs.asdict(self)
        for name, value in out.items():
            if not value:
                continue
            if name in SECRET_FIELDS or "password" in name or name.endswith("_token"):
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

    def worker_ports(self) -> tuple[int, ...]:
        """Worker i's own port, WORKER_PORT_BASE + i (empty when the base is unset)."""
        if self.worker_port_base is None:
            return ()
        return tuple(self.worker_port_base + i for i in range(self.workers))

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
            port = int(addr.rpartition(":")[2]) if addr else None
            if port in ports:
                raise ConfigError(
                    f"{name}: worker ports {ports[0]}..{ports[-1]} include "
                    f"{PREFIX}{setting}'s port {port}"
                )

    @property
    def wall(self) -> float:
        """The server-side retrieval wall: min(TIMEOUT, DEADLINE_MS)."""
        return min(self.timeout, self.deadline)


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


def parse_duration(name: str, raw: str, *, bare_unit: str = "ms") -> float:
    """`45`, `45ms` or `0.2s` to seconds; non-finite, zero or negative is an error."""
    m = _DURATION.match(raw)
    if not m:
        raise ConfigError(f"{name}: expected a duration like 45, 45ms or 0.2s, got {raw!r}")
    value = float(m.group(1))
    unit = m.group(2) or bare_unit
    seconds = value / 1000.0 if unit == "ms" else value
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}: duration must be finite and > 0, got {raw!r}")
    return seconds


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


_SAN_PREFIX = re.compile(r"^(dns|uri|email|ip):(.+)$", re.IGNORECASE | re.DOTALL)


def _sans(name: str, raw: str) -> tuple[str, ...]:
    """`DNS:name`, `URI:...`, `email:...`, `IP:addr` or a bare DNS name, comma-separated."""
    entries = _list(raw)
    for entry in entries:
        m = _SAN_PREFIX.match(entry)
        if m is None and ":" in entry:
            raise ConfigError(
                f"{name}: {entry!r}: prefix the type (DNS:, URI:, email: or IP:); "
                "a bare entry is a DNS name"
            )
        if m is not None and m.group(1).lower() == "ip":
            try:
                ipaddress.ip_address(m.group(2).strip())
            except ValueError:
                raise ConfigError(f"{name}: {entry!r} is not an IP address") from None
    return entries


def _url(name: str, raw: str, schemes: tuple[str, ...]) -> str:
    value = raw.strip()
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    if scheme not in schemes:
        raise ConfigError(f"{name}: expected a URL with scheme {'/'.join(schemes)}")
    return value


def _addr(name: str, raw: str) -> str:
    value = raw.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: expected host:port, got {raw!r}")
    return value


def _file(name: str, raw: str) -> str:
    value = raw.strip()
    if not os.path.exists(value):
        raise ConfigError(f"{name}: no such file or directory: {value!r}")
    return value


def _sha256_list(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated SHA-256 hex digests (several: rotation), lower-cased."""
    hashes = tuple(h.lower() for h in _list(raw))
    for h in hashes:
        if not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ConfigError(f"{name}: each entry must be 64 hex digits (a SHA-256)")
    return hashes


_LEVELS = ("debug", "info", "warning", "error")


def load_settings(
    env: Mapping[str, str] | None = None, *, _read: set[str] | None = None
) -> Settings:
    """Build Settings from the environment, raising ConfigError on the first bad value.

    Every variable is read through `get`, which registers its name: that
    register is the table of known settings (`known_variables`), so a setting
    added here is known to the typo check without a second list. Call `get`
    unconditionally for each variable (validate combinations afterwards).
    """
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}

    def get(suffix: str) -> str | None:
        if _read is not None:
            _read.add(suffix)
        value = env.get(PREFIX + suffix)
        return None if value is None or value.strip() == "" else value

    durations = {
        "TIMEOUT": "timeout",
        "DEADLINE_MS": "deadline",
        "DIRECTIVE_TIMEOUT_MS": "directive_timeout",
        "HOT_TIMEOUT_MS": "hot_timeout",
        "COLD_TIMEOUT_MS": "cold_timeout",
        "PIPELINE_HEADROOM_MS": "pipeline_headroom",
        "MIN_ANSWER_MS": "min_answer",
        "MIN_USEFUL_MS": "min_useful",
        "QUEUE_TARGET_MS": "queue_target",
        "QUEUE_INTERVAL_MS": "queue_interval",
    }
    for suffix, field in durations.items():
        if (raw := get(suffix)) is not None:
            kw[field] = parse_duration(PREFIX + suffix, raw)
    for suffix, field in {
        "DRAIN_GRACE": "drain_grace",
        "REQUEST_READ_TIMEOUT": "request_read_timeout",
        "DIRECTIVE_CACHE_TTL": "directive_cache_ttl",
        "DIRECTIVE_CACHE_MAX_AGE": "directive_cache_max_age",
        "CONNECTION_IDLE_TIMEOUT": "connection_idle_timeout",
        "CONNECTION_AUTH_TIMEOUT": "connection_auth_timeout",
        "TLS_HANDSHAKE_TIMEOUT": "tls_handshake_timeout",
        "MAX_CONNECTION_AGE": "max_connection_age",
        "MAX_CONNECTION_AGE_GRACE": "max_connection_age_grace",
        "MAX_QUEUE_WAIT": "max_queue_wait",
    }.items():
        if (raw := get(suffix)) is not None:
            kw[field] = parse_duration(PREFIX + suffix, raw, bare_unit="s")

    ints = {
        "PACKER_DP_CELL_CEILING": ("packer_dp_cell_ceiling", 1, 50_000_000),
        "PACKER_MAX_CONSECUTIVE_SKIPS": ("packer_max_consecutive_skips", 0, 1_000_000),
        "FORMATTER_NONCE_BYTES": ("formatter_nonce_bytes", 8, 64),
        "MEMORY_POOL_SIZE": ("memory_pool_size", 1, 4096),
        "MEMORY_MAX_CONTENT_BYTES": ("memory_max_content_bytes", 1, 64 * 1024 * 1024),
        "MEMORY_MAX_RESPONSE_BYTES": ("memory_max_response_bytes", 1024, 1024 * 1024 * 1024),
        "HOT_LIMIT": ("hot_limit", 1, 100),
        "COLD_LIMIT": ("cold_limit", 1, 100),
        "TOKEN_CACHE_ENTRIES": ("token_cache_entries", 0, 10_000_000),
        "TOKEN_CACHE_BYTES": ("token_cache_bytes", 0, 4 * 1024 * 1024 * 1024),
        "MAX_IN_FLIGHT": ("max_in_flight", 1, 100_000),
        "MAX_IN_FLIGHT_BYTES": ("max_in_flight_bytes", 1024, 64 * 1024 * 1024 * 1024),
        "MAX_CONCURRENT_ASSEMBLIES": ("max_concurrent_assemblies", 1, 100_000),
        "MAX_ORG_ASSEMBLIES": ("max_org_assemblies", 1, 100_000),
        "DIRECTIVE_CACHE_ENTRIES": ("directive_cache_entries", 0, 10_000_000),
        "DIRECTIVE_CACHE_BYTES": ("directive_cache_bytes", 0, 4 * 1024 * 1024 * 1024),
        "MAX_MESSAGE_BYTES": ("max_message_bytes", 1024, 256 * 1024 * 1024),
        "MAX_HISTORY_MESSAGES": ("max_history_messages", 0, 100_000),
        "MAX_TEXT_BYTES": ("max_text_bytes", 1, 64 * 1024 * 1024),
        "MAX_TOOL_SCHEMAS": ("max_tool_schemas", 0, 10_000),
        "WORKERS": ("workers", 1, 256),
        "MAX_CONNECTIONS": ("max_connections", 1, 1_000_000),
        "MAX_CONNECTIONS_PER_PEER": ("max_connections_per_peer", 1, 1_000_000),
        "WORKER_PORT_BASE": ("worker_port_base", 1, 65535),
    }
    for suffix, (field, lo, hi) in ints.items():
        if (raw := get(suffix)) is not None:
            kw[field] = _int(PREFIX + suffix, raw, lo, hi)

    if (raw := get("MIN_CONFIDENCE")) is not None:
        kw["min_confidence"] = _float(PREFIX + "MIN_CONFIDENCE", raw, 0.0, 1.0)
    if (raw := get("MEMORY_BASE_URL")) is not None:
        kw["memory_base_url"] = _url(PREFIX + "MEMORY_BASE_URL", raw, ("http", "https")).rstrip("/")
    if (raw := get("MEMORY_API_TOKEN")) is not None:
        kw["memory_api_token"] = raw.strip()
    if (raw := get("NONCE_KEY")) is not None and raw.strip():
        if len(raw.strip()) < NONCE_KEY_MIN_CHARS:
            raise ConfigError(
                f"{PREFIX}NONCE_KEY: must be at least {NONCE_KEY_MIN_CHARS} characters "
                "(a random secret shared by every replica)"
            )
        kw["nonce_key"] = raw.strip()
    if (raw := get("REDIS_URL")) is not None:
        kw["redis_url"] = _url(PREFIX + "REDIS_URL", raw, ("redis", "rediss", "unix"))
    if (raw := get("REDIS_SENTINELS")) is not None:
        kw["redis_sentinels"] = tuple(_addr(PREFIX + "REDIS_SENTINELS", a) for a in _list(raw))
    if (raw := get("REDIS_SENTINEL_MASTER")) is not None:
        kw["redis_sentinel_master"] = raw.strip()
    if (raw := get("REDIS_SENTINEL_PASSWORD")) is not None:
        kw["redis_sentinel_password"] = raw.strip()
    if (raw := get("REDIS_CLUSTER")) is not None:
        kw["redis_cluster"] = _bool(PREFIX + "REDIS_CLUSTER", raw)
    if (raw := get("LOCAL_SOURCE_PATH")) is not None:
        kw["local_source_path"] = _file(PREFIX + "LOCAL_SOURCE_PATH", raw)
    if (raw := get("GRPC_ADDR")) is not None:
        kw["grpc_addr"] = _addr(PREFIX + "GRPC_ADDR", raw)
    if (raw := get("METRICS_ADDR")) is not None:
        # A bare port binds loopback: the endpoint is for a local scraper unless a
        # host is named (which, off loopback, needs METRICS_TOKEN_SHA256).
        bare = raw.strip()
        kw["metrics_addr"] = _addr(
            PREFIX + "METRICS_ADDR", f"127.0.0.1:{bare}" if bare.isdigit() else raw
        )
    if (raw := get("METRICS_TOKEN_SHA256")) is not None:
        kw["metrics_token_sha256"] = _sha256_list(PREFIX + "METRICS_TOKEN_SHA256", raw)
    for suffix, field in {
        "CATALOG_PATH": "catalog_path",
        "TIKTOKEN_DIR": "tiktoken_dir",
        "TLS_CERT": "tls_cert",
        "TLS_KEY": "tls_key",
        "TLS_CLIENT_CA": "tls_client_ca",
    }.items():
        if (raw := get(suffix)) is not None:
            kw[field] = _file(PREFIX + suffix, raw)
    if (raw := get("AUTH_TOKENS_SHA256")) is not None:
        hashes = tuple(h.lower() for h in _list(raw))
        for h in hashes:
            if not re.fullmatch(r"[0-9a-f]{64}", h):
                raise ConfigError(
                    f"{PREFIX}AUTH_TOKENS_SHA256: each entry must be 64 hex digits (a SHA-256)"
                )
        kw["auth_tokens_sha256"] = hashes
    if (raw := get("TLS_ALLOWED_SANS")) is not None:
        kw["tls_allowed_sans"] = _sans(PREFIX + "TLS_ALLOWED_SANS", raw)
    if (raw := get("ALLOW_INSECURE")) is not None:
        kw["allow_insecure"] = _bool(PREFIX + "ALLOW_INSECURE", raw)
    if (raw := get("LOG_LEVEL")) is not None:
        level = raw.strip().lower()
        if level not in _LEVELS:
            raise ConfigError(f"{PREFIX}LOG_LEVEL: expected one of {', '.join(_LEVELS)}")
        kw["log_level"] = level

    if bool(kw.get("tls_cert")) != bool(kw.get("tls_key")):
        raise ConfigError(f"{PREFIX}TLS_CERT and {PREFIX}TLS_KEY must be set together")
    if kw.get("tls_client_ca") and not kw.get("tls_cert"):
        raise ConfigError(f"{PREFIX}TLS_CLIENT_CA requires {PREFIX}TLS_CERT and {PREFIX}TLS_KEY")
    if kw.get("memory_base_url") and not kw.get("memory_api_token"):
        raise ConfigError(f"{PREFIX}MEMORY_API_TOKEN: required when {PREFIX}MEMORY_BASE_URL is set")
    _check_redis(kw)
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


def known_variables(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """Every `IBEX_CONTEXT_*` name the daemon or the CLI reads."""
    read: set[str] = set(EXTRA_KNOWN)
    for probe in ({}, os.environ if env is None else env):
        # The names read before a bad value still count; the bad value is reported elsewhere.
        with contextlib.suppress(ConfigError):
            load_settings(probe, _read=read)
    return frozenset(PREFIX + suffix for suffix in read)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """`IBEX_CONTEXT_*` variables nothing reads (likely typos), each with the closest known name."""
    env = os.environ if env is None else env
    known = known_variables(env)
    out: list[tuple[str, str | None]] = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            out.append((name, close[0] if close else None))
    return out
