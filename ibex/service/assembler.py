"""In-process assembly: validation, concurrent retrieval, then the pure pipeline.

An `Assembler` holds what one assembly needs (catalog, tokenizers, sources and
each layer's small config) and is shared by every request of a process. It is
built by the composition root (`ibex.service.root.open_assembler`); tests and
benchmarks may build one directly from parts.
"""

from __future__ import annotations

import logging
import time

from ibex.assembly.catalog import Catalog
from ibex.assembly.formatter import new_nonce
from ibex.assembly.pipeline import AssemblyInputs, PipelineConfig, assemble_pure, resolve_model
from ibex.assembly.structs import AssemblyRequest, AssemblyResult
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.validation import RequestLimits, validate_request
from ibex.sources.base import DirectiveSource, MemorySource
from ibex.sources.retrieval import RetrievalConfig, retrieve

log = logging.getLogger(__name__)


class Assembler:
    """Holds the process-wide pieces one assembly needs; safe to share across requests."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        tokenizers: Tokenizers,
        directive_source: DirectiveSource | None,
        memory_source: MemorySource | None,
        limits: RequestLimits | None = None,
        retrieval: RetrievalConfig | None = None,
        pipeline: PipelineConfig | None = None,
        backend: str = "",
    ) -> None:
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.directive_source = directive_source
        self.memory_source = memory_source
        self.limits = limits or RequestLimits()
        self.retrieval = retrieval or RetrievalConfig()
        self.pipeline = pipeline or PipelineConfig()
        self.backend = backend

    def check_request(self, request: AssemblyRequest) -> AssemblyRequest:
        """Validate before any I/O: ids, weights, sizes and a known model or window."""
        request = validate_request(request, self.limits)
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
            config=self.retrieval,
            deadline=deadline,
        )
        inputs = AssemblyInputs(
            request=request,
            directive=got.directive,
            hot=got.hot,
            cold=got.cold,
            branches=got.branches,
            nonce=new_nonce(self.pipeline.nonce_bytes),
            now=time.time(),
            retrieval_ms=got.elapsed_ms,
        )
        result = assemble_pure(
            inputs, catalog=self.catalog, tokenizers=self.tokenizers, config=self.pipeline
        )
        filtered = result.pack.tenant_filtered
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
