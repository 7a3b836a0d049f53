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
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

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
    Directive,
    MemoryHit,
    SearchRequest,
)
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.validation import RequestLimits, validate_request, validate_search
from ibex.assembly.xml_format import new_nonce
from ibex.errors import IbexError, SourceError
from ibex.service.dependencies import Dependency
from ibex.service.queues import WorkerThreads, default_threads
from ibex.sources.base import DirectiveSource, MemorySource, prefetch_directive
from ibex.sources.feedback_sender import FeedbackSink
from ibex.sources.retrieval import RetrievalConfig, Retrieved, cold_search, retrieve

if TYPE_CHECKING:
    from ibex.ops.otel_sdk import CallTrace

log = logging.getLogger(__name__)

# Text (characters) above which an assembly's counting runs in a worker thread, so
# no one call holds the loop for more than a few milliseconds: uncached tiktoken
# counts of CJK text run at thousands of characters per millisecond
# (`python -m benchmarks.code_costs`, docs/performance.md).
OFFLOAD_CHARS = 16 * 1024

# Seconds before the wall at which a call whose last branch still runs has its answer
# made as if the wall will cut that branch: more than the pipeline takes on a loaded
# loop (`python -m benchmarks.load.after_wall`, docs/performance.md), so the answer is
# ready when the wall passes; the branch still has until the wall to land.
SPECULATE_AHEAD = 0.003
# Seconds after a call of this process was cut at its wall during which calls make their
# answer before the wall. Waiting for that instant keeps a branch task parked, woken once
# more to end when the last branch lands in time; while no call is cut, the few that
# are get their answer made at the wall instead (`_EarlyAssemblyFeed.wall_reached`).
SPECULATE_AFTER_CUT = 2.0

Handoff = Callable[[AssemblyResult], None]


def _request_chars(request: AssemblyRequest) -> int:
    """Characters of the request's own text (known before retrieval)."""
    n = len(request.query) + sum(len(m.content) for m in request.recent_messages)
    return n + sum(len(t) for t in request.tool_schemas)


def _text_chars(inputs: AssemblyInputs) -> int:
    """Characters the pipeline may have to count for these inputs."""
    n = _request_chars(inputs.request)
    if inputs.directive is not None:
        n += len(inputs.directive.content)
    return n + sum(len(h.content) for h in inputs.hot) + sum(len(h.content) for h in inputs.cold)


def _log_tenant_filtered(count: int, **ids: str) -> None:
    """Hits of another tenant were dropped: the memory service answered out of scope."""
    if count:
        log.warning("tenant_filter_dropped", extra={"count": count, **ids})


