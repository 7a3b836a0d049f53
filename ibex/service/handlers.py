"""ContextAssemblyService handlers: decode, call the core or a source, encode.

Handlers are written against grpclib's `Stream` directly (not the generated
service base) because they need metadata, the peer certificate and the
caller's deadline. Each call crosses into Trio exactly once with
`trio_as_aio`; retrieval runs there under a wall derived from the caller's
remaining time, so the answer leaves before grpclib's own deadline. Errors
are `IbexError`s and become a gRPC status in one place (`_wrap`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import grpclib.server
import msgspec
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.exceptions import StreamClosedError

from ibex.assembly.candidates import MAX_MEMORIES_HARD_CAP, SearchFilter, rank_search
from ibex.assembly.feedback import Feedback, validate_feedback
from ibex.assembly.structs import AssemblyRequest, AssemblyResult, MemoryHit
from ibex.assembly.validation import canonical_uuid
from ibex.errors import (
    DeadlineError,
    IbexError,
    InputError,
    OverLimitError,
    Overloaded,
    SourceError,
    Unavailable,
)
from ibex.ops.logs import bind_request
from ibex.ops.metrics import Metrics
from ibex.service import convert
from ibex.service import wire as pb
from ibex.service.admission import Admission, Ticket
from ibex.service.assembler import Assembler
from ibex.service.auth import Authenticator, check_principal
from ibex.service.grpc_shim import (
    arrival,
    caller_authenticated,
    handler_started,
    recv_bounded,
    request_complete,
)
from ibex.service.status import grpc_error
from ibex.sources.feedback import FeedbackRejected, Sent, send_feedback

log = logging.getLogger(__name__)

SERVICE = "ibex.context.v1.ContextAssemblyService"
_PREFIX = f"/{SERVICE}/"
SEARCH_DEFAULT_LIMIT = 10
# Kept back from a feedback call's deadline to encode and send the answer.
FEEDBACK_HEADROOM = 0.002

Handler = Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]
# Request bytes each call's `_receive` counted in flight (released when the call ends).
_RESERVED: weakref.WeakKeyDictionary[grpclib.server.Stream[Any, Any], int] = (
    weakref.WeakKeyDictionary()
)
METHODS = frozenset({"AssembleContext", "SearchMemories", "RecordMemoryFeedback"})


def method_label(path: str) -> str:
    """A call's `:path` as the metrics' method label: the short name, or "other"."""
    if path.startswith(_PREFIX) and (name := path[len(_PREFIX) :]) in METHODS:
        return name
    return "other"


class EdgeConfig(msgspec.Struct, frozen=True):
    """What the handlers need beyond the assembler; the settings table's defaults equal these."""

    max_message_bytes: int = 4 * 1024 * 1024
    max_text_bytes: int = 1024 * 1024
    # RecordMemoryFeedback's time for both attempts when the caller sets no deadline.
    feedback_timeout: float = 2.0


