"""`ibex serve --workers N`: N serving processes on one port, supervised.

One Python process uses one core, so a host scales up with one worker per
core. Each worker binds the gRPC port itself with SO_REUSEPORT and the kernel
spreads connections across them. The supervisor:

- runs each worker slot's process (`ibex.ops.worker_process`: its own notify
  socket, READY=1 and WATCHDOG=1 pings) and tells systemd READY=1 once all
  are up;
- restarts a worker that exits, stops pinging once serving, or is not ready
  within WORKER_START_TIMEOUT, with a short backoff; but a worker that stops
  its first start with a start-up error's status (a setting, a file, an
  address: `START_FAILURE_STATUSES`) stops them all, and the supervisor exits
  with that status: a restart would fail the same way, forever;
- forwards SIGTERM/SIGINT to every worker (each drains) and exits when all
  have, escalating to SIGKILL after the drain grace;
- on SIGHUP reloads: reads `--env-file` again, validates it, then replaces
  the workers one slot at a time, new before old (`ibex.ops.rolling_reload`);
- hands every new worker the agents the live workers served last
  (`ibex.ops.handover`), whose directives it reads before serving;
- serves /metrics aggregated over all workers (prometheus multiprocess mode),
  plus its own `ibex_worker_restarts_total{reason}`,
  `ibex_worker_reloads_total{result}` and the `process_*` series (CPU,
  memory, descriptors) of itself and of each live worker.

Everything is structured: one nursery holds a task per worker plus the
metrics server, the reloader and the watchdog; every worker process is run by
a task of that nursery; nothing outlives `supervise`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from ibex.config import Settings
from ibex.errors import START_FAILURE_STATUSES, ListenError
from ibex.netaddr import bind_problem, split_host_port
from ibex.ops import handover
from ibex.ops.rolling_reload import Reloader
from ibex.ops.sdnotify import Notifier, run_watchdog
from ibex.ops.worker_process import MULTIPROC_ENV, Run, Worker, run_process, worker_env

log = logging.getLogger(__name__)

RESTART_BACKOFF = (0.1, 0.5, 1.0, 2.0, 5.0)

Loader = Callable[[Mapping[str, str]], tuple[Settings, float]]
"""An environment -> (validated settings, the workers' drain grace); ConfigError if invalid."""


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        *,
        drain_grace: float,
        argv: list[str] | None = None,
        env_file: Path | None = None,
        file_env: Mapping[str, str] | None = None,
        loader: Loader | None = None,
    ) -> None:
        """`drain_grace` is the workers' own (the composition root's DaemonConfig value).

        `file_env` is what `env_file` held at start (already validated by the caller);
        at each SIGHUP the file is read again and checked with `loader` before any
        worker is replaced.
        """
        self.settings = settings
        self.drain_grace = drain_grace
        self.argv = argv or [sys.executable, "-m", "ibex", "serve", "--worker"]
        self.env_file = env_file
        self.file_env: Mapping[str, str] = dict(file_env or {})
        self.loader = loader
        self.notifier = Notifier.from_env(unset_environment=True)
        self.stopping = False
        self.workers: list[Worker] = []
        self.live: set[Run] = set()
        self.all_ready = trio.Event()
        # A worker's start-up error status, when one stopped its first start.
        self.exit_status = 0
        self.reloader = Reloader(self)
        self._cancel = trio.CancelScope()
        self._generation = 0
        self._runtime: Path | None = None
        self._nursery: trio.Nursery | None = None
        # Imported here, not at the top: supervise() may still have to choose
        # multiprocess mode before prometheus_client is first imported.
        from ibex.ops.supervisor_metrics import WorkerReloads, WorkerRestarts

        self.restart_metric = WorkerRestarts()
        self.reload_metric = WorkerReloads()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._runtime = Path(tempfile.mkdtemp(prefix="ibex-workers-"))
        try:
            # Caught from the first line: a SIGHUP's default action would end the process.
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                self.workers = [Worker(i) for i in range(self.settings.workers)]
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._cancel = nursery.cancel_scope
                    if self.settings.metrics_addr and os.environ.get(MULTIPROC_ENV):
                        await self._serve_metrics(nursery)
                    # Workers after the metrics listener: an address in use stops start-up
                    # before any worker is spawned.
                    for worker in self.workers:
                        nursery.start_soon(self._keep_running, worker)
                    nursery.start_soon(self._announce_ready)
                    nursery.start_soon(self.reloader.run)
                    nursery.start_soon(run_watchdog, self.notifier)
                    task_status.started()
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            self.reloader.request()
                            continue
                        log.info("supervisor_stopping", extra={"signal": signum})
                        break
                    await self.stop()
                    nursery.cancel_scope.cancel()
        finally:
            shutil.rmtree(self._runtime, ignore_errors=True)

    async def reload(self) -> bool:
        """What a SIGHUP does, awaited: see `Reloader.reload`."""
        return await self.reloader.reload()

    async def _serve_metrics(self, nursery: trio.Nursery) -> None:
        from ibex.ops.metrics_http import serve_metrics
        from ibex.ops.supervisor_metrics import ProcessMetrics, exposition_registry

        registry = exposition_registry()
        registry.register(self.restart_metric)
        registry.register(self.reload_metric)
        registry.register(ProcessMetrics(self.processes))
        host, port = split_host_port(self.settings.metrics_addr or "")
        try:
            await nursery.start(
                functools.partial(serve_metrics, token_sha256=self.settings.metrics_token_sha256),
                registry,
                host,
                port,
            )
        except OSError as exc:
            raise ListenError(
                f"{self.settings.metrics_addr}: {bind_problem(exc)}", host, port
            ) from None

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of this process and of every running worker, for `ProcessMetrics`."""
        live = [("supervisor", os.getpid())]
        for run in sorted(self.live, key=lambda r: (r.slot, r.pid or 0)):
            if run.pid is not None and run.returncode is None:
                live.append((f"worker-{run.slot}", run.pid))  # two in a slot being replaced
        return live

    def recent_directives(self) -> list[handover.Key]:
        """Every live worker's last reported agents, taken in turn from each, bounded."""
        reports = [r.directives for r in sorted(self.live, key=lambda r: (r.slot, r.pid or 0))]
        turns = (r[i] for i in range(handover.MAX_KEYS) for r in reports if i < len(r))
        return handover.merge(turns)

    async def stop(self) -> None:
        """Forward SIGTERM; each worker drains. SIGKILL whoever outlives the grace."""
        self.stopping = True
        self.notifier.stopping("draining workers")
        for run in list(self.live):
            if run.returncode is None and run.process is not None:
                run.process.send_signal(signal.SIGTERM)
        grace = max([self.drain_grace, *(r.drain_grace for r in self.live)])
        with trio.move_on_after(grace + 5.0):
            while self.live:
                await next(iter(self.live)).exited.wait()
        for run in list(self.live):
            if run.process is not None and run.returncode is None:
                log.warning("worker_killed_after_grace", extra={"worker": run.slot})
                run.process.kill()
                await run.exited.wait()

    async def _announce_ready(self) -> None:
        for w in self.workers:
            await w.ready.wait()
        self.all_ready.set()
        addr = self.settings.grpc_addr
        self.notifier.ready(f"{len(self.workers)} workers serving on {addr}")
        log.info("workers_ready", extra={"workers": len(self.workers), "addr": addr})

    async def start(self, slot: Worker, env: Mapping[str, str], grace: float) -> Run:
        """Spawn one process for `slot`; returns once it runs (not yet ready)."""
        assert self._nursery is not None and self._runtime is not None
        self._generation += 1
        path = self._runtime / f"notify-{slot.index}-{self._generation}.sock"
        run = Run(slot.index, path, env, grace)
        spawn = functools.partial(
            run_process,
            run,
            self.argv,
            worker_env(run, os.environ, self.recent_directives()),
            live=self.live,
            stopping=lambda: self.stopping,
            on_ready=self._on_ready,
        )
        await self._nursery.start(spawn)
        return run

    def _on_ready(self, run: Run) -> None:
        slot = self.workers[run.slot]
        slot.ready.set()
        slot.restarts = 0

    async def _keep_running(self, slot: Worker) -> None:
        """Run one worker slot for the supervisor's life, restarting it when it dies.

        A run a reload replaced is not restarted: its successor is the slot's
        `current` by the time it is stopped, and this loop follows it.
        """
        async with slot.lock:
            slot.current = run = await self.start(slot, self.file_env, self.drain_grace)
        while True:
            await run.exited.wait()
            if self.stopping:
                return
            if slot.current is not run:
                run = slot.current
                assert run is not None
                continue
            code = run.returncode
            if code in START_FAILURE_STATUSES and not slot.ready.is_set():
                # The worker said why on stderr (one line); every restart would say it again.
                log.error("worker_start_failed", extra={"worker": slot.index, "returncode": code})
                self.exit_status = code
                await self.stop()
                self._cancel.cancel()
                return
            delay = RESTART_BACKOFF[min(slot.restarts, len(RESTART_BACKOFF) - 1)]
            slot.restarts += 1
            self.restart_metric.inc("unresponsive" if run.unresponsive else "exited")
            log.error(
                "worker_exited",
                extra={"worker": slot.index, "returncode": code, "restart_in_s": delay},
            )
            self.notifier.status(f"worker {slot.index} restarting (exit {code})")
            await trio.sleep(delay)
            async with slot.lock:
                if self.stopping:
                    return
                if slot.current is run:  # else a reload put a new run in meanwhile
                    slot.current = await self.start(slot, run.env, run.drain_grace)
                run = slot.current


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


def supervise(
    settings: Settings,
    *,
    drain_grace: float,
    env_file: Path | None = None,
    file_env: Mapping[str, str] | None = None,
    loader: Loader | None = None,
) -> int:
    """Entry point for `ibex serve --workers N` (N > 1), and for one worker with metrics on
    or an env file; `drain_grace` is the workers' drain grace (the supervisor waits for it,
    then kills). `env_file`, `file_env` and `loader`: see `Supervisor`. Returns the exit
    status: 0, or a worker's start-up error status."""
    own_dir = None
    if settings.metrics_addr and not os.environ.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="ibex-metrics-")
        os.environ[MULTIPROC_ENV] = own_dir  # before prometheus_client is imported anywhere
    if os.environ.get(MULTIPROC_ENV):
        from ibex.ops.supervisor_metrics import clear_multiprocess_dir

        clear_multiprocess_dir()
    supervisor = Supervisor(
        settings, drain_grace=drain_grace, env_file=env_file, file_env=file_env, loader=loader
    )
    try:
        trio.run(supervisor.run)
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return supervisor.exit_status
