"""One serving process: grpclib on a trio-asyncio loop, health, reflection, drain.

Shutdown drains: stop listening, mark health NOT_SERVING, send every open
connection GOAWAY (grpc-go's two-step form: the client moves new calls to
another connection, see `connections`), let in-flight calls finish within the
grace period, then close. `Server.close()` alone would cancel in-flight calls.

The daemon is assembled by the composition root (`ibex.service.root`); it
reads no settings itself.
"""

from __future__ import annotations

import functools
import gc
import logging
import signal
import ssl
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import grpclib.server
import trio
import trio_asyncio
from grpclib.events import SendTrailingMetadata, listen
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health

from ibex.assembly.tokens import Tokenizers
from ibex.errors import ListenError
from ibex.netaddr import bind_problem, join_host_port
from ibex.ops.branch_errors import BranchErrors
from ibex.ops.metrics import Metrics
from ibex.ops.sdnotify import Notifier, run_watchdog
from ibex.patches import install_patches, precise_wakeups
from ibex.service.admission import Admission, AdmissionConfig
from ibex.service.assembler import Assembler
from ibex.service.auth import Authenticator
from ibex.service.daemon_config import DaemonConfig as DaemonConfig
from ibex.service.dependencies import (
    DependencyStates,
    keep,
    report_recent,
    warm_all,
)
from ibex.service.edge import (
    HEALTH_MAX_MESSAGE_BYTES,
    REFLECTION_MAX_MESSAGE_BYTES,
    BoundedReads,
    CallDeadline,
    Connections,
    LoopErrorHandler,
    TrackedServer,
    bound_port,
    grpclib_configuration,
    listen_also,
    stop_accepting,
    track_connections,
    with_reflection,
)
from ibex.service.handlers import ContextService, EdgeConfig, method_label
from ibex.service.policies import AdmissionPolicy
from ibex.service.queues import share_the_gil
from ibex.service.warmup import warm_pipeline

if TYPE_CHECKING:
    from ibex.ops.otel_sdk import Tracing

log = logging.getLogger(__name__)


