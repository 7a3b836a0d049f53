"""The gRPC daemon: grpclib on the trio-asyncio loop, handlers crossing into Trio once.

Handlers are written against grpclib's `Stream` directly (not the generated
service base) because they need metadata, the peer certificate and the
caller's deadline. Each AssembleContext call crosses into Trio exactly once
with `trio_as_aio`; retrieval runs there under a wall derived from the
caller's remaining time, so the answer leaves before grpclib's own deadline.

Shutdown drains: stop listening, mark health NOT_SERVING, refuse new RPCs on
open connections with UNAVAILABLE, let in-flight calls finish within the grace
period, then close. `Server.close()` alone would cancel in-flight calls.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpclib.const
import grpclib.server
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.reflection.service import ServerReflection

from ibex import convert
from ibex import wire as pb
from ibex._proto.google_proto_descriptor_pool import default_google_proto_descriptor_pool
from ibex.assemble import Assembler, load_static, open_assembler
from ibex.auth import (
    Authenticator,
    AuthError,
    PermissionError_,
    check_bind_policy,
    check_principal,
    server_ssl_context,
    split_addr,
)
from ibex.config import Settings
from ibex.errors import InputError, TooLargeError
from ibex.logs import bind_request
from ibex.metrics import Metrics
from ibex.scoring import score_hit
from ibex.sdnotify import Notifier, run_watchdog
from ibex.sources.base import SourceError
from ibex.structs import AssemblyOptions
from ibex.validation import canonical_uuid

log = logging.getLogger("ibex.server")

SERVICE = "ibex.context.v1.ContextAssemblyService"
_PREFIX = f"/{SERVICE}/"
SEARCH_LIMIT_CAP = 100


async def recv_bounded(stream: grpclib.server.Stream[Any, Any], limit: int) -> Any:
    """The unary request message, refused before it is buffered when over `limit` bytes.

    grpclib reads a whole message before decoding it and has no size cap, so
    this reads the 5-byte gRPC prefix itself and checks the declared length
    first; HTTP/2 flow control keeps the unread body bounded by the window.
    It then does what `Stream.recv_message` does (decode, dispatch event).
    """
    inner = stream._stream
    meta = await inner.recv_data(5)
    if len(meta) < 5:
        raise GRPCError(Status.INVALID_ARGUMENT, "request: no message")
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "request: compressed messages are not supported")
    if length > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request: message of {length} bytes exceeds the {limit}-byte limit",
        )
    data = await inner.recv_data(length)
    if len(data) != length:
        raise GRPCError(Status.INVALID_ARGUMENT, "request: truncated message")
    try:
        message = stream._codec.decode(data, stream._recv_type)
    except Exception:
        raise GRPCError(Status.INVALID_ARGUMENT, "request: not a valid protobuf message") from None
    (message,) = await stream._dispatch.recv_message(message)
    stream._messages_received += 1
    inner.connection.messages_received += 1
    inner.connection.last_message_received = time.monotonic()
    return message


class ServerState:
    """Counters shared by the handlers of one process."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.loop_lag = 0.0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


