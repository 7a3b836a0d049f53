"""The composition root: every part of a serving process, built from `Settings`.

This module, the CLI and the worker supervisor are the only readers of
`Settings`. Each layer gets a small frozen config of its own (retrieval
limits, request limits, pipeline knobs, admission, the edge), so no layer
sees a secret it does not need. `layer_config` fills each one from the
settings table (`ibex.config.Settings`, whose rows name the layer fields they
set), passing only the settings that are set, so each struct's own field
default is the one default; `effective_settings` reads those defaults back for
`ibex config`. The few values derived from others are computed here by hand,
from the built structs. `config_warnings` names the settings that make the
daemon serve less than it could (said at start and by `ibex check`), and
`listen_problems` tries the addresses it will listen on (for `ibex check`).

`open_assembler(settings)` builds the sources the settings name (Redis for
directives, the memory service over HTTP, or the bundled local sample when
neither is configured) and closes them on exit. It must run inside
`trio_asyncio.open_loop()` whenever Redis is configured, because redis-py is
asyncio and is crossed into Trio with trio-asyncio.
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import msgspec
import trio

from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.nonce import NonceKey
from ibex.assembly.pipeline import PipelineConfig
from ibex.assembly.tokens import TokenizerError, Tokenizers
from ibex.assembly.validation import RequestLimits
from ibex.config import (
    DURATIONS,
    PREFIX,
    TABLE,
    UNSET,
    Settings,
    format_duration,
    layer_fields,
    redact_url,
)
from ibex.errors import ConfigError, ConfigFileError
from ibex.netaddr import bind_problem, join_host_port, split_host_port
from ibex.ops import handover
from ibex.ops.metrics import Metrics
from ibex.ops.tracing import setup_tracing
from ibex.service.admission import AdmissionConfig
from ibex.service.assembler import Assembler
from ibex.service.auth import Authenticator, is_loopback
from ibex.service.daemon import Daemon, DaemonConfig
from ibex.service.dependencies import Dependency, prime_directives
from ibex.service.edge.connections import ConnectionsConfig, default_max_connections
from ibex.service.handlers import EdgeConfig
from ibex.sources.base import DirectiveSource, MemorySource
from ibex.sources.directive_cache import DirectiveCache, DirectiveCacheConfig
from ibex.sources.feedback_sender import FeedbackSink
from ibex.sources.local_file import LocalFileSource
from ibex.sources.memory_http import MemoryHttpSource
from ibex.sources.redis_directive import RedisDirectiveSource
from ibex.sources.retrieval import RetrievalConfig

__all__ = [
    "LAYERS",
    "Assembler",
    "admission_config",
    "check_bind_policy",
    "config_warnings",
    "connections_config",
    "drain_grace",
    "effective_settings",
    "layer_config",
    "layer_defaults",
    "listen_problems",
    "listen_variable",
    "load_static",
    "make_daemon",
    "open_assembler",
    "server_ssl_context",
]


T = TypeVar("T", bound=msgspec.Struct)

#: The layer config structs the settings table targets (`Var.to`), by class name.
LAYERS: dict[str, type[msgspec.Struct]] = {
    c.__name__: c
    for c in (
        RetrievalConfig,
        RequestLimits,
        PipelineConfig,
        AdmissionConfig,
        EdgeConfig,
        DirectiveCacheConfig,
        ConnectionsConfig,
        DaemonConfig,
    )
}


def layer_config(struct: type[T], settings: Settings, **computed: Any) -> T:
    """`struct` with every field the settings table targets (`Var.to`) taken from `settings`
    when set (an unset one keeps the struct's default); `computed` gives the fields whose
    value the root derives (a default from another value)."""
    fields = {
        f: value
        for f, s in layer_fields(struct.__name__).items()
        if (value := getattr(settings, s)) is not UNSET
    }
    return struct(**fields, **computed)


def layer_defaults() -> dict[str, Any]:
    """Each targeted setting -> the default of the layer field it sets (the one place the
    default is written). KeyError/TypeError name a target that is not a defaulted field."""
    out: dict[str, Any] = {}
    for setting, row in TABLE.items():
        for target in row.to:
            struct, _, name = target.partition(".")
            field = {f.name: f for f in msgspec.structs.fields(LAYERS[struct])}[name]
            if field.default is msgspec.NODEFAULT:
                raise TypeError(f"{target} (set by {setting}) has no default")
            if out.setdefault(setting, field.default) != field.default:
                raise TypeError(f"{setting}'s targets disagree on the default")
    return out


def effective_settings(settings: Settings) -> dict[str, Any]:
    """Every variable -> the value the daemon runs with (what `ibex config` prints).

    An unset targeted setting shows its layer default, a computed one (the
    connection caps from RLIMIT_NOFILE, the per-org cap, the age grace) the
    value computed now; durations carry a unit (`45ms`, `5s`), secrets are
    redacted. None is a setting that is off (no URL, no age limit).
    """
    values: dict[str, Any] = {**layer_defaults(), **settings.redacted()}
    connections = connections_config(settings)
    admission = admission_config(settings)
    values.update(
        max_org_assemblies=admission.max_org_concurrent,
        max_caller_in_flight_bytes=admission.max_caller_bytes,
        max_connections=connections.max_connections,
        max_connections_per_peer=connections.max_per_peer,
        max_connection_age_grace=connections.age_grace,
    )
    out: dict[str, Any] = {}
    for field, row in TABLE.items():
        value = values.get(field)
        if field in DURATIONS and value is not None:
            value = format_duration(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[PREFIX + row.suffix] = value
    return out


def config_warnings(settings: Settings) -> list[str]:
    """Settings that make the daemon serve less than it could, each naming its variable.

    Said once at start (`config_warning` log lines) and by `ibex check`; none
    stops start-up, since each can be meant (a directive-only deployment), but
    none should pass unseen: a branch timeout set above the retrieval wall (the
    wall cuts the branch first), Redis without the memory service (every answer
    has no memories) or the other way round (no directive), a password sent
    to Redis or a sentinel off loopback without TLS.
    """
    out: list[str] = []
    retrieval = layer_config(RetrievalConfig, settings)
    wall = format_duration(retrieval.wall)
    for field in ("directive_timeout", "hot_timeout", "cold_timeout"):
        value = getattr(settings, field)
        if value is not UNSET and value > retrieval.wall:
            out.append(
                f"{PREFIX}{TABLE[field].suffix}: {format_duration(value)} is above the retrieval "
                f"wall of {wall} (min({PREFIX}TIMEOUT, {PREFIX}DEADLINE_MS)), which cuts "
                "the branch first"
            )
    redis = f"{PREFIX}REDIS_SENTINELS" if settings.redis_sentinels else f"{PREFIX}REDIS_URL"
    if settings.redis_configured and settings.memory_base_url is None:
        out.append(
            f"{PREFIX}MEMORY_BASE_URL: not set while {redis} is: every answer has no "
            "memories (the hot and cold branches are skipped)"
        )
    if settings.memory_base_url is not None and not settings.redis_configured:
        out.append(
            f"{PREFIX}REDIS_URL: not set while {PREFIX}MEMORY_BASE_URL is: every answer "
            "has no directive (the directive branch is skipped)"
        )
    out += _insecure_redis(settings)
    return out


def _insecure_redis(settings: Settings) -> list[str]:
    """A Redis or Sentinel password that would cross the network in clear."""
    url = settings.redis_url
    scheme = url.partition("://")[0].lower() if url else ""
    if scheme in ("rediss", "unix"):  # TLS (to the sentinels too), or no network at all
        return []
    out: list[str] = []
    sentinels = [split_host_port(a)[0] for a in settings.redis_sentinels]
    remote_sentinels = [h for h in sentinels if not is_loopback(h)]
    if settings.redis_sentinel_password and remote_sentinels:
        out.append(
            f"{PREFIX}REDIS_SENTINEL_PASSWORD: sent in clear to {remote_sentinels[0]} (not "
            f"loopback); a rediss:// {PREFIX}REDIS_URL puts the sentinel connections on TLS"
        )
    if url and _url_has_password(url):
        # With Sentinel the data nodes are whatever the sentinels name: off loopback
        # unless every sentinel is local.
        host = _url_host(url)
        remote = bool(remote_sentinels) if sentinels else not is_loopback(host)
        if remote:
            where = "the nodes the sentinels name" if sentinels else host
            out.append(
                f"{PREFIX}REDIS_URL: its password is sent in clear to {where} (not "
                "loopback); use rediss://"
            )
    return out


def _url_has_password(url: str) -> bool:
    """Userinfo, or a password-like query parameter (redis-py reads `password`)."""
    rest = url.partition("://")[2]
    if "@" in rest:
        return True
    query = rest.partition("#")[0].partition("?")[2]
    return any(
        k.strip().lower() == "password" for k, _, _ in (p.partition("=") for p in query.split("&"))
    )


def _url_host(url: str) -> str:
    """The host of `scheme://[userinfo@]host[:port][/path]` (brackets dropped)."""
    authority = url.partition("://")[2].rpartition("@")[2]
    for stop in "/?#":
        authority = authority.partition(stop)[0]
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    return authority.partition(":")[0]


def listen_problems(settings: Settings) -> list[tuple[str, str]]:
    """(address, problem) for each address `ibex serve` would listen on and cannot bind now.

    Each address is bound and closed at once, as the daemon binds it (every
    address the host resolves to, SO_REUSEADDR): the gRPC address, each
    worker's own port, the metrics address. A daemon already serving there
    makes its address show as in use, which is what a check before a start
    should say.
    """
    host, port = split_host_port(settings.grpc_addr)
    addrs = [(f"{PREFIX}GRPC_ADDR", host, port)]
    addrs += [(f"{PREFIX}WORKER_PORT_BASE", host, p) for p in settings.worker_ports()]
    if settings.metrics_addr:
        addrs.append((f"{PREFIX}METRICS_ADDR", *split_host_port(settings.metrics_addr)))
    out: list[tuple[str, str]] = []
    for variable, h, p in addrs:
        problem = try_bind(h, p)
        if problem is not None:
            out.append((f"{join_host_port(h, p)} ({variable})", problem))
    return out


def listen_variable(settings: Settings, port: int) -> str:
    """The variable that names listening port `port` (for a ListenError's one line).

    A worker's own port is WORKER_PORT_BASE + its slot; a worker process's
    settings say one worker, so its port is not among `worker_ports()`.
    """
    if port == split_host_port(settings.grpc_addr)[1]:
        return f"{PREFIX}GRPC_ADDR"
    if settings.metrics_addr and split_host_port(settings.metrics_addr)[1] == port:
        return f"{PREFIX}METRICS_ADDR"
    if settings.worker_port_base is not None:
        return f"{PREFIX}WORKER_PORT_BASE"
    return f"{PREFIX}GRPC_ADDR"


def try_bind(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (None when it can); nothing stays bound."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        return f"cannot resolve: {exc.strerror or exc}"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr)
                sock.listen(1)
        except OSError as exc:
            return bind_problem(exc)
    return None


def admission_config(settings: Settings) -> AdmissionConfig:
    """Admission; the per-org, per-caller and worker-thread queue defaults derive from the
    global caps."""
    built = layer_config(AdmissionConfig, settings)
    return msgspec.structs.replace(
        built,
        max_org_concurrent=settings.max_org_assemblies or max(1, built.max_concurrent // 2),
        max_caller_bytes=settings.max_caller_in_flight_bytes or built.max_in_flight_bytes // 4,
        max_thread_queue=max(1, built.max_in_flight // 4),
    )


def connections_config(settings: Settings) -> ConnectionsConfig:
    """Connection limits; the cap's default is computed from RLIMIT_NOFILE at start-up, the
    per-peer cap's from the cap, the age grace's from the daemon's drain grace."""
    cap = settings.max_connections or default_max_connections()
    grace = settings.max_connection_age_grace
    return layer_config(
        ConnectionsConfig,
        settings,
        max_connections=cap,
        max_per_peer=settings.max_connections_per_peer or max(1, cap // 4),
        age_grace=grace if grace is not None else drain_grace(settings),
    )


def drain_grace(settings: Settings) -> float:
    """How long in-flight calls may finish on SIGTERM (the supervisor waits for it too)."""
    return layer_config(DaemonConfig, settings).drain_grace


def authenticator(settings: Settings) -> Authenticator:
    return Authenticator(
        token_hashes=settings.auth_tokens_sha256,
        allowed_sans=settings.tls_allowed_sans,
        mtls=settings.tls_client_ca is not None,
        token_orgs=dict(settings.auth_token_orgs),
        require_principal=settings.require_principal,
    )


def load_static(settings: Settings) -> tuple[Catalog, Tokenizers]:
    """Catalog and tokenizers, loaded and verified once at start-up."""
    catalog = load_catalog(settings.catalog_path)
    tokenizers = Tokenizers(
        settings.tiktoken_dir, settings.token_cache_entries, settings.token_cache_bytes
    )
    try:
        tokenizers.preload(sorted(catalog.encodings()))
    except TokenizerError as exc:
        raise TokenizerError(f"{PREFIX}TIKTOKEN_DIR: {exc}") from None
    return catalog, tokenizers


def memory_http_source(settings: Settings) -> MemoryHttpSource:
    """The memory-service source; call `open()` (or `async with`) inside the Trio run."""
    if not settings.memory_base_url or not settings.memory_api_token:
        raise ValueError("memory_base_url and memory_api_token are required")
    return MemoryHttpSource(
        settings.memory_base_url,
        settings.memory_api_token,
        pool_size=settings.memory_pool_size,
        max_response_bytes=settings.memory_max_response_bytes,
        max_content_bytes=settings.memory_max_content_bytes,
    )


def redis_directive_source(settings: Settings) -> tuple[RedisDirectiveSource, str]:
    """The directive source for the configured Redis topology, and its backend name."""
    if settings.redis_sentinels:
        assert settings.redis_sentinel_master is not None  # load_settings requires it
        sentinels = [split_host_port(a) for a in settings.redis_sentinels]
        source = RedisDirectiveSource.sentinel(
            sentinels,
            settings.redis_sentinel_master,
            url=settings.redis_url,
            sentinel_password=settings.redis_sentinel_password,
        )
        return source, "redis-sentinel"
    assert settings.redis_url is not None
    if settings.redis_cluster:
        return RedisDirectiveSource.cluster(settings.redis_url), "redis-cluster"
    return RedisDirectiveSource(settings.redis_url), "redis"


# Seconds an idle memory-service connection must still have before it expires for the
# keep-warm probe (every second) to leave it: the next one replaces it before it lapses.
MEMORY_FRESH_FOR = 2.0


def redis_target(settings: Settings) -> str:
    """Where the directive source reads, for logs: URLs redacted, sentinels named."""
    url = redact_url(settings.redis_url) if settings.redis_url else ""
    if settings.redis_sentinels:
        sentinels = ",".join(settings.redis_sentinels)
        return f"sentinel {sentinels} master {settings.redis_sentinel_master}"
    return f"cluster {url}" if settings.redis_cluster else url


def uses_local_sample(settings: Settings) -> bool:
    """The backend choice: the bundled local sample serves directives and memories when
    neither Redis nor a memory-service URL is set (the daemon and `ibex check` agree)."""
    return not settings.redis_configured and settings.memory_base_url is None


@asynccontextmanager
async def open_assembler(
    settings: Settings,
    *,
    catalog: Catalog | None = None,
    tokenizers: Tokenizers | None = None,
    handed: Sequence[handover.Key] = (),
) -> AsyncIterator[Assembler]:
    """Open the configured sources for the life of the block (one pool per process).

    `handed`: agents whose directives the directive cache reads before serving (the
    ones a reload's old workers served last, see `ibex.ops.handover`)."""
    if catalog is None or tokenizers is None:
        catalog, tokenizers = load_static(settings)
    directive_source: DirectiveSource | None = None
    memory_source: MemorySource | None = None
    http: MemoryHttpSource | None = None
    feedback_sink: FeedbackSink | None = None
    redis: RedisDirectiveSource | None = None
    background = AsyncExitStack()  # the memory source with its nursery (drains of cut calls)
    backend: list[str] = []
    dependencies: list[Dependency] = []
    if uses_local_sample(settings):
        local = LocalFileSource.load(
            settings.local_source_path, max_content_bytes=settings.memory_max_content_bytes
        )
        directive_source = memory_source = feedback_sink = local
        backend.append(f"local:{local.origin}")
    else:
        if settings.redis_configured:
            redis, kind = redis_directive_source(settings)
            directive_source = redis
            backend.append(kind)
            prime = None
            cache_config = layer_config(DirectiveCacheConfig, settings)
            if cache_config.max_entries > 0:
                cache = DirectiveCache(redis, cache_config)
                directive_source = await background.enter_async_context(cache)
                if handed:
                    prime = functools.partial(prime_directives, cache, handed)
            warm_redis = functools.partial(redis.warm, 1)
            dependencies.append(Dependency("redis", redis_target(settings), warm_redis, prime))
        if settings.memory_base_url is not None:
            http = memory_http_source(settings)
            await background.enter_async_context(http)
            memory_source = feedback_sink = http
            backend.append("memory-http")
            warm = functools.partial(http.warm, 1, fresh_for=MEMORY_FRESH_FOR)
            dependencies.append(Dependency("memory", redact_url(settings.memory_base_url), warm))
    try:
        yield Assembler(
            catalog=catalog,
            tokenizers=tokenizers,
            directive_source=directive_source,
            memory_source=memory_source,
            limits=layer_config(RequestLimits, settings),
            retrieval=layer_config(RetrievalConfig, settings),
            pipeline=layer_config(PipelineConfig, settings),
            backend="+".join(backend),
            feedback_sink=feedback_sink,
            nonce_key=(
                NonceKey(settings.nonce_key, settings.nonce_max_age) if settings.nonce_key else None
            ),
            dependencies=dependencies,
        )
    finally:
        # The directive cache's reads end first, then the memory source (closed shielded,
        # then its nursery ends), then the Redis client those reads used.
        await background.aclose()
        with trio.CancelScope(shield=True):
            if redis is not None:
                await redis.aclose()


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS for the gRPC port (HTTP/2 via ALPN); client certs required when a CA is set."""
    if not settings.tls_cert or not settings.tls_key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigFileError(f"IBEX_CONTEXT_TLS_CERT/KEY: cannot load: {exc}") from None
    if settings.tls_client_ca:
        try:
            ctx.load_verify_locations(settings.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigFileError(f"IBEX_CONTEXT_TLS_CLIENT_CA: cannot load: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


def check_bind_policy(settings: Settings) -> str | None:
    """Refuse a non-loopback bind without authentication unless explicitly allowed.

    Returns a warning to log at every start when the insecure override is in use.
    """
    metrics_warning = check_metrics_bind_policy(settings)
    host, _ = split_host_port(settings.grpc_addr)
    has_auth = bool(settings.auth_tokens_sha256) or settings.tls_client_ca is not None
    if is_loopback(host) or has_auth:
        return metrics_warning
    if not settings.allow_insecure:
        raise ConfigError(
            f"IBEX_CONTEXT_GRPC_ADDR: binding {host} (not loopback) requires caller "
            "authentication (IBEX_CONTEXT_AUTH_TOKENS_SHA256 or IBEX_CONTEXT_TLS_CLIENT_CA); "
            "set IBEX_CONTEXT_ALLOW_INSECURE=1 to accept unauthenticated callers"
        )
    warning = (
        f"insecure: listening on {host} without caller authentication "
        "(IBEX_CONTEXT_ALLOW_INSECURE=1); any caller can read any tenant's memories"
    )
    return f"{warning}; {metrics_warning}" if metrics_warning else warning


def check_metrics_bind_policy(settings: Settings) -> str | None:
    """The same rule for /metrics: off loopback it needs a scrape token
    (IBEX_CONTEXT_METRICS_TOKEN_SHA256) unless the insecure override is given."""
    if not settings.metrics_addr or settings.metrics_token_sha256:
        return None
    host, _ = split_host_port(settings.metrics_addr)
    if is_loopback(host):
        return None
    if not settings.allow_insecure:
        raise ConfigError(
            f"IBEX_CONTEXT_METRICS_ADDR: binding {host} (not loopback) requires a scrape "
            "token (IBEX_CONTEXT_METRICS_TOKEN_SHA256); "
            "set IBEX_CONTEXT_ALLOW_INSECURE=1 to serve metrics to anyone"
        )
    return (
        f"insecure: serving /metrics on {host} without a scrape token "
        "(IBEX_CONTEXT_ALLOW_INSECURE=1)"
    )


def make_daemon(
    settings: Settings,
    *,
    metrics: Metrics | None = None,
    reuse_port: bool = False,
    worker_index: int | None = None,
) -> Daemon:
    """A serving process built from settings; `Daemon.serve` loads and opens everything.

    `worker_index` is the supervisor's slot for this worker: with
    WORKER_PORT_BASE set, the process also listens on base + index (a single
    process, index 0, on the base itself) so clients can balance per call.
    """
    host, port = split_host_port(settings.grpc_addr)
    own = settings.worker_port(worker_index or 0)
    # A supervised worker's predecessors' agents (the supervisor sets it, see ibex.ops.handover).
    handed = handover.decode(os.environ.get(handover.ENV, "")) if worker_index is not None else []
    config = layer_config(
        DaemonConfig,
        settings,
        host=host,
        port=port,
        reuse_port=reuse_port,
        own_ports=() if own is None else (own,),
        worker=worker_index,
        connections=connections_config(settings),
    )
    return Daemon(
        config,
        open_assembler=lambda: open_assembler(settings, handed=handed),
        authenticator=authenticator(settings),
        admission=admission_config(settings),
        edge=layer_config(EdgeConfig, settings),
        metrics=metrics,
        ssl_context=lambda: server_ssl_context(settings),
        startup_warning=lambda: check_bind_policy(settings),
        tracing=setup_tracing,  # OTEL_* variables, read by the SDK (see ibex.ops.tracing)
    )
