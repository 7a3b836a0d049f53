"""Checks across settings: values each valid alone that do not make sense together.

`check_combinations` runs on the parsed values of the process's own settings
before `Settings` is built (TLS files in pairs, the memory token with its URL,
the Redis topology, token-org bindings, the session nonce's lifetime);
`check_worker_ports` on the built settings (the CLI runs it again after
`--workers` overrides the count). Every message names the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ibex.assembly.nonce import DEFAULT_MAX_AGE, MAX_MAX_AGE, MIN_MAX_AGE
from ibex.config.values import format_duration
from ibex.envvar import PREFIX
from ibex.errors import ConfigError
from ibex.netaddr import split_host_port

if TYPE_CHECKING:
    from ibex.config.settings import Settings

__all__ = ["check_combinations", "check_worker_ports"]


def check_combinations(kw: Mapping[str, Any]) -> None:
    """ConfigError for the first combination of own settings (field -> value, the set
    ones only) that cannot work."""
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
    max_age = kw.get("nonce_max_age", DEFAULT_MAX_AGE)
    if not MIN_MAX_AGE <= max_age <= MAX_MAX_AGE:
        raise ConfigError(
            f"{PREFIX}NONCE_MAX_AGE: must be between 1m and {MAX_MAX_AGE / 3600:g}h, "
            f"got {format_duration(max_age)}"
        )


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


def check_worker_ports(settings: Settings) -> None:
    """ConfigError when the per-worker ports leave the port range or hit another port."""
    ports = settings.worker_ports()
    if not ports:
        return
    name = PREFIX + "WORKER_PORT_BASE"
    if ports[-1] > 65535:
        raise ConfigError(f"{name}: {ports[0]} + {len(ports)} workers passes port 65535")
    taken = {"GRPC_ADDR": settings.grpc_addr, "METRICS_ADDR": settings.metrics_addr}
    for setting, addr in taken.items():
        port = split_host_port(addr)[1] if addr else None
        if port in ports:
            raise ConfigError(
                f"{name}: worker ports {ports[0]}..{ports[-1]} include "
                f"{PREFIX}{setting}'s port {port}"
            )
