"""ContextAssemblyService handlers: decode, call the core or a source, encode.

Handlers are written against grpclib's `Stream` directly (not the generated
service base) because they need metadata, the peer certificate and the
caller's deadline. The deadline is the edge's `CallDeadline`, read once from
the call's HEADERS; the admission ticket carries it, and the Trio side converts
it to its clock once (`CallDeadline.on_trio_clock`). Each call crosses into
Trio exactly once (`in_trio`; `answer_in_trio`, whose answer is written from the
Trio side as soon as it is known); retrieval runs there under a wall derived from
the caller's remaining time, so the answer leaves before grpclib's own
deadline (which counts from the handler's start, later). Errors
are `IbexError`s and become a gRPC status in one place (`_wrap`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.exceptions import StreamClosedError

from ibex.assembly.candidates import SearchFilter, SearchResult
from ibex.assembly.feedback_rules import MAX_FEEDBACK_IDS, Feedback, validate_feedback
from ibex.assembly.structs import AssemblyRequest, AssemblyResult
from ibex.assembly.validation import MAX_SEARCH_CATEGORIES, MAX_SEARCH_TAGS
from ibex.errors import (
    DeadlineError,
    IbexError,
    InputError,
    Overloaded,
    PermissionDenied,
    Unavailable,
)
from ibex.ops.branch_errors import BranchErrors
from ibex.ops.logs import bind_request
from ibex.ops.metrics import Metrics
from ibex.service import convert, pb
from ibex.service.admission import Admission, Ticket
from ibex.service.assembler import Assembler
from ibex.service.auth import Authenticator, Caller
from ibex.service.budgets import Reservation
from ibex.service.edge.calls import call_deadline, caller_authenticated, handler_started
from ibex.service.edge.crossing import Reply, answer_in_trio, in_trio, raise_swallowed_cancel
from ibex.service.edge.status import grpc_error
from ibex.service.edge.stream_reads import connection_of, recv_bounded, request_complete
from ibex.service.edge.unary_reply import reply_finished
from ibex.service.edge.wire_counts import Rules, check_counts, request_rules
from ibex.service.handlers_config import EdgeConfig as EdgeConfig
from ibex.sources.feedback_sender import FeedbackRejected, Sent, send_feedback

if TYPE_CHECKING:
    from ibex.ops.otel_sdk import CallTrace, Tracing

log = logging.getLogger(__name__)

SERVICE = "ibex.context.v1.ContextAssemblyService"
_PREFIX = f"/{SERVICE}/"
# Kept back from a feedback call's deadline to encode and send the answer.
FEEDBACK_HEADROOM = 0.002

Handler = Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]
# Each call's request bytes in flight, by connection and caller (released when it ends).
_RESERVED: weakref.WeakKeyDictionary[grpclib.server.Stream[Any, Any], Reservation] = (
    weakref.WeakKeyDictionary()
)
# Each call's authenticated caller (with its org scope), set by `_wrap` before the handler.
_CALLERS: weakref.WeakKeyDictionary[grpclib.server.Stream[Any, Any], Caller] = (
    weakref.WeakKeyDictionary()
)
_NOBODY = Caller("unauthenticated", frozenset())
# A method's handler: the stream and, when tracing is on, the call's trace.
Method = Callable[[grpclib.server.Stream[Any, Any], "CallTrace | None"], Awaitable[None]]
METHODS = frozenset({"AssembleContext", "SearchMemories", "RecordMemoryFeedback"})


def method_label(path: str) -> str:
    """A call's `:path` as the metrics' method label: the short name, or "other"."""
    if path.startswith(_PREFIX) and (name := path[len(_PREFIX) :]) in METHODS:
        return name
    return "other"


@dataclass(eq=False)  # hashed by identity: Health keys its statuses by the service
class ContextService:
    """ContextAssemblyService over grpclib streams."""

    assembler: Assembler
    _: KW_ONLY
    admission: Admission
    metrics: Metrics
    authenticator: Authenticator
    config: EdgeConfig = field(default_factory=EdgeConfig)
    tracing: Tracing | None = None
    branch_errors: BranchErrors | None = None  # failed branches, logged as a summary

    def __post_init__(self) -> None:
        # Each request's repeated fields counted on the wire before it is decoded.
        limits = self.assembler.limits
        self._assemble_rules = request_rules(
            pb.AssembleContextRequest,
            {
                "recent_messages": (limits.max_history_messages, "messages"),
                "tool_schemas": (limits.max_tool_schemas, "entries"),
            },
        )
        self._search_rules = request_rules(
            pb.SearchMemoriesRequest,
            {
                "categories": (MAX_SEARCH_CATEGORIES, "entries"),
                "tags": (MAX_SEARCH_TAGS, "entries"),
            },
        )
        self._feedback_rules = request_rules(
            pb.RecordMemoryFeedbackRequest, {"memory_ids": (MAX_FEEDBACK_IDS, "ids")}
        )

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        rpcs: list[tuple[str, Method, Any, Any]] = [
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

    def _wrap(self, method: str, handler: Method) -> Handler:
        """Admission, authentication, the one error-to-status mapping, accounting, the span."""

        async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
            handler_started(stream)
            t0 = time.perf_counter()
            code = "OK"
            call = None
            try:
                self.admission.check_open()
                auth = self.authenticator
                peer_cert = stream.peer.cert() if auth.mtls else None
                caller = _CALLERS[stream] = auth.caller(stream.metadata or {}, peer_cert)
                _RESERVED[stream] = self.admission.reservation(
                    connection_of(stream), caller.identity if auth.enabled else ""
                )
                caller_authenticated(stream)
                if self.tracing is not None:
                    # Traced only once authenticated: a stranger's call exports no span,
                    # and its `traceparent` cannot put our spans into a trace it chose.
                    call = self.tracing.call(SERVICE, method, stream.metadata, t0)
                await handler(stream, call)
                raise_swallowed_cancel()
            except IbexError as exc:
                code = exc.status
                if isinstance(exc, DeadlineError):
                    log.info(
                        "deadline_missed", extra={**_call_fields(method, call), "detail": str(exc)}
                    )
                raise grpc_error(exc) from None
            except GRPCError as exc:
                code = exc.status.name
                raise
            except asyncio.CancelledError:
                # grpclib cancels the handler when the caller's deadline passes (or the
                # caller cancels): a deadline miss is counted as such, not as an error.
                # A reply written whole from the Trio side before the handler woke has
                # reached the caller: that call is answered, not missed.
                code = "CANCELLED"
                if reply_finished(stream):
                    code = "OK"
                elif call_deadline(stream).expired(time.monotonic()):
                    code = "DEADLINE_EXCEEDED"
                    log.info(
                        "deadline_missed",
                        extra={**_call_fields(method, call), "detail": "cancelled"},
                    )
                raise
            except StreamClosedError:
                # The caller reset the stream (gave up, usually at its deadline) while
                # the answer was being made: nobody to answer, and not our failure.
                code = "CANCELLED"
                log.info("caller_gone", extra={**_call_fields(method, call)})
                raise_swallowed_cancel()  # grpclib saw the reset too: end as it expects
                raise GRPCError(Status.CANCELLED, "the caller reset the stream") from None
            except Exception:
                code = "INTERNAL"
                log.exception("handler_failed", extra={**_call_fields(method, call)})
                raise GRPCError(Status.INTERNAL, "internal error") from None
            finally:
                reservation = _RESERVED.pop(stream, None)
                if reservation is not None:
                    reservation.release()
                _CALLERS.pop(stream, None)
                self.metrics.observe_request(method, code, time.perf_counter() - t0)
                if call is not None:
                    _finish_trace(call, code)

        return run

    # --- AssembleContext -----------------------------------------------------

    async def _receive(
        self, stream: grpclib.server.Stream[Any, Any], rules: Rules
    ) -> tuple[Any, int]:
        """The request message and its bytes, read within `read_timeout`: a stalled stream
        holds nothing. Its repeated fields are counted against `rules` before it is
        decoded, so an over-count request is refused before it becomes objects.

        Its bytes count toward the in-flight bytes as they arrive, one look-ahead step
        ahead (`recv_next`), against the caller's and the connection's shares. Usually
        the request arrived whole with its HEADERS: then the read cannot stall and arms
        no timer (a timer costs a loop crossing to set and one to cancel).
        """

        # Counted against the connection's and the caller's shares; released when the call
        # ends (`_wrap`).
        reservation = _RESERVED.get(stream)
        if reservation is None:
            reservation = _RESERVED[stream] = self.admission.reservation(connection_of(stream))
        reserve = reservation.grow

        def check(data: bytes) -> None:
            check_counts(data, rules)

        limit = self.config.max_message_bytes
        if request_complete(stream):
            return await recv_bounded(stream, limit, reserve, check)
        try:
            async with asyncio.timeout(self.admission.config.read_timeout):
                return await recv_bounded(stream, limit, reserve, check)
        except TimeoutError:
            raise DeadlineError(
                f"request: not received within {self.admission.config.read_timeout:g}s"
            ) from None

    async def assemble_context(
        self, stream: grpclib.server.Stream[Any, Any], call: CallTrace | None = None
    ) -> None:
        msg, _ = await self._receive(stream, self._assemble_rules)  # bytes counted there
        # The trace the log lines carry: the RPC span's when traced, else the request's field.
        trace_id = "" if call is None else call.open(msg.trace_id, msg.span_id)
        caller = _caller(stream)
        with self.admission.admitted(call_deadline(stream)) as ticket:
            request = self.assembler.check_request(convert.request_from_proto(msg))
            self.authenticator.authorize(caller, request.org_id, request.agent_id, _principal(msg))
            key = caller.fairness_key(request.org_id)
            self.assembler.prefetch(request)
            await answer_in_trio(
                stream,
                _reply,
                self._assemble_in_trio,
                request,
                ticket,
                key,
                trace_id,
                call,
                sending=self._sending,
            )

    def _sending(self, result: AssemblyResult) -> None:
        """An answer is sent: its assembly is counted."""
        self.metrics.observe_assembly(result)
        if self.branch_errors is not None:
            self.branch_errors.observe(result.branches)

    async def _assemble_in_trio(
        self,
        request: AssemblyRequest,
        ticket: Ticket,
        key: str,
        trace_id: str = "",
        call: CallTrace | None = None,
        hand: Callable[[AssemblyResult], None] | None = None,
    ) -> AssemblyResult:
        """`key` is the call's share of the slots (`Caller.fairness_key`); `hand` gets an
        answer made before the wall as soon as the wall passes."""
        threads = self.assembler.threads if self.assembler.needs_thread(request) else None
        async with self.admission.slot(ticket, key, threads) as thread_held:
            arrived, deadline = ticket.deadline.on_trio_clock()
            with bind_request(request.request_id, trace_id or request.trace_id):
                return await self.assembler.assemble_checked(
                    request,
                    deadline=deadline,
                    arrived=arrived,
                    thread_held=thread_held,
                    trace=call,
                    retrieving=self.admission.retrieving_for(ticket),
                    handoff=hand,
                )

    # --- SearchMemories ------------------------------------------------------

    async def search_memories(
        self, stream: grpclib.server.Stream[Any, Any], call: CallTrace | None = None
    ) -> None:
        msg, _ = await self._receive(stream, self._search_rules)  # bytes counted there
        caller = _caller(stream)
        with self.admission.admitted(call_deadline(stream)) as ticket:
            flt = self.assembler.check_search(convert.search_from_proto(msg))
            self.authenticator.authorize(caller, flt.org_id, flt.agent_id, _principal(msg))
            t0 = time.perf_counter()
            found = await in_trio(
                self._search_in_trio, flt, ticket, caller.fairness_key(flt.org_id)
            )
            elapsed_ms = int((time.perf_counter() - t0) * 1000)
            await stream.send_message(convert.search_to_proto(found, elapsed_ms))

    async def _search_in_trio(self, flt: SearchFilter, ticket: Ticket, key: str) -> SearchResult:
        async with self.admission.slot(ticket, key):
            _, deadline = ticket.deadline.on_trio_clock()
            return await self.assembler.search(flt, deadline=deadline)

    # --- RecordMemoryFeedback ------------------------------------------------

    async def record_memory_feedback(
        self, stream: grpclib.server.Stream[Any, Any], call: CallTrace | None = None
    ) -> None:
        """Validate, then forward to the memory service (one retry, same idempotency key).

        `success` is true only when the memory service confirmed; `updates` are
        what it returned. The caller's scope and the optional principal are
        checked before anything is sent: an org outside the scope is refused
        the same way whatever ids the request names, and within it the memory
        service leaves out unknown ids and other orgs' ids alike.
        """
        outcome = "error"
        try:
            msg, _ = await self._receive(stream, self._feedback_rules)  # bytes counted there
            with self.admission.admitted(call_deadline(stream)) as ticket:
                fb = validate_feedback(
                    org_id=msg.org_id,
                    memory_ids=msg.memory_ids,
                    feedback=msg.feedback,
                    session_id=msg.session_id,
                    trace_id=msg.trace_id,
                )
                self.authenticator.authorize(_caller(stream), fb.org_id, None, _principal(msg))
                sent = await in_trio(self._feedback_in_trio, fb, ticket)
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
        except PermissionDenied:
            outcome = "denied"
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
        _, deadline = ticket.deadline.on_trio_clock()
        with bind_request(trace_id=fb.trace_id):
            return await send_feedback(
                sink,
                fb,
                deadline=deadline,
                default_timeout=self.config.feedback_timeout,
                headroom=FEEDBACK_HEADROOM,
                on_retry=self.metrics.feedback_retries.inc,
            )


def _reply(result: AssemblyResult) -> Reply:
    """An answer's headers and message."""
    headers = {
        "x-ibex-degradation": result.degradation_level,
        "x-ibex-branches": convert.branches_header(result),
    }
    return headers, convert.response_to_proto(result)


def _caller(stream: grpclib.server.Stream[Any, Any]) -> Caller:
    """The call's authenticated caller, set by `_wrap`; without one, a caller that may act
    for no org (fail closed)."""
    return _CALLERS.get(stream, _NOBODY)


def _principal(msg: Any) -> Any:
    """The request's `principal_context`, or None when the caller sent none."""
    return msg.principal_context if msg.HasField("principal_context") else None


def _call_fields(method: str, call: CallTrace | None) -> dict[str, str]:
    """A call's own log fields: its method and, when traced, its trace id."""
    return {"method": method} if call is None else {"method": method, "trace_id": call.open()}


def _finish_trace(call: CallTrace, code: str) -> None:
    """End the call's span; a tracing fault is logged, never turned into the call's status."""
    try:
        call.finish(code)
    except Exception:
        log.exception("trace_failed")
