"""Every patch ibex makes to third-party internals, each checking its package's version
as it is installed, and `install_patches`, which the daemon calls at start-up.

A private API can change in any release: each install function first calls
`ibex.versions.require` for the packages it patches, so an unsupported version
stops start-up with a message instead of misbehaving at run time. Nothing here
is applied at import. The patches:

- `answer_expired_deadlines` (grpclib): an already expired deadline answers
  DEADLINE_EXCEEDED instead of an internal error;
- `lighten_h2` (grpclib, h2, hpack, hyperframe): response headers from
  `ibex.service.edge.hpack_block`, and two per-frame debugging aids switched off;
- `batch_ready_callbacks` (trio-asyncio): one Trio step per batch of ready
  asyncio callbacks, Trio tasks started without waiting for their first step,
  and cancelled timers dropped before the loop waits
  (`ibex.service.edge.aio_loop.drop_cancelled_timers`);
- `honour_cancellation_in_redis_writes` (redis-py, in `ibex.sources.redis_patches`,
  since the sources layer may not import this one);
- `precise_wakeups` (Trio's epoll wait, `ibex.service.edge.precise_wakeup`): a context
  manager, entered for the Trio run that serves.

trio-asyncio's batching main loop: its main loop takes one callback per Trio
step, a memory-channel receive (a yield and a pass of the scheduler, i.e. an
epoll call) and a cancel scope for each; an answer cost about 9 of those steps
(`python -m benchmarks.wakeups`). asyncio's own loop runs every callback that
is ready when an iteration starts, then polls; `batch_ready_callbacks` makes
trio-asyncio do the same. After the callback it waited for, the loop runs as
many more as were queued at that moment (so callbacks that keep scheduling
callbacks still let Trio run between rounds), due timers first. A Trio task
start (a crossing into Trio: every call's `in_trio`) is handed to the nursery
and the loop goes on. trio-asyncio's own loop waits for each such task's first
step, a whole pass of the Trio scheduler with every other runnable task's step
in it, which holds every callback queued behind a burst of calls' crossings (a
Redis reply, another call's request) for one pass per call. A task
cancelled before its first step still resolves its future as cancelled
(trio-asyncio's `AsyncHandle` checks that when it starts). It checks
trio-asyncio's internals at install and leaves the loop as it is (logging why)
when they have changed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpclib.protocol
import grpclib.utils
import hpack.hpack
import hpack.table
import trio
import trio_asyncio._base as _base
from grpclib.metadata import Deadline
from h2.exceptions import StreamClosedError
from hyperframe.frame import Frame
from sniffio import thread_local as sniffio_library
from trio_asyncio._handles import AsyncHandle as _AsyncHandle

from ibex.service.edge.aio_loop import REBUILD_MIN, drop_cancelled_timers
from ibex.service.edge.calls import call_of
from ibex.service.edge.hpack_block import send_headers_fast
from ibex.service.edge.precise_wakeup import precise_wakeups
from ibex.sources.redis_patches import honour_cancellation_in_redis_writes
from ibex.versions import require

__all__ = [
    "answer_expired_deadlines",
    "batch_ready_callbacks",
    "honour_cancellation_in_redis_writes",
    "install_patches",
    "lighten_h2",
    "precise_wakeups",
]

log = logging.getLogger(__name__)


def install_patches() -> None:
    """Install every process-wide patch (idempotent); `precise_wakeups` is entered apart,
    inside the Trio run. Raises `ibex.versions.UnsupportedVersion` for a package outside
    the range its patch supports."""
    answer_expired_deadlines()
    lighten_h2()
    batch_ready_callbacks()
    honour_cancellation_in_redis_writes()


@contextmanager
def _deadline_start(self: grpclib.utils.DeadlineWrapper, deadline: Deadline) -> Iterator[None]:
    """grpclib's `DeadlineWrapper.start`, except that an already expired deadline cancels
    the call through the wrapper like any other: the caller gets DEADLINE_EXCEEDED and
    grpclib logs it at info. (Upstream raises TimeoutError before the wrapper is armed,
    which answers UNKNOWN "Internal Server Error" and logs "Timeout occurred" at error.)
    """
    timeout = max(0.0, deadline.time_remaining())

    def callback() -> None:
        self.cancel(TimeoutError("Deadline exceeded"))

    timer = asyncio.get_event_loop().call_later(timeout, callback)
    try:
        yield
    finally:
        timer.cancel()


def answer_expired_deadlines() -> None:
    """Install `_deadline_start` (idempotent; grpclib 0.4's DeadlineWrapper)."""
    require("grpclib")
    grpclib.utils.DeadlineWrapper.start = _deadline_start  # type: ignore[method-assign]


async def _stream_send_headers(
    self: grpclib.protocol.Stream, headers: list[tuple[str, str]], end_stream: bool = False
) -> None:
    """grpclib's `Stream.send_headers` (0.4), with the headers from `send_headers_fast`;
    trailers also mark the end of the call's answer for its server-side time."""
    assert self.id is not None
    await self.connection.write_ready.wait()
    # grpclib's own workaround: h2 would try to create a stream it has forgotten.
    if self.id not in self._h2_connection.streams:
        raise StreamClosedError(self.id)
    h2 = self._h2_connection
    if not send_headers_fast(h2, self.id, headers, end_stream):
        h2.send_headers(self.id, headers, end_stream=end_stream)
    self._transport.write(h2.data_to_send())
    self.connection.headers_send_process()
    if end_stream:
        call = call_of(self)
        ends = getattr(self._transport, "answer_ends", None)  # the server's corked transport
        if call is not None and ends is not None:
            ends(call.path, call.deadline.arrived)


class _Silent:
    """A module logger that drops everything.

    hpack logs every header field it encodes or decodes at DEBUG (values
    included: bearer tokens, principals), through a real `logging.Logger`
    whose level check alone cost a refusal about 5 % of its CPU.
    """

    __slots__ = ()

    def debug(self, *args: object, **kwargs: object) -> None:
        return None


def _short_frame_repr(frame: Frame) -> str:
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


def lighten_h2() -> None:
    """Send response headers from `header_block`, and take two debugging aids off
    h2's per-frame path (idempotent).

    h2's `send_headers` cost an answer about 70 µs (its headers and trailers)
    in a hot loop; from `header_block`, about 18 µs.

    h2 formats `repr(frame)` for its no-op trace logger on every frame it
    receives, and hyperframe's repr re-serializes the frame body to show it:
    about 8 % of a refusal's CPU. The repr keeps the frame type and stream.
    hpack's loggers are silenced (see `_Silent`).
    """
    require("grpclib", "h2", "hpack", "hyperframe")
    Frame.__repr__ = _short_frame_repr  # type: ignore[method-assign]
    grpclib.protocol.Stream.send_headers = _stream_send_headers  # type: ignore[method-assign]
    for module in (hpack.hpack, hpack.table):
        if isinstance(getattr(module, "log", None), logging.Logger):
            module.log = _Silent()  # type: ignore[attr-defined]


_Loop = _base.BaseTrioEventLoop
_original = _Loop._main_loop_one
# What the replacement relies on: the queue it takes callbacks from (and sizes a batch
# by), the nursery it starts Trio tasks in, the timer heap, and the handle classes.
_NEEDS = frozenset({"_q_recv", "receive_nowait", "_timers", "_nursery", "_started"})


#: Each loop's heap size that triggers a full sweep (`drop_cancelled_timers`), kept beside
#: the loop rather than on it.
_REBUILD_AT: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _rebuild_at(loop: Any) -> list[int]:
    state = _REBUILD_AT.get(loop)
    if state is None:
        state = _REBUILD_AT[loop] = [REBUILD_MIN]
    return state


def _due_timer(loop: Any) -> Any:
    """The timer heap's head when its time has come (popped), else None."""
    timers = loop._timers
    if timers and timers[0]._when <= loop.time():
        return heapq.heappop(timers)
    return None


def _dispatch(loop: Any, obj: Any, due: bool) -> None:
    """Run one object as trio-asyncio's main loop does (`due`: a timer off the heap, not a
    new one from the queue), without waiting for a Trio task it starts to take its first
    step (see `batch_ready_callbacks`)."""
    if not due and isinstance(obj, asyncio.TimerHandle):
        heapq.heappush(loop._timers, obj)
    elif isinstance(obj, _AsyncHandle):
        obj._context.run(loop._nursery.start_soon, obj._run, name=obj._callback)
    elif not obj._cancelled:
        previous, sniffio_library.name = sniffio_library.name, "asyncio"
        try:
            obj._run()
        finally:
            sniffio_library.name = previous


async def _main_loop_one(self: Any, no_wait: bool = False) -> None:
    timers = self._timers
    if timers:
        drop_cancelled_timers(timers, _rebuild_at(self))
    obj = _due_timer(self)
    due = obj is not None
    if due:
        pass
    elif no_wait:
        obj = self._q_recv.receive_nowait()
    else:
        timeout = timers[0]._when - self.time() if timers else math.inf
        with trio.move_on_after(timeout):
            obj = await self._q_recv.receive()
        if obj is None:
            return  # a timer is due: the next call runs it
    _dispatch(self, obj, due)
    if no_wait:
        return
    # As many more as were queued at this moment, each without a yield.
    for _ in range(self._q_recv.statistics().current_buffer_used):
        if self._stopped.is_set():
            return
        obj = _due_timer(self)
        due = obj is not None
        if not due:
            try:
                obj = self._q_recv.receive_nowait()
            except trio.WouldBlock:
                return
        _dispatch(self, obj, due)


_main_loop_one.batched = True  # type: ignore[attr-defined]


def batch_ready_callbacks() -> bool:
    """Install the batching main loop (idempotent); False if trio-asyncio's internals moved."""
    require("trio-asyncio")
    if getattr(_Loop._main_loop_one, "batched", False):
        return True
    code = getattr(_original, "__code__", None)
    if code is None or "no_wait" not in code.co_varnames or not set(code.co_names) >= _NEEDS:
        log.warning("aio_batching_off", extra={"detail": "trio_asyncio main loop changed"})
        return False
    _Loop._main_loop_one = _main_loop_one
    return True