class ContextService:
    """ContextAssemblyService over grpclib streams."""

    def __init__(
        self,
        assembler: Assembler,
        *,
        state: ServerState,
        metrics: Metrics | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.assembler = assembler
        self.settings = assembler.settings
        self.state = state
        self.metrics = metrics
        self.auth = authenticator or Authenticator(assembler.settings)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            _PREFIX + "AssembleContext": grpclib.const.Handler(
                self._wrap("AssembleContext", self.assemble_context),
                unary,
                pb.AssembleContextRequest,
                pb.AssembleContextResponse,
            ),
            _PREFIX + "SearchMemories": grpclib.const.Handler(
                self._wrap("SearchMemories", self.search_memories),
                unary,
                pb.SearchMemoriesRequest,
                pb.SearchMemoriesResponse,
            ),
            _PREFIX + "RecordMemoryFeedback": grpclib.const.Handler(
                self._wrap("RecordMemoryFeedback", self.record_memory_feedback),
                unary,
                pb.RecordMemoryFeedbackRequest,
                pb.RecordMemoryFeedbackResponse,
            ),
        }

    def _wrap(
        self, method: str, handler: Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]
    ) -> Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]:
        """Drain refusal, load shedding, authentication and status accounting."""

        async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
            t0 = time.perf_counter()
            code = "OK"
            try:
                if self.state.draining:
                    raise GRPCError(Status.UNAVAILABLE, "server is draining; retry elsewhere")
                if self.state.in_flight >= self.state.max_in_flight:
                    self._shed(f"overloaded: {self.state.in_flight} requests in flight")
                if self.state.loop_lag > self.settings.shed_lag:
                    # The loop is behind: admitted work would wait its turn past the
                    # caller's deadline, and new work only deepens the queue.
                    self._shed(f"overloaded: event loop {self.state.loop_lag * 1000:.1f}ms behind")
                remaining = stream.deadline.time_remaining() if stream.deadline else None
                if remaining is not None and remaining < self.settings.shed_remaining:
                    # Too little of the caller's time is left for retrieval to help:
                    # refusing now costs microseconds, working would only queue the
                    # next caller behind a certain deadline miss.
                    self._shed(f"overloaded: {remaining * 1000:.1f}ms of the deadline left")
                try:
                    peer_cert = stream.peer.cert() if self.auth.mtls else None
                    self.auth.authenticate(stream.metadata or {}, peer_cert)
                except AuthError as exc:
                    raise GRPCError(Status.UNAUTHENTICATED, str(exc)) from None
                self.state.enter()
                try:
                    await handler(stream)
                finally:
                    self.state.leave()
            except GRPCError as exc:
                code = exc.status.name
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception:
                code = "INTERNAL"
                log.exception("handler_failed", extra={"method": method})
                raise GRPCError(Status.INTERNAL, "internal error") from None
            finally:
                if self.metrics is not None:
                    self.metrics.observe_request(method, code, time.perf_counter() - t0)

        return run

    def _shed(self, why: str) -> NoReturn:
        if self.metrics is not None:
            self.metrics.shed()
        raise GRPCError(Status.RESOURCE_EXHAUSTED, why)

    # --- AssembleContext -----------------------------------------------------

    async def assemble_context(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        msg = await recv_bounded(stream, self.settings.max_message_bytes)
        try:
            request = self.assembler.check_request(convert.request_from_proto(msg))
            principal = msg.principal_context if msg.HasField("principal_context") else None
            check_principal(principal, request.org_id, request.agent_id)
        except TooLargeError as exc:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
        except InputError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        except PermissionError_ as exc:
            raise GRPCError(Status.PERMISSION_DENIED, str(exc)) from None
        remaining = stream.deadline.time_remaining() if stream.deadline else None
        if remaining is not None and remaining <= 0:
            raise GRPCError(Status.DEADLINE_EXCEEDED, "deadline already passed")
        try:
            result = await trio_asyncio.trio_as_aio(self._assemble_in_trio)(request, remaining)
        except TooLargeError as exc:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
        except InputError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        if self.metrics is not None:
            self.metrics.observe_assembly(result)
        await stream.send_initial_metadata(
            metadata={
                "x-ibex-degradation": result.degradation_level,
                "x-ibex-branches": convert.branches_header(result),
            }
        )
        await stream.send_message(convert.response_to_proto(result))

    async def _assemble_in_trio(self, request: Any, remaining: float | None) -> Any:
        deadline = None if remaining is None else trio.current_time() + remaining
        with bind_request(request.request_id, request.trace_id):
            return await self.assembler.assemble(request, deadline=deadline, validated=True)

    # --- SearchMemories ------------------------------------------------------

    async def search_memories(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        msg = await recv_bounded(stream, self.settings.max_message_bytes)
        try:
            org_id = canonical_uuid("org_id", msg.org_id)
            agent_id = canonical_uuid("agent_id", msg.agent_id)
        except InputError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        if not msg.query.strip():
            raise GRPCError(Status.INVALID_ARGUMENT, "query: is required")
        if len(msg.query.encode()) > self.settings.max_text_bytes:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "query: too large")
        if (
            msg.limit < 0
            or not math.isfinite(msg.min_similarity)
            or not (0.0 <= msg.min_similarity <= 1.0)
        ):
            raise GRPCError(
                Status.INVALID_ARGUMENT, "limit must be >= 0 and min_similarity in [0, 1]"
            )
        limit = min(msg.limit or 10, SEARCH_LIMIT_CAP)
        categories = set(msg.categories)
        # Tags come from the memory's optional `tags` key; a hit without tags never matches.
        tags = set(msg.tags)
        # Filters applied here would leave fewer than `limit` results: fetch the cap instead.
        fetch = SEARCH_LIMIT_CAP if categories or tags or msg.min_similarity > 0 else limit
        remaining = stream.deadline.time_remaining() if stream.deadline else None
        t0 = time.perf_counter()
        try:
            hits = await trio_asyncio.trio_as_aio(self._search_in_trio)(
                org_id, agent_id, msg.query, fetch, remaining
            )
        except SourceError as exc:
            raise GRPCError(Status.UNAVAILABLE, f"memory search failed: {exc}") from None
        now = time.time()
        memories = []
        for hit in hits:
            if hit.org_id.lower() != org_id or hit.agent_id.lower() != agent_id:
                log.warning("tenant_filter_dropped", extra={"count": 1, "org_id": org_id})
                continue
            if hit.similarity < msg.min_similarity:
                continue
            if categories and hit.category not in categories:
                continue
            if tags and tags.isdisjoint(hit.tags):
                continue
            scored = score_hit(hit, AssemblyOptions(), now)
            if scored is None:
                continue
            memories.append(
                pb.Memory(
                    id=hit.memory_id,
                    content=hit.content,
                    category=hit.category,
                    confidence=hit.confidence,
                    composite_score=scored.composite_score,
                    retrieval_count=hit.access_count or 0,
                    created_at=hit.created_at or "",
                )
            )
        memories.sort(key=lambda m: (-m.composite_score, m.id))
        await stream.send_message(
            pb.SearchMemoriesResponse(
                memories=memories[:limit],
                total_candidates=len(hits),
                search_time_ms=int((time.perf_counter() - t0) * 1000),
            )
        )

    async def _search_in_trio(
        self, org_id: str, agent_id: str, query: str, limit: int, remaining: float | None
    ) -> list[Any]:
        source = self.assembler.memory_source
        if source is None:
            raise SourceError("no memory source configured")
        timeout = self.settings.cold_timeout
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - self.settings.pipeline_headroom))
        with trio.move_on_after(timeout):
            return await source.cold(
                org_id, agent_id, query, limit=limit, min_confidence=self.settings.min_confidence
            )
        raise SourceError(f"no answer within {timeout * 1000:.0f}ms")

    # --- RecordMemoryFeedback ------------------------------------------------

    async def record_memory_feedback(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await recv_bounded(stream, self.settings.max_message_bytes)
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "RecordMemoryFeedback: the memory service offers no feedback endpoint yet",
        )


