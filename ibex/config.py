"""Settings from IBEX_CONTEXT_* environment variables, validated once at start-up.

Every error names the variable so an operator can fix the unit file without
reading code; secret values are never echoed back.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from ibex.errors import ConfigError

__all__ = ["PREFIX", "ConfigError", "Settings", "load_settings", "parse_duration"]

PREFIX = "IBEX_CONTEXT_"
SECRET_FIELDS = frozenset({"memory_api_token", "auth_tokens_sha256"})
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s)?\s*$")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Effective configuration. Durations are seconds (floats)."""

    timeout: float = 0.045
    deadline: float = 0.040
    directive_timeout: float = 0.005
    hot_timeout: float = 0.015
    cold_timeout: float = 0.045
    pipeline_headroom: float = 0.010
    shed_remaining: float = 0.010
    shed_lag: float = 0.004
    memory_base_url: str | None = None
    memory_api_token: str | None = None
    memory_pool_size: int = 32
    hot_limit: int = 20
    cold_limit: int = 20
    min_confidence: float = 0.0
    redis_url: str | None = None
    local_source_path: str | None = None
    grpc_addr: str = "127.0.0.1:9092"
    packer_dp_cell_ceiling: int = 70 * 6251
    packer_max_consecutive_skips: int = 5
    formatter_nonce_bytes: int = 16
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
    max_in_flight: int = 64
    max_message_bytes: int = 4 * 1024 * 1024
    max_history_messages: int = 512
    max_text_bytes: int = 1024 * 1024
    max_tool_schemas: int = 128
    drain_grace: float = 10.0
    workers: int = 1
    metrics_addr: str | None = None
    log_level: str = "info"

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with secrets replaced, for `ibex config` and logs."""
        out: dict[str, Any] = msgspec.structs.asdict(self)
        for name in SECRET_FIELDS:
            value = out.get(name)
            if value:
                out[name] = "<redacted>" if isinstance(value, str) else ["<redacted>"] * len(value)
        return out

    @property
    def wall(self) -> float:
        """The server-side retrieval wall: min(TIMEOUT, DEADLINE_MS)."""
        return min(self.timeout, self.deadline)


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


_LEVELS = ("debug", "info", "warning", "error")


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment, raising ConfigError on the first bad value."""
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}

    def get(suffix: str) -> str | None:
        value = env.get(PREFIX + suffix)
        return None if value is None or value.strip() == "" else value

    durations = {
        "TIMEOUT": "timeout",
        "DEADLINE_MS": "deadline",
        "DIRECTIVE_TIMEOUT_MS": "directive_timeout",
        "HOT_TIMEOUT_MS": "hot_timeout",
        "COLD_TIMEOUT_MS": "cold_timeout",
        "PIPELINE_HEADROOM_MS": "pipeline_headroom",
        "SHED_REMAINING_MS": "shed_remaining",
        "SHED_LAG_MS": "shed_lag",
    }
    for suffix, field in durations.items():
        if (raw := get(suffix)) is not None:
            kw[field] = parse_duration(PREFIX + suffix, raw)
    if (raw := get("DRAIN_GRACE")) is not None:
        kw["drain_grace"] = parse_duration(PREFIX + "DRAIN_GRACE", raw, bare_unit="s")

    ints = {
        "PACKER_DP_CELL_CEILING": ("packer_dp_cell_ceiling", 1, 50_000_000),
        "PACKER_MAX_CONSECUTIVE_SKIPS": ("packer_max_consecutive_skips", 0, 1_000_000),
        "FORMATTER_NONCE_BYTES": ("formatter_nonce_bytes", 8, 64),
        "MEMORY_POOL_SIZE": ("memory_pool_size", 1, 4096),
        "HOT_LIMIT": ("hot_limit", 1, 100),
        "COLD_LIMIT": ("cold_limit", 1, 100),
        "TOKEN_CACHE_ENTRIES": ("token_cache_entries", 0, 10_000_000),
        "TOKEN_CACHE_BYTES": ("token_cache_bytes", 0, 4 * 1024 * 1024 * 1024),
        "MAX_IN_FLIGHT": ("max_in_flight", 1, 100_000),
        "MAX_MESSAGE_BYTES": ("max_message_bytes", 1024, 256 * 1024 * 1024),
        "MAX_HISTORY_MESSAGES": ("max_history_messages", 0, 100_000),
        "MAX_TEXT_BYTES": ("max_text_bytes", 1, 64 * 1024 * 1024),
        "MAX_TOOL_SCHEMAS": ("max_tool_schemas", 0, 10_000),
        "WORKERS": ("workers", 1, 256),
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
    if (raw := get("REDIS_URL")) is not None:
        kw["redis_url"] = _url(PREFIX + "REDIS_URL", raw, ("redis", "rediss", "unix"))
    if (raw := get("LOCAL_SOURCE_PATH")) is not None:
        kw["local_source_path"] = _file(PREFIX + "LOCAL_SOURCE_PATH", raw)
    if (raw := get("GRPC_ADDR")) is not None:
        kw["grpc_addr"] = _addr(PREFIX + "GRPC_ADDR", raw)
    if (raw := get("METRICS_ADDR")) is not None:
        kw["metrics_addr"] = _addr(PREFIX + "METRICS_ADDR", raw)
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
        kw["tls_allowed_sans"] = _list(raw)
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
    return Settings(**kw)
