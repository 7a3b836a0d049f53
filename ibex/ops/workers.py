"""`ibex serve --workers N`: N serving processes on one port, supervised.

One Python process uses one core, so a host scales up with one worker per
core. Each worker binds the gRPC port itself with SO_REUSEPORT and the kernel
spreads connections across them. The supervisor:

- gives each worker its own notify socket (the systemd protocol, reused), so
  it knows when every worker is ready and whether each one's Trio loop is
  still alive (WATCHDOG=1 pings); it tells systemd READY=1 once all are up;
- restarts a worker that exits, stops pinging once serving, or is not ready
  within WORKER_START_TIMEOUT, with a short backoff; but a worker that stops
  its first start with a start-up error's status (a setting, a file, an
  address: `START_FAILURE_STATUSES`) stops them all, and the supervisor exits
  with that status: a restart would fail the same way, forever;
- forwards SIGTERM/SIGINT to every worker (each drains) and exits when all
  have, escalating to SIGKILL after the drain grace;
- serves /metrics aggregated over all workers (prometheus multiprocess mode),
  plus its own `ibex_worker_restarts_total{reason}` and the `process_*`
  series (CPU, memory, descriptors) of itself and of each live worker;
- tells worker i its slot with the hidden `--worker-index i` option: with
  IBEX_CONTEXT_WORKER_PORT_BASE=P the worker also listens on port P+i (its own
  port, no SO_REUSEPORT), so a client can balance calls, not just connections,
  across workers with gRPC's round_robin over P..P+N-1; the worker also names
  its slot in the `x-ibex-worker` trailer of every response. (An option, not
  an IBEX_CONTEXT_* variable: it is not a setting an operator may set.)

Everything is structured: one nursery holds a task per worker plus the
metrics server and the watchdog; nothing outlives `supervise`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

from ibex.config import Settings
from ibex.errors import START_FAILURE_STATUSES, ListenError
from ibex.netaddr import bind_problem, split_host_port
from ibex.ops.sdnotify import Notifier, run_watchdog

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKER_WATCHDOG_USEC = 4_000_000  # workers ping every 2 s
WATCHDOG_MISSES = 3  # a worker silent for 3 intervals is restarted
# Start-up (catalog, tokenizers, sources) sends no pings; on a loaded host it can
# take far longer than the watchdog's 6 s, so a new worker gets this long to say
# READY=1 instead (systemd's TimeoutStartSec in the unit is 60 s too).
WORKER_START_TIMEOUT = 60.0
RESTART_BACKOFF = (0.1, 0.5, 1.0, 2.0, 5.0)


class Worker:
    def __init__(self, index: int, notify_path: Path) -> None:
        self.index = index
        self.notify_path = notify_path
        self.process: trio.Process | None = None
        self.ready = trio.Event()  # the slot served once (for the supervisor's READY)
        self.serving = trio.Event()  # this run said READY=1 (new for every run)
        self.last_ping = 0.0
        self.restarts = 0
        self.unresponsive = False


class Supervisor:
    def __init__(
        self, settings: Settings, *, drain_grace: float, argv: list[str] | None = None
    ) -> None:
        """`drain_grace` is the workers' own (the composition root's DaemonConfig value)."""
        self.settings = settings
        self.drain_grace = drain_grace
        self.argv = argv or [sys.executable, "-m", "ibex", "serve", "--worker"]
        self.notifier = Notifier.from_env(unset_environment=True)
        self.stopping = False
        self.workers: list[Worker] = []
        self.all_ready = trio.Event()
        # A worker's start-up error status, when one stopped its first start.
        self.exit_status = 0
        self._cancel = trio.CancelScope()
        # Imported here, not at the top: supervise() may still have to choose
        # multiprocess mode before prometheus_client is first imported.
        from ibex.ops.metrics import WorkerRestarts

        self.restart_metric = WorkerRestarts()

    def _env(self, worker: Worker) -> dict[str, str]:
        env = dict(os.environ)
        env["IBEX_CONTEXT_WORKERS"] = "1"
        env["NOTIFY_SOCKET"] = str(worker.notify_path)
        env["WATCHDOG_USEC"] = str(WORKER_WATCHDOG_USEC)
        env.pop("WATCHDOG_PID", None)
        env.pop("IBEX_CONTEXT_METRICS_ADDR", None)  # the supervisor serves the aggregate
        return env

    def _argv(self, worker: Worker, supervisor_fd: int) -> list[str]:
        return [
            *self.argv,
            "--worker-index",
            str(worker.index),
            "--supervisor-fd",
            str(supervisor_fd),
        ]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        runtime = Path(tempfile.mkdtemp(prefix="ibex-workers-"))
        try:
            self.workers = [
                Worker(i, runtime / f"notify-{i}.sock") for i in range(self.settings.workers)
            ]
            async with trio.open_nursery() as nursery:
                self._cancel = nursery.cancel_scope
                if self.settings.metrics_addr and os.environ.get(MULTIPROC_ENV):
                    from ibex.ops.metrics import ProcessMetrics, exposition_registry
                    from ibex.ops.metrics_http import serve_metrics

                    registry = exposition_registry()
                    registry.register(self.restart_metric)
                    registry.register(ProcessMetrics(self.processes))
                    host, port = split_host_port(self.settings.metrics_addr)
                    try:
                        await nursery.start(
                            functools.partial(
                                serve_metrics,
                                token_sha256=self.settings.metrics_token_sha256,
                            ),
                            registry,
                            host,
                            port,
                        )
                    except OSError as exc:
                        raise ListenError(
                            f"{self.settings.metrics_addr}: {bind_problem(exc)}", host, port
                        ) from None
                # Workers after the metrics listener: an address in use stops start-up
                # before any worker is spawned.
                for worker in self.workers:
                    nursery.start_soon(self._keep_running, worker)
                nursery.start_soon(self._announce_ready)
                nursery.start_soon(run_watchdog, self.notifier)
                task_status.started()
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("supervisor_stopping", extra={"signal": signum})
                        break
                await self.stop()
                nursery.cancel_scope.cancel()
        finally:
            shutil.rmtree(runtime, ignore_errors=True)

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of this process and of every running worker, for `ProcessMetrics`."""
        live = [("supervisor", os.getpid())]
        for w in self.workers:
            if w.process is not None and w.process.returncode is None:
                live.append((f"worker-{w.index}", w.process.pid))
        return live

    async def stop(self) -> None:
        """Forward SIGTERM; each worker drains. SIGKILL whoever outlives the grace."""
        self.stopping = True
        self.notifier.stopping("draining workers")
        for w in self.workers:
            if w.process is not None and w.process.returncode is None:
                w.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.drain_grace + 5.0):
            for w in self.workers:
                if w.process is not None:
                    await w.process.wait()
        for w in self.workers:
            if w.process is not None and w.process.returncode is None:
                log.warning("worker_killed_after_grace", extra={"worker": w.index})
                w.process.kill()
                await w.process.wait()

    async def _announce_ready(self) -> None:
        for w in self.workers:
            await w.ready.wait()
        self.all_ready.set()
        addr = self.settings.grpc_addr
        self.notifier.ready(f"{len(self.workers)} workers serving on {addr}")
        log.info("workers_ready", extra={"workers": len(self.workers), "addr": addr})

    async def _keep_running(self, worker: Worker) -> None:
        """Run one worker slot for the supervisor's life, restarting it when it dies."""
        while not self.stopping:
            code = await self._run_once(worker)
            if self.stopping:
                break
            if code in START_FAILURE_STATUSES and not worker.ready.is_set():
                # The worker said why on stderr (one line); every restart would say it again.
                log.error("worker_start_failed", extra={"worker": worker.index, "returncode": code})
                self.exit_status = code
                await self.stop()
                self._cancel.cancel()
                return
            delay = RESTART_BACKOFF[min(worker.restarts, len(RESTART_BACKOFF) - 1)]
            worker.restarts += 1
            reason = "unresponsive" if worker.unresponsive else "exited"
            worker.unresponsive = False
            self.restart_metric.inc(reason)
            log.error(
                "worker_exited",
                extra={"worker": worker.index, "returncode": code, "restart_in_s": delay},
            )
            self.notifier.status(f"worker {worker.index} restarting (exit {code})")
            await trio.sleep(delay)

    async def _run_once(self, worker: Worker) -> int:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        worker.notify_path.unlink(missing_ok=True)
        await sock.bind(str(worker.notify_path))
        # The worker's end of a pipe only this process writes to: it sees EOF when we die
        # (see `leave_with_supervisor`). Both ends are non-inheritable; `pass_fds` hands
        # the read end to this worker alone.
        theirs, ours = os.pipe()
        try:
            try:
                process = await trio.lowlevel.open_process(
                    self._argv(worker, theirs),
                    env=self._env(worker),
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs,),
                )
            finally:
                os.close(theirs)
            worker.process = process
            worker.serving = trio.Event()
            worker.last_ping = trio.current_time()
            log.info("worker_started", extra={"worker": worker.index, "pid": process.pid})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._listen, worker, sock)
                nursery.start_soon(self._watch, worker)
                await process.wait()
                nursery.cancel_scope.cancel()
            _forget(process.pid)
            return int(process.returncode or 0)
        finally:
            os.close(ours)
            sock.close()

    async def _listen(self, worker: Worker, sock: trio.socket.SocketType) -> None:
        while True:
            data = await sock.recv(4096)
            lines = data.decode("utf-8", "replace").splitlines()
            worker.last_ping = trio.current_time()
            if "READY=1" in lines:
                worker.ready.set()
                worker.serving.set()
                worker.restarts = 0

    async def _watch(self, worker: Worker) -> None:
        """Kill a worker whose Trio loop stopped pinging; `_keep_running` restarts it."""
        interval = WORKER_WATCHDOG_USEC / 2_000_000
        with trio.move_on_after(WORKER_START_TIMEOUT):
            await worker.serving.wait()
        if not worker.serving.is_set() and worker.process is not None:
            log.error("worker_start_timeout", extra={"worker": worker.index})
            worker.unresponsive = True
            worker.process.kill()
            return
        while True:
            await trio.sleep(interval)
            silent = trio.current_time() - worker.last_ping
            if silent > interval * WATCHDOG_MISSES and worker.process is not None:
                log.error("worker_unresponsive", extra={"worker": worker.index, "silent_s": silent})
                worker.unresponsive = True
                worker.process.kill()
                return