class Daemon:
    """One serving process: the gRPC server, health, reflection, drain."""

    def __init__(
        self, settings: Settings, *, metrics: Metrics | None = None, reuse_port: bool = False
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.reuse_port = reuse_port
        self.state = ServerState(settings.max_in_flight)
        self.health_status = ServiceStatus()
        self.server: grpclib.server.Server | None = None
        self.port: int | None = None

    def build_server(self, assembler: Assembler) -> grpclib.server.Server:
        service = ContextService(assembler, state=self.state, metrics=self.metrics)
        health = Health({service: [self.health_status]})
        services: list[Any] = [service, health]
        services = ServerReflection.extend(services, pool=default_google_proto_descriptor_pool)
        return grpclib.server.Server(services)

    async def serve(
        self,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
        notifier: Notifier | None = None,
        shutdown: trio.Event | None = None,
        sock: Any = None,
    ) -> None:
        """Run until SIGTERM/SIGINT (or `shutdown` is set), then drain. Call from Trio.

        Signals are caught from the first line: one that arrives while the
        catalog and tokenizers load is kept and honoured as soon as serving
        starts, so a stop during start-up is a clean, logged exit too.
        """
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await self._serve(task_status, notifier, shutdown, sock, signals)

    async def _serve(
        self,
        task_status: trio.TaskStatus[int],
        notifier: Notifier | None,
        shutdown: trio.Event | None,
        sock: Any,
        signals: Any,
    ) -> None:
        settings = self.settings
        warning = check_bind_policy(settings)
        if warning:
            log.warning("insecure_bind", extra={"detail": warning})
        ssl_ctx = server_ssl_context(settings)
        catalog, tokenizers = load_static(settings)
        notifier = notifier or Notifier.from_env()
        shutdown = shutdown if shutdown is not None else trio.Event()
        async with (
            trio_asyncio.open_loop(),
            open_assembler(settings, catalog=catalog, tokenizers=tokenizers) as assembler,
        ):
            if self.metrics is not None:
                self.metrics.set_token_cache_source(lambda: _cache_totals(tokenizers))
            server = self.build_server(assembler)
            self.server = server
            # Start-up objects (catalog, rank tables, modules) live for the process:
            # move them out of the collector's reach so a full collection cannot
            # stall the loop for tens of milliseconds inside a 5 ms branch budget.
            gc.collect()
            gc.freeze()
            host, port = split_addr(settings.grpc_addr)
            if sock is not None:
                await trio_asyncio.aio_as_trio(server.start)(sock=sock, ssl=ssl_ctx)
            else:
                await trio_asyncio.aio_as_trio(server.start)(
                    host, port, ssl=ssl_ctx, reuse_port=self.reuse_port or None
                )
            assert server._server is not None
            self.port = server._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            self.health_status.set(True)
            log.info(
                "serving",
                extra={
                    "addr": f"{host}:{self.port}",
                    "backend": assembler.backend,
                    "tls": ssl_ctx is not None,
                    "auth": Authenticator(settings).enabled,
                },
            )
            notifier.ready(f"serving on {host}:{self.port} ({assembler.backend})")
            task_status.started(self.port)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_watchdog, notifier)
                nursery.start_soon(watch_loop_lag, self.state)
                nursery.start_soon(_wait_signal, signals, shutdown)
                await shutdown.wait()
                notifier.stopping()
                notifier.status("draining")
                await self.drain(server)
                nursery.cancel_scope.cancel()
            log.info("stopped", extra={"in_flight": self.state.in_flight})

    async def drain(self, server: grpclib.server.Server) -> None:
        """Stop listening, refuse new RPCs, wait for in-flight ones, then close."""
        self.state.draining = True
        self.health_status.set(False)
        log.info("draining", extra={"in_flight": self.state.in_flight})
        if server._server is not None:
            server._server.close()  # stop accepting connections; existing ones stay
        with trio.move_on_after(self.settings.drain_grace) as scope:
            await trio_asyncio.aio_as_trio(self.state.idle.wait)()
        if scope.cancelled_caught:
            log.warning("drain_grace_expired", extra={"in_flight": self.state.in_flight})
        server.close()
        await trio_asyncio.aio_as_trio(server.wait_closed)()


