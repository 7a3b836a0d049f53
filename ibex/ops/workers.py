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
- on SIGHUP reloads: reads `--env-file` again, validates it, then replaces
  the workers one slot at a time, new before old (`Supervisor.reload`);
- serves /metrics aggregated over all workers (prometheus multiprocess mode),
  plus its own `ibex_worker_restarts_total{reason}`,
  `ibex_worker_reloads_total{result}` and the `process_*` series (CPU,
  memory, descriptors) of itself and of each live worker;
- tells worker i its slot with the hidden `--worker-index i` option: with
  IBEX_CONTEXT_WORKER_PORT_BASE=P the worker also listens on port P+i (its own
  port, SO_REUSEPORT so a reload's new worker can bind it while the old one
  still listens), so a client can balance calls, not just connections,
  across workers with gRPC's round_robin over P..P+N-1; the worker also names
  its slot in the `x-ibex-worker` trailer of every response. (An option, not
  an IBEX_CONTEXT_* variable: it is not a setting an operator may set.)

A reload, slot by slot: start the new worker (the old one keeps serving);
wait for its READY=1, which a worker sends only once its connections are made
and warmed; then SIGTERM the old one, which stops accepting (its ports are
the new worker's alone from then on), sends GOAWAY, finishes its calls within
the drain grace and exits (SIGKILL after the grace plus 5 s, as `stop` does);
then the next slot. Settings that do not load stop the reload before any
worker is touched; a new worker that exits or is not ready within
WORKER_START_TIMEOUT is stopped and the reload ends there, the old worker
serving on. SIGHUPs during a reload make one more reload after it.

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from ibex.config import ConfigError, Settings, load_settings
from ibex.errors import START_FAILURE_STATUSES, ListenError
from ibex.netaddr import bind_problem, split_host_port
from ibex.ops import handover
from ibex.ops.envfile import read_env_file
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
# Between a reload's slots: the slot just replaced takes its first calls (its clients
# reconnect after the old worker's GOAWAY) before the next new worker's start-up
# (imports, catalog, warm-up: about a second of CPU) competes with them for a core.
RELOAD_SETTLE = 1.0


class Run:
    """One process of a worker slot, from spawn to exit.

    A slot has one run at a time except during a reload, when the new run
    starts next to the old one and replaces it once it says READY=1; each run
    has its own notify socket so the two are told apart.
    """

    def __init__(self, slot: int, notify_path: Path, env: Mapping[str, str], grace: float) -> None:
        self.slot = slot
        self.notify_path = notify_path
        self.env = env  # the env file's variables it was started with (a restart reuses them)
        self.drain_grace = grace  # its own drain grace, for the wait when it is stopped
        self.process: trio.Process | None = None
        self.serving = trio.Event()  # said READY=1
        self.exited = trio.Event()
        self.settled = trio.Event()  # serving or exited, whichever came first
        self.last_ping = 0.0
        self.unresponsive = False
        # The agents whose directives it served last, as it reported them (see handover).
        self.directives: list[handover.Key] = []

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode


class Worker:
    """A worker slot: index i, port WORKER_PORT_BASE + i, and the run serving it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.ready = trio.Event()  # the slot served once (for the supervisor's READY)
        self.restarts = 0
        self.current: Run | None = None
        # Held while the slot's run is being changed (a restart, a reload's swap): a
        # crash restart and a reload never start two replacements for one slot.
        self.lock = trio.Lock()

    @property
    def process(self) -> trio.Process | None:
        return None if self.current is None else self.current.process


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
        self.reloading = False
        self.workers: list[Worker] = []
        self.live: set[Run] = set()
        self.all_ready = trio.Event()
        # A worker's start-up error status, when one stopped its first start.
        self.exit_status = 0
        self._cancel = trio.CancelScope()
        self._generation = 0
        self._runtime: Path | None = None
        self._nursery: trio.Nursery | None = None
        self._reload_send, self._reload_receive = trio.open_memory_channel[None](1)
        # Imported here, not at the top: supervise() may still have to choose
        # multiprocess mode before prometheus_client is first imported.
        from ibex.ops.metrics import WorkerReloads, WorkerRestarts

        self.restart_metric = WorkerRestarts()
        self.reload_metric = WorkerReloads()

    def _env(self, run: Run) -> dict[str, str]:
        env = dict(os.environ)
        env.update(run.env)  # the env file overrides the process environment
        env["IBEX_CONTEXT_WORKERS"] = "1"
        env["NOTIFY_SOCKET"] = str(run.notify_path)
        env["WATCHDOG_USEC"] = str(WORKER_WATCHDOG_USEC)
        env.pop("WATCHDOG_PID", None)
        env.pop("IBEX_CONTEXT_METRICS_ADDR", None)  # the supervisor serves the aggregate
        env.pop(handover.ENV, None)
        recent = handover.encode(self.recent_directives())
        if recent:
            env[handover.ENV] = recent
        return env

    def recent_directives(self) -> list[handover.Key]:
        """Every live worker's last reported agents, taken in turn from each, bounded."""
        reports = [r.directives for r in sorted(self.live, key=lambda r: (r.slot, r.pid or 0))]
        turns = (r[i] for i in range(handover.MAX_KEYS) for r in reports if i < len(r))
        return handover.merge(turns)

    def _argv(self, run: Run, supervisor_fd: int) -> list[str]:
        return [
            *self.argv,
            "--worker-index",
            str(run.slot),
            "--supervisor-fd",
            str(supervisor_fd),
        ]

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
                    nursery.start_soon(self._reloader)
                    nursery.start_soon(run_watchdog, self.notifier)
                    task_status.started()
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            self.request_reload()
                            continue
                        log.info("supervisor_stopping", extra={"signal": signum})
                        break
                    await self.stop()
                    nursery.cancel_scope.cancel()
        finally:
            shutil.rmtree(self._runtime, ignore_errors=True)

    async def _serve_metrics(self, nursery: trio.Nursery) -> None:
        from ibex.ops.metrics import ProcessMetrics, exposition_registry
        from ibex.ops.metrics_http import serve_metrics

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

    async def _start(self, slot: Worker, env: Mapping[str, str], grace: float) -> Run:
        """Spawn one process for `slot`; returns once it runs (not yet ready)."""
        assert self._nursery is not None and self._runtime is not None
        self._generation += 1
        path = self._runtime / f"notify-{slot.index}-{self._generation}.sock"
        run = Run(slot.index, path, env, grace)
        await self._nursery.start(self._run, run)
        return run

    async def _keep_running(self, slot: Worker) -> None:
        """Run one worker slot for the supervisor's life, restarting it when it dies.

        A run a reload replaced is not restarted: its successor is the slot's
        `current` by the time it is stopped, and this loop follows it.
        """
        async with slot.lock:
            slot.current = run = await self._start(slot, self.file_env, self.drain_grace)
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
                    slot.current = await self._start(slot, run.env, run.drain_grace)
                run = slot.current

    async def _run(self, run: Run, *, task_status: trio.TaskStatus[None]) -> None:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        run.notify_path.unlink(missing_ok=True)
        await sock.bind(str(run.notify_path))
        # The worker's end of a pipe only this process writes to: it sees EOF when we die
        # (see `leave_with_supervisor`). Both ends are non-inheritable; `pass_fds` hands
        # the read end to this worker alone.
        theirs, ours = os.pipe()
        try:
            try:
                process = await trio.lowlevel.open_process(
                    self._argv(run, theirs),
                    env=self._env(run),
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs,),
                )
            finally:
                os.close(theirs)
            run.process = process
            run.last_ping = trio.current_time()
            self.live.add(run)
            log.info("worker_started", extra={"worker": run.slot, "pid": process.pid})
            if self.stopping:  # spawned while `stop` was signalling the others
                process.send_signal(signal.SIGTERM)
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._listen, run, sock)
                nursery.start_soon(self._watch, run)
                await process.wait()
                nursery.cancel_scope.cancel()
            _forget(process.pid)
        finally:
            self.live.discard(run)
            run.exited.set()
            run.settled.set()
            os.close(ours)
            sock.close()
            run.notify_path.unlink(missing_ok=True)

    async def _listen(self, run: Run, sock: trio.socket.SocketType) -> None:
        while True:
            data = await sock.recv(4096)
            lines = data.decode("utf-8", "replace").splitlines()
            run.last_ping = trio.current_time()
            for line in lines:
                if line.startswith(handover.NOTIFY_FIELD + "="):
                    run.directives = handover.decode(line.partition("=")[2])
            if "READY=1" in lines and not run.serving.is_set():
                run.serving.set()
                run.settled.set()
                slot = self.workers[run.slot]
                slot.ready.set()
                slot.restarts = 0

    async def _watch(self, run: Run) -> None:
        """Kill a worker whose Trio loop stopped pinging; `_keep_running` restarts it."""
        interval = WORKER_WATCHDOG_USEC / 2_000_000
        with trio.move_on_after(WORKER_START_TIMEOUT):
            await run.serving.wait()
        if not run.serving.is_set() and run.process is not None:
            log.error("worker_start_timeout", extra={"worker": run.slot, "pid": run.pid})
            run.unresponsive = True
            run.process.kill()
            return
        while True:
            await trio.sleep(interval)
            silent = trio.current_time() - run.last_ping
            if silent > interval * WATCHDOG_MISSES and run.process is not None:
                log.error("worker_unresponsive", extra={"worker": run.slot, "silent_s": silent})
                run.unresponsive = True
                run.process.kill()
                return

    # ------------------------------------------------------------------ reload

    def request_reload(self) -> None:
        """SIGHUP: reload now, or once the reload under way is done (any number of
        SIGHUPs meanwhile make one more reload, never two at once)."""
        try:
            self._reload_send.send_nowait(None)
        except trio.WouldBlock:
            log.info("reload_coalesced", extra={"detail": "a reload is already queued"})
            return
        if self.reloading:
            log.info("reload_queued", extra={"detail": "after the reload under way"})

    async def _reloader(self) -> None:
        async for _ in self._reload_receive:
            if self.stopping:
                return
            self.reloading = True
            try:
                await self.reload()
            finally:
                self.reloading = False

    async def reload(self) -> bool:
        """Replace every worker, one slot at a time, with one started from the settings
        the env file holds now. False when they do not load (no worker touched) or a new
        worker did not become ready (it is stopped; the old one keeps serving)."""
        started = trio.current_time()
        announce = self.all_ready.is_set()  # before READY, systemd is told nothing yet
        if announce:
            monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")
        log.info(
            "reload_started",
            extra={"workers": len(self.workers), "env_file": str(self.env_file or "")},
        )
        try:
            file_env = read_env_file(self.env_file) if self.env_file else dict(self.file_env)
            env = {**os.environ, **file_env}
            settings, grace = (
                self.loader(env) if self.loader else (load_settings(env), self.drain_grace)
            )
        except ConfigError as exc:
            self.reload_metric.inc("rejected")
            log.error("reload_rejected", extra={"error": str(exc), "detail": "workers unchanged"})
            self._reload_over(announce, "reload rejected: settings invalid, workers unchanged")
            return False
        fixed = _needs_restart(self.settings, settings)
        if fixed:
            log.warning(
                "reload_needs_restart",
                extra={"variables": fixed, "detail": "the supervisor's own; kept until a restart"},
            )
        replaced = 0
        for slot in self.workers:
            if replaced:
                await trio.sleep(RELOAD_SETTLE)
            if not await self._replace(slot, file_env, grace):
                if self.stopping:
                    return False
                self.reload_metric.inc("failed")
                log.error(
                    "reload_failed",
                    extra={
                        "worker": slot.index,
                        "replaced": replaced,
                        "detail": "the new worker did not become ready; the old one serves on",
                    },
                )
                self._reload_over(announce, f"reload failed at worker {slot.index}")
                return False
            replaced += 1
        self.file_env, self.drain_grace = file_env, grace
        self.reload_metric.inc("done")
        log.info(
            "reload_done",
            extra={"workers": replaced, "seconds": round(trio.current_time() - started, 3)},
        )
        self._reload_over(announce, f"{replaced} workers serving (reloaded)")
        return True

    def _reload_over(self, announce: bool, status: str) -> None:
        if announce and not self.stopping:
            self.notifier.ready(status)

    async def _replace(self, slot: Worker, env: Mapping[str, str], grace: float) -> bool:
        """Start the slot's new worker; once it is ready, stop the old one and wait for its
        drain (it stops accepting first, so its port is the new worker's alone)."""
        async with slot.lock:
            old = slot.current
            try:
                new = await self._start(slot, env, grace)
            except OSError as exc:
                log.error("worker_spawn_failed", extra={"worker": slot.index, "error": str(exc)})
                return False
            # `_watch` kills a run not ready within WORKER_START_TIMEOUT, so this ends.
            await new.settled.wait()
            if not new.serving.is_set() or new.returncode is not None:
                if new.process is not None and new.returncode is None:
                    new.process.kill()
                await new.exited.wait()
                if not self.stopping:
                    log.error(
                        "reload_worker_not_ready",
                        extra={"worker": slot.index, "pid": new.pid, "returncode": new.returncode},
                    )
                return False
            slot.current = new
            drained = await self._retire(old) if old is not None else 0.0
            log.info(
                "worker_replaced",
                extra={
                    "worker": slot.index,
                    "old_pid": None if old is None else old.pid,
                    "pid": new.pid,
                    "old_drained_s": round(drained, 3),
                },
            )
            return True

    async def _retire(self, run: Run) -> float:
        """SIGTERM one run and wait for its drain; SIGKILL after its grace (as `stop` does)."""
        began = trio.current_time()
        if run.process is not None and run.returncode is None:
            run.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(run.drain_grace + 5.0):
            await run.exited.wait()
        if not run.exited.is_set() and run.process is not None:
            log.warning("worker_killed_after_grace", extra={"worker": run.slot, "pid": run.pid})
            run.process.kill()
            await run.exited.wait()
        return trio.current_time() - began


def _needs_restart(old: Settings, new: Settings) -> list[str]:
    """Settings the supervisor itself uses, which a reload leaves as they were."""
    names = {
        "workers": "IBEX_CONTEXT_WORKERS",
        "metrics_addr": "IBEX_CONTEXT_METRICS_ADDR",
        "metrics_token_sha256": "IBEX_CONTEXT_METRICS_TOKEN_SHA256",
    }
    return [var for field, var in names.items() if getattr(old, field) != getattr(new, field)]


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
        from ibex.ops.metrics import clear_multiprocess_dir

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
