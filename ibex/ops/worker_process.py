"""One worker process of `ibex serve --workers N`, from spawn to exit.

The supervisor (`ibex.ops.workers`) decides when a slot gets a process; this
module runs one: it spawns `python -m ibex serve --worker` with the slot's
environment, gives it its own notify socket (the systemd protocol, reused) to
tell when it is ready and that its Trio loop is alive (WATCHDOG=1 pings), and
kills it when it is not ready within WORKER_START_TIMEOUT or stops pinging.
Its start-up runs at SCHED_IDLE where the kernel lets it go back to the normal
policy at READY=1 (`START_IDLE`), and it reports, over the same socket, the
agents its directive cache served last (`ibex.ops.handover`).

The worker's options are hidden ones (`--worker-index i`, `--supervisor-fd`),
not IBEX_CONTEXT_* variables: they are not settings an operator may set. With
IBEX_CONTEXT_WORKER_PORT_BASE=P worker i also listens on port P+i (its own
port, SO_REUSEPORT so a reload's new worker can bind it while the old one
still listens), so a client can balance calls, not just connections, across
workers with gRPC's round_robin over P..P+N-1; the worker also names its slot
in the `x-ibex-worker` trailer of every response.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from ibex.ops import handover

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKER_WATCHDOG_USEC = 4_000_000  # workers ping every 2 s
WATCHDOG_MISSES = 3  # a worker silent for 3 intervals is restarted
# Start-up (catalog, tokenizers, sources) sends no pings; on a loaded host it can
# take far longer than the watchdog's 6 s, so a new worker gets this long to say
# READY=1 instead (systemd's TimeoutStartSec in the unit is 60 s too).
WORKER_START_TIMEOUT = 60.0
# A worker's start-up (imports, catalog, tokenizers, warm-up) is about 1.5 s of CPU.
# Run at SCHED_IDLE until READY=1, it takes only CPU no serving worker wants, so a
# reload or a restart does not push the serving workers' calls past their deadlines.
# On a host with no idle CPU it would barely run: after START_IDLE_FOR it starts at
# the normal priority: the bound is what a saturated host's reload waits per slot.
START_IDLE = True
START_IDLE_FOR = 10.0


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
        self.idle = False  # started at SCHED_IDLE, not yet restored

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


def worker_env(run: Run, environ: Mapping[str, str], recent: list[handover.Key]) -> dict[str, str]:
    """The process environment, the run's env file over it, and what only a worker gets:
    its notify socket and watchdog, and the agents to read before serving (`recent`)."""
    env = dict(environ)
    env.update(run.env)  # the env file overrides the process environment
    env["IBEX_CONTEXT_WORKERS"] = "1"
    env["NOTIFY_SOCKET"] = str(run.notify_path)
    env["WATCHDOG_USEC"] = str(WORKER_WATCHDOG_USEC)
    env.pop("WATCHDOG_PID", None)
    env.pop("IBEX_CONTEXT_METRICS_ADDR", None)  # the supervisor serves the aggregate
    env.pop(handover.ENV, None)
    if recent:
        env[handover.ENV] = handover.encode(recent)
    return env


async def run_process(
    run: Run,
    argv: list[str],
    env: Mapping[str, str],
    *,
    live: set[Run],
    stopping: Callable[[], bool],
    on_ready: Callable[[Run], None],
    task_status: trio.TaskStatus[None],
) -> None:
    """Spawn `argv` for `run` and watch it until it exits; started once it runs.

    `live` holds the run while its process lives; `stopping()` says the
    supervisor is stopping (a run spawned meanwhile is sent SIGTERM at once);
    `on_ready` is called at its first READY=1.
    """
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
                [*argv, "--worker-index", str(run.slot), "--supervisor-fd", str(theirs)],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs,),
            )
        finally:
            os.close(theirs)
        run.process = process
        run.last_ping = trio.current_time()
        # Only next to a serving worker (a reload, a restart): a first start has no calls
        # to protect and would only take longer.
        if START_IDLE and any(r.serving.is_set() for r in live) and may_leave_idle():
            run.idle = _set_policy(process.pid, os.SCHED_IDLE)
        live.add(run)
        log.info("worker_started", extra={"worker": run.slot, "pid": process.pid})
        if stopping():  # spawned while `stop` was signalling the others
            process.send_signal(signal.SIGTERM)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_listen, run, sock, on_ready)
            nursery.start_soon(_watch, run)
            await process.wait()
            nursery.cancel_scope.cancel()
        _forget(process.pid)
    finally:
        live.discard(run)
        run.exited.set()
        run.settled.set()
        os.close(ours)
        sock.close()
        run.notify_path.unlink(missing_ok=True)


async def _listen(run: Run, sock: trio.socket.SocketType, on_ready: Callable[[Run], None]) -> None:
    while True:
        data = await sock.recv(4096)
        lines = data.decode("utf-8", "replace").splitlines()
        run.last_ping = trio.current_time()
        for line in lines:
            if line.startswith(handover.NOTIFY_FIELD + "="):
                run.directives = handover.decode(line.partition("=")[2])
        if "READY=1" in lines and not run.serving.is_set():
            if run.idle and run.pid is not None:
                run.idle = not _set_policy(run.pid, os.SCHED_OTHER)
                if run.idle:
                    log.warning("worker_still_idle_priority", extra={"worker": run.slot})
            run.serving.set()
            run.settled.set()
            on_ready(run)


async def _watch(run: Run) -> None:
    """Kill a worker whose Trio loop stopped pinging; the supervisor restarts it."""
    interval = WORKER_WATCHDOG_USEC / 2_000_000
    began = trio.current_time()
    with trio.move_on_after(min(START_IDLE_FOR, WORKER_START_TIMEOUT)):
        await run.serving.wait()
    if run.idle and not run.serving.is_set() and run.pid is not None:
        log.info("worker_start_priority_raised", extra={"worker": run.slot, "pid": run.pid})
        run.idle = not _set_policy(run.pid, os.SCHED_OTHER)
    with trio.move_on_at(began + WORKER_START_TIMEOUT):
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


def _forget(pid: int) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from ibex.ops.supervisor_metrics import mark_process_dead

        mark_process_dead(pid)


def may_leave_idle() -> bool:
    """Whether a child of this process may go back from SCHED_IDLE to SCHED_OTHER: the
    kernel allows it with CAP_SYS_NICE, or when RLIMIT_NICE allows its nice value
    (systemd's LimitNICE=). Without, a worker would stay at idle priority: never tried."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - os.getpriority(os.PRIO_PROCESS, 0) <= soft:
        return True
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 23 & 1)  # CAP_SYS_NICE
    return False


def _set_policy(pid: int, policy: int) -> bool:
    """Every thread of `pid` to `policy` (a thread inherits its creator's); False if any
    could not be (a thread that ended meanwhile is no failure)."""
    ok = True
    for _ in range(2):  # threads started while the first pass ran
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            tids = [pid]
        for tid in tids:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:
                continue
            except OSError:
                ok = False
    return ok