class ContextService:
    """ContextAssemblyService over grpclib streams."""

    def __init__(
        self,
        assembler: Assembler,
        *,
        admission: Admission,
        metrics: Metrics,
        authenticator: Authenticator,
        config: EdgeConfig | None = None,
    ) -> None:
        self.assembler = assembler
        self.admission = admission
        self.metrics = metrics
        self.auth = authenticator
        self.config = config or EdgeConfig()

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        rpcs: list[tuple[str, Handler, Any, Any]] = [
            (
                "AssembleContext",
                self.assemble_context,
                pb.AssembleContextRequest,
                pb.AssembleContextResponse,
            ),
            (
                "SearchMemories",
                self.search_memories,
                pb.SearchMemoriesRequest,
                pb.SearchMemoriesResponse,
            ),
            (
                "RecordMemoryFeedback",
                self.record_memory_feedback,
                pb.RecordMemoryFeedbackRequest,
                pb.RecordMemoryFeedbackResponse,
            ),
        ]
        return {
            _PREFIX + name: grpclib.const.Handler(self._wrap(name, fn), unary, req, resp)
            for name, fn, req, resp in rpcs
        }

    def _wrap(self, method: str, handler: Handler) -> Handler:
        """Admission, authentication, the one error-to-status mapping, accounting."""

        async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
            handler_started(stream)
            t0 = time.perf_counter()
            code = "OK"
            try:
                self.admission.check_open()
                peer_cert = stream.peer.cert() if self.auth.mtls else None
                self.auth.authenticate(stream.metadata or {}, peer_cert)
                caller_authenticated(stream)
                await handler(stream)
                if _cancel_swallowed():
                    raise asyncio.CancelledError
            except IbexError as exc:
                code = exc.status
                if isinstance(exc, DeadlineError):
                    log.info("deadline_missed", extra={"method": method, "detail": str(exc)})
                raise grpc_error(exc) from None
            except GRPCError as exc:
                code = exc.status.name
                raise
            except asyncio.CancelledError:
                # grpclib cancels the handler when the caller's deadline passes (or the
                # caller cancels): a deadline miss is counted as such, not as an error.
                code = "CANCELLED"
                if stream.deadline is not None and stream.deadline.time_remaining() <= 0:
                    code = "DEADLINE_EXCEEDED"
                    log.info("deadline_missed", extra={"method": method, "detail": "cancelled"})
                raise
            except StreamClosedError:
                # The caller reset the stream (gave up, usually at its deadline) while
                # the answer was being made: nobody to answer, and not our failure.
                code = "CANCELLED"
                log.info("caller_gone", extra={"method": method})
                if _cancel_swallowed():  # grpclib saw the reset too: end as it expects
                    raise asyncio.CancelledError from None
                raise GRPCError(Status.CANCELLED, "the caller reset the stream") from None
            except Exception:
                code = "INTERNAL"
                log.exception("handler_failed", extra={"method": method})
                raise GRPCError(Status.INTERNAL, "internal error") from None
            finally:
                self.admission.release_bytes(_RESERVED.pop(stream, 0))
                self.metrics.observe_request(method, code, time.perf_counter() - t0)

        return run

    # --- AssembleContext -----------------------------------------------------

    async def _receive(self, stream: grpclib.server.Stream[Any, Any]) -> tuple[Any, int]:
        """The request message and its bytes, read within `read_timeout`: a stalled stream
        holds nothing.

        Its bytes count toward the in-flight bytes from its length prefix on, so a slow
        body is counted while it arrives. Usually the request arrived whole with its
        HEADERS: then the read cannot stall and arms no timer (a timer costs a loop
        crossing to set and one to cancel).
        """

        def reserve(size: int) -> None:
            self.admission.reserve_bytes(size)
            _RESERVED[stream] = size  # released when the call ends (`_wrap`)

        if request_complete(stream):
            return await recv_bounded(stream, self.config.max_message_bytes, reserve)
        try:
            async with asyncio.timeout(self.admission.config.read_timeout):
                return await recv_bounded(stream, self.config.max_message_bytes, reserve)
        except TimeoutError:
            raise DeadlineError(
                f"request: not received within {self.admission.config.read_timeout:g}s"
            ) from None

    async def assemble_context(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        msg, _ = await self._receive(stream)  # its bytes are counted by `_receive`
        with self.admission.admitted(*_timing(stream)) as ticket:
            request = self.assembler.check_request(convert.request_from_proto(msg))
            principal = msg.principal_context if msg.HasField("principal_context") else None
            check_principal(principal, request.org_id, request.agent_id)
            result = await trio_asyncio.trio_as_aio(self._assemble_in_trio)(request, ticket)
            await self._send_assembly(stream, result)

    async def _send_assembly(
        self, stream: grpclib.server.Stream[Any, Any], result: AssemblyResult
    ) -> None:
        self.metrics.observe_assembly(result)
        await stream.send_initial_metadata(
            metadata={
                "x-ibex-degradation": result.degradation_level,
                "x-ibex-branches": convert.branches_header(result),
            }
        )
        await stream.send_message(convert.response_to_proto(result))

    async def _assemble_in_trio(self, request: AssemblyRequest, ticket: Ticket) -> AssemblyResult:
        threads = self.assembler.threads if self.assembler.needs_thread(request) else None
        async with self.admission.slot(ticket, request.org_id, threads) as thread_held:
            now, trio_now = time.monotonic(), trio.current_time()
            remaining = ticket.remaining(now)
            deadline = None if remaining is None else trio_now + remaining
            arrived = trio_now - (now - ticket.arrived)
            with bind_request(request.request_id, request.trace_id):
                return await self.assembler.assemble(
                    request,
                    deadline=deadline,
                    arrived=arrived,
                    validated=True,
                    thread_held=thread_held,
                )

    # --- SearchMemories ------------------------------------------------------

    async def search_memories(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        msg, _ = await self._receive(stream)  # its bytes are counted by `_receive`
        with self.admission.admitted(*_timing(stream)) as ticket:
            flt = self._search_filter(msg)
            fetch = MAX_MEMORIES_HARD_CAP if flt.narrows else flt.limit
            t0 = time.perf_counter()
            hits = await trio_asyncio.trio_as_aio(self._search_in_trio)(
                flt.org_id, flt.agent_id, msg.query, fetch, ticket
            )
            found = rank_search(hits, flt, time.time())
            if found.tenant_filtered:
                log.warning(
                    "tenant_filter_dropped",
                    extra={"count": found.tenant_filtered, "org_id": flt.org_id},
                )
            memories = [
                pb.Memory(
                    id=h.hit.memory_id,
                    content=h.hit.content,
                    category=h.hit.category,
                    confidence=h.hit.confidence,
                    composite_score=h.score,
                    retrieval_count=h.hit.access_count or 0,
                    created_at=h.hit.created_at or "",
                )
                for h in found.hits
            ]
            await stream.send_message(
                pb.SearchMemoriesResponse(
                    memories=memories,
                    total_candidates=found.own_candidates,
                    search_time_ms=int((time.perf_counter() - t0) * 1000),
                )
            )

    def _search_filter(self, msg: Any) -> SearchFilter:
        org_id = canonical_uuid("org_id", msg.org_id)
        agent_id = canonical_uuid("agent_id", msg.agent_id)
        if not msg.query.strip():
            raise InputError("query", "is required")
        if len(msg.query.encode()) > self.config.max_text_bytes:
            raise OverLimitError("query", f"exceeds {self.config.max_text_bytes} bytes")
        if (
            msg.limit < 0
            or not math.isfinite(msg.min_similarity)
            or not (0.0 <= msg.min_similarity <= 1.0)
        ):
            raise InputError("limit", "must be >= 0 and min_similarity in [0, 1]")
        return SearchFilter(
            org_id=org_id,
            agent_id=agent_id,
            limit=min(msg.limit or SEARCH_DEFAULT_LIMIT, MAX_MEMORIES_HARD_CAP),
            min_similarity=msg.min_similarity,
            categories=frozenset(msg.categories),
            tags=frozenset(msg.tags),
        )

    async def _search_in_trio(
        self, org_id: str, agent_id: str, query: str, limit: int, ticket: Ticket
    ) -> list[MemoryHit]:
        source = self.assembler.memory_source
        if source is None:
            raise SourceError("memory search failed: no memory source configured")
        retrieval = self.assembler.retrieval
        async with self.admission.slot(ticket, org_id):
            timeout = retrieval.cold_timeout
            remaining = ticket.remaining(time.monotonic())
            if remaining is not None:
                timeout = min(timeout, max(0.0, remaining - retrieval.pipeline_headroom))
            with trio.move_on_after(timeout):
                try:
                    return await source.cold(
                        org_id,
                        agent_id,
                        query,
                        limit=limit,
                        min_confidence=retrieval.min_confidence,
                    )
                except SourceError as exc:
                    raise SourceError(f"memory search failed: {exc}") from None
            raise SourceError(f"memory search failed: no answer within {timeout * 1000:.0f}ms")

    # --- RecordMemoryFeedback ------------------------------------------------

    async def record_memory_feedback(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """Validate, then forward to the memory service (one retry, same idempotency key).

        `success` is true only when the memory service confirmed; `updates` are
        what it returned. The request has no agent and no principal: the
        caller's authentication (bearer token / mTLS, in `_wrap`) is the
        authorisation, as for SearchMemories.
        """
        outcome = "error"
        try:
            msg, size = await self._receive(stream)
            with self.admission.admitted(*_timing(stream), size) as ticket:
                fb = validate_feedback(
                    org_id=msg.org_id,
                    memory_ids=msg.memory_ids,
                    feedback=msg.feedback,
                    session_id=msg.session_id,
                    trace_id=msg.trace_id,
                )
                sent = await trio_asyncio.trio_as_aio(self._feedback_in_trio)(fb, ticket)
                response = pb.RecordMemoryFeedbackResponse(success=True)
                for u in sent.updates:
                    response.updates.add(
                        memory_id=u.memory_id,
                        previous_score=u.previous_score,
                        new_score=u.new_score,
                    )
                outcome = "recorded"
                await stream.send_message(response)
        except FeedbackRejected:
            outcome = "rejected"
            raise
        except InputError:
            outcome = "invalid"
            raise
        except Unavailable:
            outcome = "unavailable"
            raise
        except DeadlineError:
            outcome = "deadline"
            raise
        except Overloaded:
            outcome = "shed"
            raise
        finally:
            self.metrics.observe_feedback(outcome)

    async def _feedback_in_trio(self, fb: Feedback, ticket: Ticket) -> Sent:
        sink = self.assembler.feedback_sink
        if sink is None:
            raise Unavailable("feedback: no memory service configured")
        remaining = ticket.remaining(time.monotonic())
        deadline = None if remaining is None else trio.current_time() + remaining
        with bind_request(trace_id=fb.trace_id):
            return await send_feedback(
                sink,
                fb,
                deadline=deadline,
                default_timeout=self.config.feedback_timeout,
                headroom=FEEDBACK_HEADROOM,
                on_retry=self.metrics.feedback_retries.inc,
            )


def _cancel_swallowed() -> bool:
    """True when grpclib cancelled this handler's task but the cancel never surfaced.

    grpclib cancels the task at the caller's deadline or reset. When the Trio side
    has already passed its last checkpoint, trio-asyncio delivers its result
    anyway and the cancel is lost; finishing normally then makes grpclib log
    "Failed to handle cancellation" at error level. Ending cancelled makes it a
    deadline miss (or a caller gone), as it is.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _timing(stream: grpclib.server.Stream[Any, Any]) -> tuple[float, float | None]:
    """When the call arrived and how much of the caller's deadline is left now.

    grpclib's deadline counts from when the handler started; the caller's counts
    from when it sent the call, so the wait before the handler ran is taken off.
    """
    now = time.monotonic()
    arrived = arrival(stream)
    if arrived is None or arrived > now:
        arrived = now
    if stream.deadline is None:
        return arrived, None
    return arrived, stream.deadline.time_remaining() - (now - arrived)