class Daemon:
    """One serving process. `open_assembler` opens the sources for the serving life.

    Before Health says SERVING (and sd_notify READY, and the listener's first
    accept), the assembler's dependencies are warmed and one synthetic assembly
    runs (`_warm`); a dependency down at start is logged and served without,
    and is probed in the background until it answers (`ibex.service.dependencies`).
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        open_assembler: Callable[[], AbstractAsyncContextManager[Assembler]],
        authenticator: Authenticator,
        admission: AdmissionConfig | None = None,
        policies: Sequence[AdmissionPolicy] | None = None,
        edge: EdgeConfig | None = None,
        metrics: Metrics | None = None,
        ssl_context: Callable[[], ssl.SSLContext | None] = lambda: None,
        startup_warning: Callable[[], str | None] = lambda: None,
        tracing: Callable[[], Tracing | None] = lambda: None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.admission = Admission(admission or AdmissionConfig(), self.metrics, policies)
        self.edge = edge or EdgeConfig()
        self.auth = authenticator
        self._open_assembler = open_assembler
        self._ssl_context = ssl_context
        self._startup_warning = startup_warning
        self._make_tracing = tracing
        self.tracing: Tracing | None = None
        self.health_status = ServiceStatus()
        self.connections = Connections(
            config.connections, closed_for=self.metrics.connection_closed
        )
        self.loop_errors = LoopErrorHandler()
        self.server: TrackedServer | None = None
        self.port: int | None = None
        self.dependencies = DependencyStates(self.metrics.set_dependency_up)
        self.branch_errors = BranchErrors(config.branch_errors_interval)

    def build_server(self, assembler: Assembler) -> TrackedServer:
        service = ContextService(
            assembler,
            admission=self.admission,
            metrics=self.metrics,
            authenticator=self.auth,
            config=self.edge,
            tracing=self.tracing,
            branch_errors=self.branch_errors,
        )
        # Health and reflection read their requests as the service does (bounded, timed,
        # counted): they answer before any authentication.
        health = BoundedReads(
            Health({service: [self.health_status]}),
            limit=HEALTH_MAX_MESSAGE_BYTES,
            reserve=self.admission.unauthenticated.reservation,
            read_timeout=self.admission.config.read_timeout,
        )
        _, _, *reflection = with_reflection([service, health], self.auth)
        reflection = [
            BoundedReads(
                r,
                limit=REFLECTION_MAX_MESSAGE_BYTES,
                reserve=self.admission.unauthenticated.reservation,
                read_timeout=self.admission.config.read_timeout,
            )
            for r in reflection
        ]
        server = TrackedServer([service, health, *reflection], config=grpclib_configuration())
        if self.config.worker is not None:
            listen(server, SendTrailingMetadata, _worker_trailer(str(self.config.worker)))
        return server

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
        starts, so a stop during start-up is a clean, logged exit too. Patches of
        third-party internals are installed first (`install_patches`: a package
        outside its supported range stops start-up here).
        """
        install_patches()
        with (
            trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals,
            precise_wakeups(),
        ):
            self.tracing = self._make_tracing()
            try:
                await self._serve(task_status, notifier, shutdown, sock, signals)
            finally:
                if self.tracing is not None:
                    # Export what is queued: the last calls' spans leave with the process.
                    self.tracing.shutdown()

    async def _serve(
        self,
        task_status: trio.TaskStatus[int],
        notifier: Notifier | None,
        shutdown: trio.Event | None,
        sock: Any,
        signals: Any,
    ) -> None:
        warning = self._startup_warning()
        if warning:
            log.warning("insecure_bind", extra={"detail": warning})
        ssl_ctx = self._ssl_context()
        share_the_gil()
        notifier = notifier or Notifier.from_env()
        shutdown = shutdown if shutdown is not None else trio.Event()
        async with trio_asyncio.open_loop() as loop, self._open_assembler() as assembler:
            loop.set_exception_handler(self.loop_errors)
            await self._warm(assembler)
            tokenizers = assembler.tokenizers
            # Counted from here: the warm-up's token counts are not the callers'.
            base_hits, base_misses = _cache_totals(tokenizers)
            self.metrics.set_token_cache_source(
                lambda: _cache_since(tokenizers, base_hits, base_misses)
            )
            server = self.build_server(assembler)
            self.server = server
            # TLS is done by the tracked protocol (counted from accept, handshake timed),
            # so the listeners themselves are plain TCP.
            track_connections(
                server,
                self.connections,
                gate=self._gate,
                gate_left=self.admission.left_gate,
                ssl=ssl_ctx,
                answered=self._answered,
            )
            # Start-up objects (catalog, rank tables, modules) live for the process:
            # move them out of the collector's reach so a full collection cannot
            # stall the loop for tens of milliseconds inside a 5 ms branch budget.
            gc.collect()
            gc.freeze()
            host = self.config.host
            if sock is not None:
                await trio_asyncio.aio_as_trio(server.start)(sock=sock)
            else:
                with _listening(host, self.config.port):
                    await trio_asyncio.aio_as_trio(server.start)(
                        host, self.config.port, reuse_port=self.config.reuse_port or None
                    )
            self.port = bound_port(server)
            for own in self.config.own_ports:
                also = functools.partial(listen_also, reuse_port=self.config.reuse_port)
                with _listening(host, own):
                    await trio_asyncio.aio_as_trio(also)(server, host, own)
            self.health_status.set(True)
            log.info(
                "serving",
                extra={
                    "addr": f"{host}:{self.port}",
                    "own_ports": list(self.config.own_ports),
                    "worker": self.config.worker,
                    "backend": assembler.backend,
                    "tls": ssl_ctx is not None,
                    "auth": self.auth.enabled,
                },
            )
            notifier.ready(f"serving on {host}:{self.port} ({assembler.backend})")
            task_status.started(self.port)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_watchdog, notifier)
                nursery.start_soon(self.connections.run)
                nursery.start_soon(_wait_signal, signals, shutdown, self.config.worker is None)
                for dep in assembler.dependencies:
                    nursery.start_soon(keep, dep, self.dependencies, self.config.dependencies)
                nursery.start_soon(self.branch_errors.run)
                if self.config.worker is not None:  # a reload's next worker reads these first
                    nursery.start_soon(report_recent, notifier, assembler.directive_source)
                await shutdown.wait()
                notifier.stopping()
                notifier.status("draining")
                await self.drain(server)
                nursery.cancel_scope.cancel()
            self.branch_errors.flush()
            log.info("stopped", extra={"in_flight": self.admission.in_flight})

    async def _warm(self, assembler: Assembler) -> None:
        """Connect the dependencies (each bounded) while one synthetic assembly runs.

        A dependency that did not answer is logged (`dependency_down`, with
        `starting`) and the daemon serves without it; its `keep` task goes on.
        """
        t0 = trio.current_time()
        took: dict[str, float] = {}
        pipeline: list[float] = []

        async def dependencies() -> None:
            took.update(
                await warm_all(assembler.dependencies, self.dependencies, self.config.dependencies)
            )

        async def assembly() -> None:
            pipeline.append(await warm_pipeline(assembler))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dependencies)
            nursery.start_soon(assembly)
        log.info(
            "warmed",
            extra={
                "seconds": round(trio.current_time() - t0, 4),
                "dependencies": took,
                "down": self.dependencies.down(),
                "assembly_s": round(pipeline[0], 4) if pipeline else None,
            },
        )

    def _answered(self, path: str, seconds: float) -> None:
        """A call's answer left: its server-side time, HEADERS to last byte written."""
        self.metrics.observe_answer(method_label(path), seconds)

    def _gate(self, path: str, deadline: CallDeadline) -> str | None:
        """Admission's HEADERS gate, for the service's own methods only; the call's time
        left is its whole timeout (its HEADERS were read just now).

        Health checks and reflection cost next to nothing, and a probe refused under
        load would take a busy worker out of rotation or restart it; unknown paths
        are answered UNIMPLEMENTED by grpclib. All of them pass (still counted).
        """
        method = method_label(path)
        return self.admission.gate(method, None if method == "other" else deadline.timeout)

    async def drain(self, server: grpclib.server.Server) -> None:
        """Stop listening, GOAWAY every connection, wait for in-flight calls, then close.

        Calls that reach a connection before its final GOAWAY are served;
        later streams are refused with REFUSED_STREAM, which clients retry on
        another connection. Only calls still running at the grace are cut.
        """
        self.health_status.set(False)
        log.info(
            "draining",
            extra={"in_flight": self.admission.in_flight, "connections": self.connections.count},
        )
        stop_accepting(server)
        self.connections.goaway_all(self.config.drain_grace)
        with trio.move_on_after(self.config.drain_grace) as scope:
            await self.connections.wait_closed()
            await trio_asyncio.aio_as_trio(self.admission.idle.wait)()
        if scope.cancelled_caught:
            log.warning(
                "drain_grace_expired",
                extra={
                    "in_flight": self.admission.in_flight,
                    "connections": self.connections.count,
                },
            )
        self.admission.draining = True
        server.close()
        await trio_asyncio.aio_as_trio(server.wait_closed)()


