"""In-process assembly and search: validation, retrieval, then the pure core.

An `Assembler` holds what one assembly needs (catalog, tokenizers, sources and
each layer's small config) and is shared by every request of a process. It is
built by the composition root (`ibex.service.root.open_assembler`); tests and
benchmarks may build one directly from parts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

import trio

from ibex.assembly.candidates import MAX_MEMORIES_HARD_CAP, SearchFilter, SearchResult, rank_search
from ibex.assembly.catalog import Catalog
from ibex.assembly.nonce import NonceKey
from ibex.assembly.pipeline import (
    AssemblyInputs,
    PipelineConfig,
    StageTimer,
    assemble_pure,
    resolve_model,
)
from ibex.assembly.prepare import EarlyAssembly, Speculation
from ibex.assembly.structs import (
    AssemblyRequest,
    AssemblyResult,
    BranchSource,
    SearchRequest,
)
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.validation import RequestLimits, validate_request, validate_search
from ibex.assembly.xml_format import new_nonce
from ibex.errors import SourceError
from ibex.service.dependencies import Dependency
from ibex.service.early_feed import (
    OFFLOAD_CHARS,
    SPECULATE_AFTER_CUT,
    SPECULATE_AHEAD,
    EarlyAssemblyFeed,
    Handoff,
    request_chars,
    text_chars,
)
from ibex.service.queues import WorkerThreads, default_threads
from ibex.sources.base import DirectiveSource, MemorySource, prefetch_directive
from ibex.sources.feedback_sender import FeedbackSink
from ibex.sources.retrieval import RetrievalConfig, cold_search, retrieve
from ibex.sources.retrieved import Retrieved

if TYPE_CHECKING:
    from ibex.ops.otel_sdk import CallTrace

log = logging.getLogger(__name__)


def _log_tenant_filtered(count: int, **ids: str) -> None:
    """Hits of another tenant were dropped: the memory service answered out of scope."""
    if count:
        log.warning("tenant_filter_dropped", extra={"count": count, **ids})


class CallOptions(TypedDict, total=False):
    """What `Assembler.assemble` passes on to `Assembler.assemble_checked`."""

    deadline: float | None
    arrived: float | None
    thread_held: bool
    trace: CallTrace | None


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
        offload_chars: int = OFFLOAD_CHARS,
        offload_threads: int | None = None,
        feedback_sink: FeedbackSink | None = None,
        nonce_key: NonceKey | None = None,
        wall_clock: Callable[[], float] = time.time,
        dependencies: Sequence[Dependency] = (),
        speculate_ahead: float | None = SPECULATE_AHEAD,
    ) -> None:
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.directive_source = directive_source
        self.memory_source = memory_source
        self.limits = limits or RequestLimits()
        self.retrieval = retrieval or RetrievalConfig()
        self.pipeline = pipeline or PipelineConfig()
        self.backend = backend
        self.offload_chars = offload_chars
        self.threads = WorkerThreads(offload_threads or default_threads())
        self.feedback_sink = feedback_sink  # where RecordMemoryFeedback goes; None: UNAVAILABLE
        self.nonce_key = nonce_key
        # Unix time, which every replica shares: it picks a session nonce's lifetime window.
        self.wall_clock = wall_clock
        # What the sources depend on (Redis, the memory service): warmed before serving.
        self.dependencies = tuple(dependencies)
        # Seconds before the wall at which a call's answer is made as if the wall will cut
        # its last branch (`EarlyAssemblyFeed`), while calls are being cut
        # (`SPECULATE_AFTER_CUT`). None: no answer is made before or at the wall; the
        # pipeline runs once retrieval has returned (the cut branches have unwound).
        self.speculate_ahead = speculate_ahead
        self.last_cut = -math.inf  # when the wall last cut a call's branch (Trio clock)

    def nonce(self, request: AssemblyRequest) -> str:
        """Session-scoped with a key and a session (the provider can cache the prefix), else fresh.

        See ibex.assembly.nonce for what a session-scoped nonce changes and why it is safe.
        """
        nbytes = self.pipeline.nonce_bytes
        if self.nonce_key is not None and request.session_id:
            return self.nonce_key.nonce(
                request.org_id, request.agent_id, request.session_id, nbytes, self.wall_clock()
            )
        return new_nonce(nbytes)

    def check_request(self, request: AssemblyRequest) -> AssemblyRequest:
        """Validate before any I/O: ids, weights, sizes and a known model or window."""
        request = validate_request(request, self.limits)
        resolve_model(self.catalog, request.model, request.available_tokens)
        return request

    def prefetch(self, request: AssemblyRequest) -> None:
        """Start the directive read `request` will need, when its source can (the cache
        can); no I/O here. Called as soon as the call is checked, so the read overlaps
        the call's own work (the crossing, its slot, the other branches' set-up) and
        that of the calls that arrived with it, instead of starting behind them."""
        if self.directive_source is not None:
            prefetch_directive(
                self.directive_source,
                request.org_id,
                request.agent_id,
                request.directive_version_id,
            )

    def needs_thread(self, request: AssemblyRequest) -> bool:
        """True when the request's own text already sends its pipeline to a worker thread,
        so the call can queue for the thread before it takes an assembly slot."""
        return request_chars(request) > self.offload_chars

    async def assemble(
        self, request: AssemblyRequest, **options: Unpack[CallOptions]
    ) -> AssemblyResult:
        """Check the request (`check_request`), then `assemble_checked` it with `options`."""
        return await self.assemble_checked(self.check_request(request), **options)

    async def assemble_checked(
        self,
        request: AssemblyRequest,
        *,
        deadline: float | None = None,
        arrived: float | None = None,
        thread_held: bool = False,
        trace: CallTrace | None = None,
        retrieving: contextlib.AbstractContextManager[object] | None = None,
        handoff: Handoff | None = None,
    ) -> AssemblyResult:
        """Retrieve within the wall (and the caller's deadline), then run the pipeline.

        `request` is one `check_request` returned (the gRPC handler checks it before
        taking an assembly slot, so a malformed request never waits for one).
        `deadline` and `arrived` (when the call reached the process) are on the Trio clock.
        `thread_held`: the caller holds a unit of `threads` (admission queued for it
        before the slot), and the pipeline runs under it in a worker thread.
        A `trace` receives each branch's and stage's times once the answer is made.
        `retrieving` is entered for the retrieval alone (admission counts calls waiting
        on their branches, see `Admission.retrieving_for`).
        A call cut by the wall gets the answer made just before
        the wall (`EarlyAssemblyFeed`), the same as the pipeline would make then, or
        made at the wall when it was not; it is handed to `handoff` at the wall, before
        the cut branches have unwound, and returned once they have. Not for a traced
        call (its stage spans time the pipeline at the wall), a thread-held one, one
        whose own text leaves no early budget (`offload_chars`) or that the pipeline
        refuses at once, nor with `speculate_ahead` None: those run the pipeline once
        the cut branches have unwound.
        """
        starts: dict[BranchSource, float] | None = None
        timer: StageTimer | None = None
        if trace is not None:
            starts, timer = {}, StageTimer()
        # One nonce and one "now" per request, before retrieval: the work done as
        # branches land and the pipeline at the wall must see the same values.
        nonce, now = self.nonce(request), time.time()
        speculate = trace is None and self.speculate_ahead is not None
        early = None if thread_held else self._early(request, nonce, now, speculate, handoff)
        with retrieving if retrieving is not None else contextlib.nullcontext():
            got = await retrieve(
                request,
                directive_source=self.directive_source,
                memory_source=self.memory_source,
                config=self.retrieval,
                deadline=deadline,
                arrived=arrived,
                branch_starts=starts,
                listener=early,
                wall_listener=early if early is not None and early.speculate else None,
            )
        if early is not None and early.cut:
            self.last_cut = trio.current_time()
        if early is not None and early.answer is not None and early.answer[0] is got:
            result = early.answer[1]  # made before the wall, for what the wall cut
        else:
            inputs = _inputs(request, nonce, now, got)
            result = await self._pipeline(inputs, thread_held, timer, early)
            if trace is not None:
                assert starts is not None and timer is not None
                _record(trace, got, starts, timer, result)
        _log_tenant_filtered(
            result.pack.tenant_filtered,
            org_id=request.org_id,
            agent_id=request.agent_id,
            request_id=request.request_id,
        )
        return result

    async def _pipeline(
        self,
        inputs: AssemblyInputs,
        thread_held: bool,
        timer: StageTimer | None,
        early: EarlyAssemblyFeed | None,
    ) -> AssemblyResult:
        """The pure pipeline over what retrieval returned: in the loop, or in a worker
        thread when the caller holds one or the text is too much for the loop."""
        run = functools.partial(
            self._assemble, inputs, timer, early.assembly if early is not None else None
        )
        if thread_held:
            return await self.threads.run_held(run)
        if text_chars(inputs) <= self.offload_chars:
            return run()
        # Counting this much text would hold the loop (1 M CJK characters are hundreds
        # of ms of tiktoken): do it in a worker thread, where tiktoken releases the GIL, so
        # other calls keep their deadlines. Only the retrieved memories made this
        # call large (a large request queued for its thread before its slot): it
        # waits in the urgent line, since it holds a slot while it waits.
        return await self.threads.run(run)

    def _early(
        self,
        request: AssemblyRequest,
        nonce: str,
        now: float,
        speculate: bool = True,
        handoff: Handoff | None = None,
    ) -> EarlyAssemblyFeed | None:
        """The call's early work, or None when its own text already sends its pipeline
        to a worker thread (or the request is one the pipeline will refuse at once).
        With `speculate`, it makes the answer before the wall too (`EarlyAssemblyFeed`)."""
        budget = self.offload_chars - request_chars(request)
        if budget < 0:
            return None
        try:
            assembly = EarlyAssembly(
                request,
                nonce,
                now,
                catalog=self.catalog,
                tokenizers=self.tokenizers,
                config=self.pipeline,
            )
        except Exception:
            return None  # an unchecked request: the pipeline raises it where it always has
        cut_recently = trio.current_time() - self.last_cut < SPECULATE_AFTER_CUT
        return EarlyAssemblyFeed(
            assembly,
            budget,
            functools.partial(_inputs, request, nonce, now),
            functools.partial(self._speculate, assembly) if speculate else None,
            handoff,
            self.offload_chars,
            self.speculate_ahead if cut_recently else None,
        )

    def _speculate(self, early: EarlyAssembly, inputs: AssemblyInputs) -> Speculation:
        """The whole pipeline for `inputs` now, in the loop (the feed's budget bounds its text)."""
        timer = StageTimer()
        result = self._assemble(inputs, timer, early)
        return Speculation(inputs, result, timer.total())

    def _assemble(
        self, inputs: AssemblyInputs, timer: StageTimer | None, early: EarlyAssembly | None
    ) -> AssemblyResult:
        """`assemble_pure` with this assembler's catalog, tokenizers and pipeline config."""
        return assemble_pure(
            inputs,
            catalog=self.catalog,
            tokenizers=self.tokenizers,
            config=self.pipeline,
            timer=timer,
            early=early,
        )

    def check_search(self, request: SearchRequest) -> SearchFilter:
        """Validate a SearchMemories request before any I/O (and before it waits for a
        slot: without a memory source it fails at once)."""
        flt = validate_search(request, self.limits)
        self._searchable()
        return flt

    def _searchable(self) -> MemorySource:
        if self.memory_source is None:
            raise SourceError("memory search failed: no memory source configured")
        return self.memory_source

    async def search(self, flt: SearchFilter, *, deadline: float | None = None) -> SearchResult:
        """One semantic search within the cold timeout (and the caller's deadline, on the
        Trio clock), then the tenant filter, the filters and the default score.

        With filters that narrow after the fetch, the source is asked for the cap.
        """
        fetch = MAX_MEMORIES_HARD_CAP if flt.narrows else flt.limit
        hits = await cold_search(
            self._searchable(),
            flt.org_id,
            flt.agent_id,
            flt.query,
            limit=fetch,
            config=self.retrieval,
            deadline=deadline,
        )
        found = rank_search(hits, flt, time.time())
        _log_tenant_filtered(found.tenant_filtered, org_id=flt.org_id)
        return found


def _inputs(request: AssemblyRequest, nonce: str, now: float, got: Retrieved) -> AssemblyInputs:
    """The pipeline's inputs for what retrieval returned."""
    return AssemblyInputs(
        request=request,
        directive=got.directive,
        hot=got.hot,
        cold=got.cold,
        branches=got.branches,
        nonce=nonce,
        now=now,
        retrieval_ms=got.elapsed_ms,
    )


def _record(
    trace: CallTrace,
    got: Retrieved,
    starts: dict[BranchSource, float],
    timer: StageTimer,
    result: AssemblyResult,
) -> None:
    """Hand a traced call its branch and stage times, all on the perf_counter clock.

    A branch that never started (answered from the cache, skipped) starts and ends
    when retrieval did; one cut by the request wall ends where retrieval ended.
    """
    to_perf = time.perf_counter() - trio.current_time()
    retrieval_end = got.started + got.elapsed_ms / 1000.0
    for b in got.branches:
        start = starts.get(b.source, got.started)
        end = min(start + b.latency_ms / 1000.0, retrieval_end)
        trace.branch(b.source, b.status, b.latency_ms, b.detail, start + to_perf, end + to_perf)
    for name, start, end in timer.spans():
        trace.stage(name, start, end)
    trace.attributes["ibex.degradation_level"] = result.degradation_level
