"""`Settings`: each layer's config struct, and the settings of the process itself.

A setting that feeds a layer is declared on that layer's config field
(`ibex.envvar.env`, beside its default), and `Settings` holds the built
struct (`settings.retrieval.cold_timeout`). A setting no layer struct holds
(addresses, TLS files, the Redis topology, log level, and the defaults the
composition root computes from other values) is declared here, once, as a
field of `Settings` with its parser. `ibex.config.table` walks both into the
one table of variables.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ibex.assembly.nonce import DEFAULT_MAX_AGE, MIN_KEY_CHARS
from ibex.assembly.pipeline_config import PipelineConfig
from ibex.assembly.tokens import TokenCacheConfig
from ibex.assembly.validation import RequestLimits
from ibex.config import values as v
from ibex.config.checks import check_worker_ports
from ibex.envvar import declared, env
from ibex.service.admission_config import AdmissionConfig
from ibex.service.daemon_config import DaemonConfig
from ibex.service.edge.connections_config import ConnectionsConfig
from ibex.service.handlers_config import EdgeConfig
from ibex.sources.directive_cache_config import DirectiveCacheConfig
from ibex.sources.memory_config import MemoryServiceConfig
from ibex.sources.retrieval_config import RetrievalConfig

__all__ = ["Settings"]

_SECONDS = "s"
_COUNTS = (1, 1_000_000)


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Configuration: each layer's config (a struct field) and the process's own settings
    (one field per variable, declared here). Durations are seconds (floats).

    A field whose default is None and whose variable is unset is computed by the
    composition root (`ibex.service.root`) from other values.
    """

    retrieval: RetrievalConfig = RetrievalConfig()
    # memory service
    memory_base_url: Annotated[
        str | None, env("IBEX_CONTEXT_MEMORY_BASE_URL", parse=v.http_url)
    ] = None
    memory_api_token: Annotated[
        str | None, env("IBEX_CONTEXT_MEMORY_API_TOKEN", parse=v.text, secret=True)
    ] = None
    memory: MemoryServiceConfig = MemoryServiceConfig()
    # directives: Redis and the cache in front of it
    redis_url: Annotated[
        str | None, env("IBEX_CONTEXT_REDIS_URL", parse=v.urls("redis", "rediss", "unix"))
    ] = None
    directive_cache: DirectiveCacheConfig = DirectiveCacheConfig()
    redis_sentinels: Annotated[
        tuple[str, ...], env("IBEX_CONTEXT_REDIS_SENTINELS", parse=v.addrs)
    ] = ()
    redis_sentinel_master: Annotated[
        str | None, env("IBEX_CONTEXT_REDIS_SENTINEL_MASTER", parse=v.text)
    ] = None
    redis_sentinel_password: Annotated[
        str | None, env("IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD", parse=v.text, secret=True)
    ] = None
    redis_cluster: Annotated[bool, env("IBEX_CONTEXT_REDIS_CLUSTER")] = False
    local_source_path: Annotated[
        str | None, env("IBEX_CONTEXT_LOCAL_SOURCE_PATH", parse=v.file)
    ] = None
    # the pure core
    pipeline: PipelineConfig = PipelineConfig()
    nonce_key: Annotated[
        str | None,
        env("IBEX_CONTEXT_NONCE_KEY", parse=v.nonce_key(MIN_KEY_CHARS), secret=True),
    ] = None
    # A session nonce's lifetime; its bounds are ibex.assembly.nonce's (checked at load).
    nonce_max_age: Annotated[float, env("IBEX_CONTEXT_NONCE_MAX_AGE", unit=_SECONDS)] = (
        DEFAULT_MAX_AGE
    )
    catalog_path: Annotated[str | None, env("IBEX_CONTEXT_CATALOG_PATH", parse=v.file)] = None
    tiktoken_dir: Annotated[str | None, env("IBEX_CONTEXT_TIKTOKEN_DIR", parse=v.file)] = None
    token_cache: TokenCacheConfig = TokenCacheConfig()
    # request bounds
    limits: RequestLimits = RequestLimits()
    edge: EdgeConfig = EdgeConfig()
    # listening, callers, TLS
    grpc_addr: Annotated[str, env("IBEX_CONTEXT_GRPC_ADDR", parse=v.addr)] = "127.0.0.1:9092"
    auth_tokens_sha256: Annotated[
        tuple[str, ...], env("IBEX_CONTEXT_AUTH_TOKENS_SHA256", parse=v.sha256_list, secret=True)
    ] = ()
    # Tokens bound to orgs; a token not listed acts for any org (checked at load).
    auth_token_orgs: Annotated[
        v.TokenOrgs, env("IBEX_CONTEXT_AUTH_TOKEN_ORGS", parse=v.token_orgs, secret=True)
    ] = ()
    require_principal: Annotated[bool, env("IBEX_CONTEXT_REQUIRE_PRINCIPAL")] = False
    tls_cert: Annotated[str | None, env("IBEX_CONTEXT_TLS_CERT", parse=v.file)] = None
    tls_key: Annotated[str | None, env("IBEX_CONTEXT_TLS_KEY", parse=v.file)] = None
    tls_client_ca: Annotated[str | None, env("IBEX_CONTEXT_TLS_CLIENT_CA", parse=v.file)] = None
    tls_allowed_sans: Annotated[
        tuple[str, ...], env("IBEX_CONTEXT_TLS_ALLOWED_SANS", parse=v.sans)
    ] = ()
    allow_insecure: Annotated[bool, env("IBEX_CONTEXT_ALLOW_INSECURE")] = False
    # admission
    admission: AdmissionConfig = AdmissionConfig()
    # None: a quarter of MAX_IN_FLIGHT_BYTES
    max_caller_in_flight_bytes: Annotated[
        int | None, env("IBEX_CONTEXT_MAX_CALLER_IN_FLIGHT_BYTES", bounds=(1024, 64 * 1024**3))
    ] = None
    # None: half of MAX_CONCURRENT_ASSEMBLIES
    max_org_assemblies: Annotated[
        int | None, env("IBEX_CONTEXT_MAX_ORG_ASSEMBLIES", bounds=(1, 100_000))
    ] = None
    # connections and draining
    daemon: DaemonConfig = DaemonConfig()
    connections: ConnectionsConfig = ConnectionsConfig()
    # None: min(1024, RLIMIT_NOFILE soft - 64) at start-up
    max_connections: Annotated[int | None, env("IBEX_CONTEXT_MAX_CONNECTIONS", bounds=_COUNTS)] = (
        None
    )
    # None: MAX_CONNECTIONS // 4, at least 1
    max_connections_per_peer: Annotated[
        int | None, env("IBEX_CONTEXT_MAX_CONNECTIONS_PER_PEER", bounds=_COUNTS)
    ] = None
    # None: DRAIN_GRACE
    max_connection_age_grace: Annotated[
        float | None, env("IBEX_CONTEXT_MAX_CONNECTION_AGE_GRACE", unit=_SECONDS)
    ] = None
    # processes, metrics, logs
    workers: Annotated[int, env("IBEX_CONTEXT_WORKERS", bounds=(1, 256))] = 1
    worker_port_base: Annotated[
        int | None, env("IBEX_CONTEXT_WORKER_PORT_BASE", bounds=(1, 65535))
    ] = None
    metrics_addr: Annotated[str | None, env("IBEX_CONTEXT_METRICS_ADDR", parse=v.local_addr)] = None
    metrics_token_sha256: Annotated[
        tuple[str, ...],
        env("IBEX_CONTEXT_METRICS_TOKEN_SHA256", parse=v.sha256_list, secret=True),
    ] = ()
    log_level: Annotated[
        str, env("IBEX_CONTEXT_LOG_LEVEL", parse=v.choice("debug", "info", "warning", "error"))
    ] = "info"

    def redacted(self) -> dict[str, Any]:
        """The process's own settings as a dict with secrets replaced, for logs.

        Besides the declared secrets, every URL-valued setting loses its userinfo
        and any password-like query parameter (`redis://:pw@host`, `?password=...`).
        The layer structs hold no secret and are left out.
        """
        out: dict[str, Any] = {}
        for d in declared(type(self)):
            value = getattr(self, d.field)
            if value and d.secret:
                value = "<redacted>" if isinstance(value, str) else ["<redacted>"] * len(value)
            elif value and isinstance(value, str) and "://" in value:
                value = v.redact_url(value)
            elif value and isinstance(value, tuple):
                value = [v.redact_url(x) if isinstance(x, str) else x for x in value]
            out[d.field] = value
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
        check_worker_ports(self)
