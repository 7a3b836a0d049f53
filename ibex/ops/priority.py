"""A starting worker yields the CPU to the serving ones, then serves at their priority.

A worker's start-up (imports, catalog, rank tables, warming) is more than a
core-second of CPU. During a reload or a restart it runs next to workers that
are serving, on a host sized at one worker per core, and every wakeup of a
serving worker (a Redis reply, a memory answer) then waits behind it for a
scheduler slice: answers miss the caller's 45 ms. So the supervisor starts
such a worker at a higher nice value (`STARTING_NICE` above its own) and the
worker goes back to the supervisor's value, on every thread, before it says
READY=1.

Lowering a nice value again needs RLIMIT_NICE (systemd: `LimitNICE=`) or
CAP_SYS_NICE, and `setpriority` itself may be filtered (seccomp). The
supervisor probes both on a thread of its own first (`can_restore`) and
leaves the priority alone when the way back is not open: a worker must never
be left serving at the lower priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

STARTING_NICE = 10  # above the supervisor's own value


def current() -> int:
    """This process's nice value (0 where the call is filtered: nothing is lowered then)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return 0


def can_restore() -> bool:
    """True when a thread of this process can raise its nice value and lower it again."""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, base + 1))
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError:
            result.append(False)
        else:
            result.append(os.getpriority(os.PRIO_PROCESS, tid) == base)

    thread = threading.Thread(target=probe, name="ibex-nice-probe")
    thread.start()
    thread.join()
    return result == [True]


def lower(pid: int, base: int) -> bool:
    """Start-up priority for a just-spawned process (its only thread so far); False if refused."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, base + STARTING_NICE))
    except OSError:
        return False
    return True


def restore(nice: int) -> None:
    """Every thread of this process back to `nice` (a no-op where it already is)."""
    failed = 0
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError:
            failed += 1
    if failed:
        log.warning("priority_not_restored", extra={"threads": failed, "nice": nice})
