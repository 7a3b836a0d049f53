"""The composition root: every part of a serving process, built from `Settings`.

This module, the CLI, the worker supervisor and `ibex.config.effective` (the
derived values) are the only readers of `Settings`. Each layer gets a small
frozen config of its own (retrieval limits, request limits, pipeline knobs,
admission, the edge), so no layer
sees a secret it does not need: `Settings` holds them built, each field's
variable declared beside its default (`ibex.envvar.env`); the few values
derived from others are computed from the built structs by
`ibex.config.effective` (`admission_config`, `connections_config`), which
`ibex config` reads too. What start-up and `ibex check` say about the settings (warnings,
bind problems, the bind policy) is in `ibex.service.startup_checks`.

`open_assembler(settings)` builds the sources the settings name (Redis for
directives, the memory service over HTTP, or the bundled local sample when
neither is configured) and closes them on exit. It must run inside
`trio_asyncio.open_loop()` whenever Redis is configured, because redis-py is
asyncio and is crossed into Trio with trio-asyncio.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import msgspec
import trio

from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.nonce import NonceKey
from ibex.assembly.tokens import TokenizerError, Tokenizers
from ibex.config import PREFIX, Settings, redact_url
from ibex.config.effective import (
    admission_config,
    connections_config,
    drain_grace,
    effective_settings,
    layer_config,
)
from ibex.errors import ConfigFileError
from ibex.netaddr import split_host_port
from ibex.ops import handover
from ibex.ops.metrics import Metrics
from ibex.ops.tracing import setup_tracing
from ibex.service.assembler import Assembler
from ibex.service.auth import Authenticator
from ibex.service.daemon import Daemon
from ibex.service.dependencies import Dependency, prime_directives
from ibex.service.startup_checks import check_bind_policy
from ibex.sources.base import DirectiveSource, MemorySource
from ibex.sources.directive_cache import DirectiveCache
from ibex.sources.feedback_sender import FeedbackSink
from ibex.sources.local_file import LocalFileSource
from ibex.sources.memory_http import MemoryHttpSource
from ibex.sources.redis_directive import RedisDirectiveSource

__all__ = [
    "Assembler",
    "admission_config",
    "connections_config",
    "drain_grace",
    "effective_settings",
    "layer_config",
    "load_static",
    "make_daemon",
    "open_assembler",
    "server_ssl_context",
]


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
        settings.tiktoken_dir, settings.token_cache.entries, settings.token_cache.max_bytes
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
        pool_size=settings.memory.pool_size,
        max_response_bytes=settings.memory.max_response_bytes,
        max_content_bytes=settings.memory.max_content_bytes,
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
            settings.local_source_path, max_content_bytes=settings.memory.max_content_bytes
        )
        directive_source = memory_source = feedback_sink = local
        backend.append(f"local:{local.origin}")
    else:
        if settings.redis_configured:
            redis, kind = redis_directive_source(settings)
            directive_source = redis
            backend.append(kind)
            prime = None
            cache_config = settings.directive_cache
            if cache_config.max_entries > 0:
                cache = DirectiveCache(redis, cache_config)
                directive_source = await background.enter_async_context(cache)
                if handed:
                    prime = functools.partial(prime_directives, cache, handed)
            # Two connections: a burst whose calls come in two socket reads sends two
            # batched reads at once, and the second must not connect on its calls' path.
            warm_redis = functools.partial(redis.warm, 2)
            check = functools.partial(redis.warm, 1)  # leaves the other warmed one idle
            redis_dep = Dependency("redis", redis_target(settings), warm_redis, prime, check)
            dependencies.append(redis_dep)
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
            limits=settings.limits,
            retrieval=settings.retrieval,
            pipeline=settings.pipeline,
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
    config = msgspec.structs.replace(
        settings.daemon,
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
        edge=settings.edge,
        metrics=metrics,
        ssl_context=lambda: server_ssl_context(settings),
        startup_warning=lambda: check_bind_policy(settings),
        tracing=setup_tracing,  # OTEL_* variables, read by the SDK (see ibex.ops.tracing)
    )
