"""Trio's timers fire on time, not up to a millisecond late.

Trio waits for I/O with ``epoll.poll(timeout)``, and CPython turns the timeout
into whole milliseconds rounded up, so a deadline at 40.2 ms wakes the loop at
41 ms: every request wall, branch timeout and sleep is late by 0.5 ms on
average and 1 ms at worst. Inside a 45 ms budget that is time the caller waits
for nothing.

While installed, a blocking wait whose timeout is not a whole number of
milliseconds also arms a timerfd (a kernel hrtimer, no rounding) at the exact
timeout; the timerfd sits in Trio's epoll set, so the wait ends when it fires.
Its event is consumed here and never reaches Trio's event processing. Waits
with a whole-millisecond, zero or infinite timeout are left alone, so the cost
is one ``timerfd_settime`` per blocking wait that needs it.

Linux only (timerfd and epoll); elsewhere `precise_wakeups` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import select
from collections.abc import Iterator
from typing import Any

import trio

from ibex.versions import require

log = logging.getLogger(__name__)

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
#: A timeout within this many milliseconds above a whole millisecond is left to epoll:
#: its round-up then costs at most this much.
WHOLE_MS_SLACK = 0.02


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class TimerFd:
    """A non-blocking CLOCK_MONOTONIC timerfd, armed relative to now."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._settime = self._libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd: int = fd
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)

    def arm(self, seconds: float) -> None:
        """Fire once, `seconds` from now (> 0)."""
        sec = int(seconds)
        nsec = int((seconds - sec) * 1e9)
        self._spec.it_value.tv_sec = sec
        self._spec.it_value.tv_nsec = nsec if sec or nsec else 1  # all zero would disarm
        if self._settime(self.fd, 0, self._ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def drain(self) -> None:
        """Consume an expiry, so the fd stops being readable."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def close(self) -> None:
        os.close(self.fd)


def wants_timer(timeout: float) -> bool:
    """True when epoll's whole-millisecond round-up would make this wait late."""
    if not 0 < timeout < 86400:
        return False
    ms = timeout * 1000.0
    return ms - math.floor(ms) > WHOLE_MS_SLACK


#: The timer of each IOManager it was installed in, by id (Trio's IOManager has slots).
_TIMERS: dict[int, TimerFd] = {}
_original_get_events: Any = None


def _get_events(self: Any, timeout: float) -> Any:
    timer = _TIMERS.get(id(self))
    if timer is None:
        return _original_get_events(self, timeout)
    if wants_timer(timeout):
        timer.arm(timeout)
    # An expiry armed for an earlier wait that ended sooner may still arrive: it is
    # filtered here whatever this wait's timeout, and only costs a spurious wakeup.
    events = self._epoll.poll(timeout, max(1, len(self._registered)) + 1)
    out = []
    for fd, flags in events:
        if fd == timer.fd:
            timer.drain()
        else:
            out.append((fd, flags))
    return out


def _io_manager() -> Any:
    from trio._core import _run

    return _run.GLOBAL_RUN_CONTEXT.runner.io_manager


@contextlib.contextmanager
def precise_wakeups() -> Iterator[bool]:
    """Within this block, the current Trio run's timers fire on time (see module docstring).

    Yields False, and changes nothing, where the platform or Trio's internals do
    not allow it (logged once as ``precise_wakeups_off``). Raises
    `ibex.versions.UnsupportedVersion` for a Trio outside the range it was written for.
    """
    global _original_get_events
    require("trio")
    trio.lowlevel.current_trio_token()  # only inside trio.run
    manager = _io_manager()
    epoll = getattr(manager, "_epoll", None)
    cls = type(manager)
    if epoll is None or not hasattr(cls, "get_events") or not hasattr(manager, "_registered"):
        log.warning("precise_wakeups_off", extra={"detail": f"io manager {cls.__name__}"})
        yield False
        return
    try:
        timer = TimerFd()
    except (OSError, AttributeError) as exc:
        log.warning("precise_wakeups_off", extra={"detail": f"timerfd: {exc}"})
        yield False
        return
    try:
        epoll.register(timer.fd, select.EPOLLIN)
        if _original_get_events is None:
            _original_get_events = cls.get_events
            cls.get_events = _get_events
        _TIMERS[id(manager)] = timer
        yield True
    finally:
        _TIMERS.pop(id(manager), None)
        with contextlib.suppress(OSError, ValueError):
            epoll.unregister(timer.fd)
        timer.close()
