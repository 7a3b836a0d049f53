"""In-process assembly: validation, concurrent retrieval, then the pure pipeline.

`open_assembler(settings)` builds the sources the settings name (Redis for
directives, the memory service over HTTP, or the bundled local sample when
neither is configured) and closes them on exit. It must run inside
`trio_asyncio.open_loop()` whenever Redis is configured, because redis-py is
asyncio and is crossed into Trio with trio-asyncio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ibex.catalog import Catalog, load_catalog
from ibex.config import Settings
from ibex.formatter import new_nonce
from ibex.pipeline import AssemblyInputs, PipelineConfig, assemble_pure, resolve_model
from ibex.retrieval import retrieve
from ibex.sources.base import DirectiveSource, MemorySource
from ibex.sources.local_file import LocalFileSource
from ibex.sources.memory_http import MemoryHttpSource
from ibex.sources.redis_directive import RedisDirectiveSource
from ibex.structs import AssemblyRequest, AssemblyResult
from ibex.tokens import Tokenizers
from ibex.validation import validate_request

log = logging.getLogger("ibex.assemble")


class Assembler:
    """Holds the process-wide pieces one assembly needs; safe to share across requests."""

    def __init__(
        self,
        settings: Settings,
        *,
        catalog: Catalog,
        tokenizers: Tokenizers,
        directive_source: DirectiveSource | None,
        memory_source: MemorySource | None,
        backend: str = "",
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.directive_source = directive_source
        self.memory_source = memory_source
        self.backend = backend
        self.config = PipelineConfig(
            dp_cell_ceiling=settings.packer_dp_cell_ceiling,
            max_consecutive_skips=settings.packer_max_consecutive_skips,
        )

    def check_request(self, request: AssemblyRequest) -> AssemblyRequest:
        """Validate before any I/O: ids, weights, sizes and a known model or window."""
        request = validate_request(request, self.settings)
        resolve_model(self.catalog, request.model, request.available_tokens)
        return request

    async def assemble(
        self, request: AssemblyRequest, *, deadline: float | None = None, validated: bool = False
    ) -> AssemblyResult:
        """Retrieve within the wall (and the caller's deadline), then run the pipeline."""
        if not validated:
            request = self.check_request(request)
        got = await retrieve(
            request,
            directive_source=self.directive_source,
            memory_source=self.memory_source,
            settings=self.settings,
            deadline=deadline,
        )
        inputs = AssemblyInputs(
            request=request,
            directive=got.directive,
            hot=got.hot,
            cold=got.cold,
            branches=got.branches,
            nonce=new_nonce(self.settings.formatter_nonce_bytes),
            now=time.time(),
            retrieval_ms=got.elapsed_ms,
        )
        result = assemble_pure(
            inputs, catalog=self.catalog, tokenizers=self.tokenizers, config=self.config
        )
        filtered = sum(1 for m in result.excluded if m.exclusion == "filter")
        if filtered:
            log.warning(
                "tenant_filter_dropped",
                extra={
                    "count": filtered,
                    "org_id": request.org_id,
                    "agent_id": request.agent_id,
                    "request_id": request.request_id,
                },
            )
        return result


def load_static(settings: Settings) -> tuple[Catalog, Tokenizers]:
    """Catalog and tokenizers, loaded and verified once at start-up."""
    catalog = load_catalog(settings.catalog_path)
    tokenizers = Tokenizers(settings.tiktoken_dir, settings.token_cache_entries)
    tokenizers.preload(sorted(catalog.encodings()))
    return catalog, tokenizers


@asynccontextmanager
async def open_assembler(
    settings: Settings,
    *,
    catalog: Catalog | None = None,
    tokenizers: Tokenizers | None = None,
) -> AsyncIterator[Assembler]:
    """Open the configured sources for the life of the block (one pool per process)."""
    if catalog is None or tokenizers is None:
        catalog, tokenizers = load_static(settings)
    directive_source: DirectiveSource | None = None
    memory_source: MemorySource | None = None
    http: MemoryHttpSource | None = None
    redis: RedisDirectiveSource | None = None
    backend: list[str] = []
    if settings.redis_url is None and settings.memory_base_url is None:
        local = LocalFileSource.load(settings.local_source_path)
        directive_source = memory_source = local
        backend.append(f"local:{local.origin}")
    else:
        if settings.redis_url is not None:
            redis = RedisDirectiveSource(settings.redis_url)
            directive_source = redis
            backend.append("redis")
        if settings.memory_base_url is not None:
            http = MemoryHttpSource.from_settings(settings)
            await http.open()
            memory_source = http
            backend.append("memory-http")
    try:
        yield Assembler(
            settings,
            catalog=catalog,
            tokenizers=tokenizers,
            directive_source=directive_source,
            memory_source=memory_source,
            backend="+".join(backend),
        )
    finally:
        with trio.CancelScope(shield=True):
            if http is not None:
                await http.aclose()
            if redis is not None:
                await redis.aclose()
