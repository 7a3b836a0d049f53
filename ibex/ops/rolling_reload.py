"""The supervisor's reload on SIGHUP: every worker replaced, one slot at a time, new before old.

Slot by slot: start the new worker (the old one keeps serving); wait for its
READY=1, which a worker sends only once its connections are made and warmed
and the directives of the agents the live workers served last are read
(`ibex.ops.handover`); then SIGTERM the old one, which stops accepting (its
ports are the new worker's alone from then on), sends GOAWAY, finishes its
calls within the drain grace and exits (SIGKILL after the grace plus 5 s, as
`stop` does); then, after RELOAD_SETTLE, the next slot. Settings that do not
load stop the reload before any worker is touched; a new worker that exits or
is not ready within WORKER_START_TIMEOUT is stopped and the reload ends
there, the old worker serving on. SIGHUPs during a reload make one more
reload after it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from ibex.config import ConfigError, Settings, load_settings
from ibex.ops.envfile import read_env_file
from ibex.ops.worker_process import Run, Worker

if TYPE_CHECKING:
    from ibex.ops.workers import Supervisor

log = logging.getLogger(__name__)

# Between a reload's slots: the slot just replaced takes its first calls (its clients
# reconnect after the old worker's GOAWAY) before the next new worker's start-up
# (imports, catalog, warm-up: about a second of CPU) competes with them for a core.
RELOAD_SETTLE = 1.0


class Reloader:
    """Runs the supervisor's reloads, one at a time, in the supervisor's nursery."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor
        self.reloading = False
        self._send, self._receive = trio.open_memory_channel[None](1)

    def request(self) -> None:
        """SIGHUP: reload now, or once the reload under way is done (any number of
        SIGHUPs meanwhile make one more reload, never two at once)."""
        try:
            self._send.send_nowait(None)
        except trio.WouldBlock:
            log.info("reload_coalesced", extra={"detail": "a reload is already queued"})
            return
        if self.reloading:
            log.info("reload_queued", extra={"detail": "after the reload under way"})

    async def run(self) -> None:
        async for _ in self._receive:
            if self.sup.stopping:
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
        sup = self.sup
        started = trio.current_time()
        announce = sup.all_ready.is_set()  # before READY, systemd is told nothing yet
        if announce:
            monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            sup.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")
        log.info(
            "reload_started",
            extra={"workers": len(sup.workers), "env_file": str(sup.env_file or "")},
        )
        try:
            file_env = read_env_file(sup.env_file) if sup.env_file else dict(sup.file_env)
            env = {**os.environ, **file_env}
            settings, grace = (
                sup.loader(env) if sup.loader else (load_settings(env), sup.drain_grace)
            )
        except ConfigError as exc:
            sup.reload_metric.inc("rejected")
            log.error("reload_rejected", extra={"error": str(exc), "detail": "workers unchanged"})
            self._over(announce, "reload rejected: settings invalid, workers unchanged")
            return False
        fixed = needs_restart(sup.settings, settings)
        if fixed:
            log.warning(
                "reload_needs_restart",
                extra={"variables": fixed, "detail": "the supervisor's own; kept until a restart"},
            )
        replaced = 0
        for slot in sup.workers:
            if replaced:
                await trio.sleep(RELOAD_SETTLE)
            if not await self._replace(slot, file_env, grace):
                if sup.stopping:
                    return False
                sup.reload_metric.inc("failed")
                log.error(
                    "reload_failed",
                    extra={
                        "worker": slot.index,
                        "replaced": replaced,
                        "detail": "the new worker did not become ready; the old one serves on",
                    },
                )
                self._over(announce, f"reload failed at worker {slot.index}")
                return False
            replaced += 1
        sup.file_env, sup.drain_grace = file_env, grace
        sup.reload_metric.inc("done")
        log.info(
            "reload_done",
            extra={"workers": replaced, "seconds": round(trio.current_time() - started, 3)},
        )
        self._over(announce, f"{replaced} workers serving (reloaded)")
        return True

    def _over(self, announce: bool, status: str) -> None:
        if announce and not self.sup.stopping:
            self.sup.notifier.ready(status)

    async def _replace(self, slot: Worker, env: Mapping[str, str], grace: float) -> bool:
        """Start the slot's new worker; once it is ready, stop the old one and wait for its
        drain (it stops accepting first, so its port is the new worker's alone)."""
        async with slot.lock:
            old = slot.current
            try:
                new = await self.sup.start(slot, env, grace)
            except OSError as exc:
                log.error("worker_spawn_failed", extra={"worker": slot.index, "error": str(exc)})
                return False
            # `_watch` kills a run not ready within WORKER_START_TIMEOUT, so this ends.
            await new.settled.wait()
            if not new.serving.is_set() or new.returncode is not None:
                if new.process is not None and new.returncode is None:
                    new.process.kill()
                await new.exited.wait()
                if not self.sup.stopping:
                    log.error(
                        "reload_worker_not_ready",
                        extra={"worker": slot.index, "pid": new.pid, "returncode": new.returncode},
                    )
                return False
            slot.current = new
            drained = await retire(old) if old is not None else 0.0
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


async def retire(run: Run) -> float:
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


def needs_restart(old: Settings, new: Settings) -> list[str]:
    """Settings the supervisor itself uses, which a reload leaves as they were."""
    names = {
        "workers": "IBEX_CONTEXT_WORKERS",
        "metrics_addr": "IBEX_CONTEXT_METRICS_ADDR",
        "metrics_token_sha256": "IBEX_CONTEXT_METRICS_TOKEN_SHA256",
    }
    return [var for field, var in names.items() if getattr(old, field) != getattr(new, field)]