LAG_PROBE_INTERVAL = 0.005
LAG_SMOOTHING = 0.7  # weight of the previous estimate at each probe


async def watch_loop_lag(state: ServerState, interval: float = LAG_PROBE_INTERVAL) -> None:
    """Keep `state.loop_lag` at how late a short asyncio sleep wakes up (smoothed).

    Under overload the loop spends its time parsing requests that cannot be
    served in time; every admitted request, and the Redis replies and
    cancellations it waits for, queue behind them on the asyncio side. The
    lateness of a timer there is that queue. Admission sheds while the
    smoothed lateness is above IBEX_CONTEXT_SHED_LAG_MS, which does not depend
    on requests getting through, and reopens a few probes after it clears.
    (The Trio side's timers stay punctual under the same load: they are the
    wrong probe.)
    """
    await trio_asyncio.aio_as_trio(_probe_asyncio_lag)(state, interval)


async def _probe_asyncio_lag(state: ServerState, interval: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)
        lag = max(0.0, loop.time() - start - interval)
        state.loop_lag = LAG_SMOOTHING * state.loop_lag + (1 - LAG_SMOOTHING) * lag


def _cache_totals(tokenizers: Any) -> tuple[int, int]:
    info = tokenizers.cache_info()
    return sum(i.hits for i in info.values()), sum(i.misses for i in info.values())


async def _wait_signal(signals: Any, shutdown: trio.Event) -> None:
    async for signum in signals:
        log.info("signal_received", extra={"signal": int(signum)})
        shutdown.set()
        return