@contextmanager
def _listening(host: str, port: int) -> Iterator[None]:
    """A failed bind as a ListenError naming the address (one line at start, no traceback)."""
    try:
        yield
    except OSError as exc:
        problem = bind_problem(exc)
        raise ListenError(f"{join_host_port(host, port)}: {problem}", host, port) from None


def _worker_trailer(worker: str) -> Callable[[SendTrailingMetadata], Any]:
    """Tag every response with the worker that served it (all statuses, sheds too)."""

    async def tag(event: SendTrailingMetadata) -> None:
        event.metadata["x-ibex-worker"] = worker

    return tag


def _cache_totals(tokenizers: Tokenizers) -> tuple[int, int]:
    info = tokenizers.cache_info()
    return sum(i.hits for i in info.values()), sum(i.misses for i in info.values())


def _cache_since(tokenizers: Tokenizers, hits: int, misses: int) -> tuple[int, int]:
    now_hits, now_misses = _cache_totals(tokenizers)
    return max(0, now_hits - hits), max(0, now_misses - misses)


async def _wait_signal(signals: Any, shutdown: trio.Event, alone: bool) -> None:
    """SIGTERM/SIGINT start the drain. SIGHUP (whose default would end the process) is
    the supervisor's reload signal: a worker leaves it to the supervisor, a process
    serving alone says that a reload needs one and serves on."""
    async for signum in signals:
        if signum == signal.SIGHUP:
            if alone:
                log.warning(
                    "reload_needs_supervisor",
                    extra={
                        "detail": "SIGHUP ignored: reloads are done by the supervisor "
                        "(ibex serve --env-file PATH, --workers N or METRICS_ADDR)"
                    },
                )
            continue
        log.info("signal_received", extra={"signal": int(signum)})
        shutdown.set()
        return