def _forget(pid: int) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from ibex.ops.metrics import mark_process_dead

        mark_process_dead(pid)


async def leave_with_supervisor(fd: int, shutdown: trio.Event) -> None:
    """In a worker: drain and exit once the supervisor is gone, however it went.

    The supervisor holds the write end of a pipe whose read end is `fd`; the
    kernel closes it when the supervisor dies (SIGKILL included), and the read
    end turns readable (EOF). Under systemd (KillMode=mixed) or in a container
    the workers go with the unit anyway; started by hand, a supervisor killed
    with SIGKILL would otherwise leave its workers serving on the port with
    nobody to restart or stop them. (Not PR_SET_PDEATHSIG: it fires when the
    *thread* that forked the child exits, and trio forks from a worker thread
    that its thread cache retires after 10 idle seconds: every worker was
    sent SIGTERM about 10 s after it started.)
    """
    await trio.lowlevel.wait_readable(fd)
    log.warning("supervisor_gone", extra={"detail": "draining"})
    shutdown.set()


def supervise(settings: Settings, *, drain_grace: float) -> int:
    """Entry point for `ibex serve --workers N` (N > 1), and for one worker with metrics on;
    `drain_grace` is the workers' drain grace (the supervisor waits for it, then kills).
    Returns the exit status: 0, or a worker's start-up error status."""
    own_dir = None
    if settings.metrics_addr and not os.environ.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="ibex-metrics-")
        os.environ[MULTIPROC_ENV] = own_dir  # before prometheus_client is imported anywhere
    if os.environ.get(MULTIPROC_ENV):
        from ibex.ops.metrics import clear_multiprocess_dir

        clear_multiprocess_dir()
    supervisor = Supervisor(settings, drain_grace=drain_grace)
    try:
        trio.run(supervisor.run)
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return supervisor.exit_status