class _EarlyAssemblyFeed:
    """Hands each branch that ends to the call's `EarlyAssembly` (a `BranchListener`).

    In the loop, synchronously, and bounded: the text handed to the early work
    stays within `budget` characters in all (what the loop may count for one
    call, `offload_chars`, less the request's own text), so it never holds the
    loop longer than a call whose whole pipeline runs on it. Past the budget,
    the rest is left to the pipeline (which then runs in a worker thread).
    An answer known before the branches started (a cached directive) is worked
    on when the first branch ends, so no branch starts later for it. Any failure but
    a kept refusal drops the early work: the pipeline then does it all itself.

    It is also the call's `WallListener` when `speculate` is given: while calls are
    being cut (`SPECULATE_AFTER_CUT`), `ahead` (`SPECULATE_AHEAD`) before the wall,
    with only the request's own branch still running, it makes the whole answer as
    if the wall will cut that branch (within the same budget); when the wall does,
    that answer (its timing facts filled in) is the call's, handed to `handoff` at
    once, while the cut branch unwinds. When the wall cuts a call that has no such
    answer (no call was cut shortly before, or another branch was still running
    before the wall), the first task the wall reaches makes it then, if the
    pipeline would run in the loop anyway, and hands it over the same way.
    """

    __slots__ = (
        "ahead",
        "answer",
        "assembly",
        "budget",
        "cut",
        "directive",
        "directive_known",
        "handoff",
        "inputs",
        "loop_chars",
        "speculate",
        "speculation",
    )

    ahead: float | None

    def __init__(
        self,
        assembly: EarlyAssembly,
        budget: int,
        inputs: Callable[[Retrieved], AssemblyInputs],
        speculate: Callable[[AssemblyInputs], Speculation] | None = None,
        handoff: Handoff | None = None,
        loop_chars: int = OFFLOAD_CHARS,
    ) -> None:
        self.assembly: EarlyAssembly | None = assembly
        self.budget = budget
        self.loop_chars = loop_chars  # text above which the pipeline runs in a worker thread
        self.directive: Directive | None = None
        # The directive branch has answered and its fixed sections are not counted yet.
        self.directive_known = False
        self.ahead = SPECULATE_AHEAD
        self.inputs = inputs
        self.speculate = speculate
        self.speculation: Speculation | None = None
        self.handoff = handoff
        # The answer made before the wall, and the retrieval it answers.
        self.answer: tuple[Retrieved, AssemblyResult] | None = None
        self.cut = False  # the wall cut a branch of this call

    def before_wall(self, got: Retrieved) -> None:
        if self.assembly is None or self.budget < 0 or self.speculate is None:
            return
        try:
            self.speculation = self.speculate(self.inputs(got))
        except IbexError:
            pass  # a refusal: the pipeline raises it at the wall, where it always has
        except Exception:
            log.exception("early_assembly_failed")

    def wall_reached(self, got: Retrieved) -> None:
        self.cut = True
        try:
            inputs = self.inputs(got)
            speculation = self.speculation
            if speculation is not None and speculation.matches(inputs):
                result = speculation.answer(inputs)
            elif self._may_make(inputs):
                # Not made before the wall (a branch other than the last one was still
                # running then): the pipeline runs here, in the first task the wall
                # reached, as it would once the cut branches had unwound.
                assert self.speculate is not None
                result = self.speculate(inputs).result
            else:
                return
            self.answer = (got, result)
            if self.handoff is not None:
                self.handoff(result)
        except IbexError:
            pass  # a refusal: the pipeline raises it after retrieval, where it always has
        except Exception:
            log.exception("early_assembly_failed")

    def _may_make(self, inputs: AssemblyInputs) -> bool:
        """The whole answer may be made at the wall, in the loop: the pipeline would run
        there too (its text within the loop's budget, no worker thread)."""
        return (
            self.assembly is not None
            and self.speculate is not None
            and self.budget >= 0
            and _text_chars(inputs) <= self.loop_chars
        )

    def answered_at_start(self, source: BranchSource, value: Any) -> None:
        if source == "directive":
            self.directive, self.directive_known = value, True

    def branch_ended(self, source: BranchSource, value: Any) -> None:
        if self.assembly is None:
            return
        try:
            if source == "directive":
                self.directive, self.directive_known = value, True
            self._fixed()
            if source != "directive" and value:
                self._hits(source, value)
        except Exception:
            log.exception("early_assembly_failed")
            self.assembly = None

    def _spend(self, chars: int) -> bool:
        if chars > self.budget:
            self.budget = -1  # over: the pipeline goes to a thread, and does the rest there
            return False
        self.budget -= chars
        return True

    def _fixed(self) -> None:
        assembly = self.assembly
        if assembly is None or not self.directive_known:
            return
        self.directive_known = False  # once
        chars = len(self.directive.content) if self.directive is not None else 0
        if self._spend(chars):
            assembly.directive(self.directive)

    def _hits(self, source: BranchSource, hits: list[MemoryHit]) -> None:
        assembly = self.assembly
        if assembly is None or assembly.refused or source == "directive":
            return
        if self._spend(sum(len(h.content) for h in hits)):
            assembly.hits(source, hits)


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
        # its last branch (`_EarlyAssemblyFeed`), while calls are being cut
        # (`SPECULATE_AFTER_CUT`); None: only at the wall.
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
        return _request_chars(request) > self.offload_chars

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
        the wall (`_EarlyAssemblyFeed`), the same as the pipeline would make then, or
        made at the wall when it was not; it is handed to `handoff` at the wall, before
        the cut branches have unwound, and returned once they have. Not for a traced
        call (its stage spans time the pipeline at the wall).
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
        early: _EarlyAssemblyFeed | None,
    ) -> AssemblyResult:
        """The pure pipeline over what retrieval returned: in the loop, or in a worker
        thread when the caller holds one or the text is too much for the loop."""
        run = functools.partial(
            self._assemble, inputs, timer, early.assembly if early is not None else None
        )
        if thread_held:
            return await self.threads.run_held(run)
        if _text_chars(inputs) <= self.offload_chars:
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
    ) -> _EarlyAssemblyFeed | None:
        """The call's early work, or None when its own text already sends its pipeline
        to a worker thread (or the request is one the pipeline will refuse at once).
        With `speculate`, it makes the answer before the wall too (`_EarlyAssemblyFeed`)."""
        budget = self.offload_chars - _request_chars(request)
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
        feed = _EarlyAssemblyFeed(
            assembly,
            budget,
            functools.partial(_inputs, request, nonce, now),
            functools.partial(self._speculate, assembly) if speculate else None,
            handoff,
            self.offload_chars,
        )
        cut_recently = trio.current_time() - self.last_cut < SPECULATE_AFTER_CUT
        feed.ahead = self.speculate_ahead if cut_recently else None
        return feed

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
