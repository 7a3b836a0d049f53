"""Calls from grpclib's asyncio handlers into Trio that free themselves when they end.

trio-asyncio's `trio_as_aio` runs the Trio function in a task of its own and
resolves an asyncio Future with its outcome. Two reference cycles per call
come with it, and each keeps the call's request, ticket and answer alive
until the cyclic collector finds them; collected in bulk, they make the
collector's passes the loop's longest stalls (milliseconds, every few hundred
answers), and those land on calls waiting at their wall:

- to forward a cancellation of the future to the Trio task, it replaces the
  future's `cancel` with a closure over the task's handle, which holds the
  future. Once the future is done there is nothing left to forward
  (cancelling a done future does nothing either way), so `in_trio` removes
  the override;
- an exception raised through the handle stays in a local of the handle's
  frame, which the exception's own traceback holds. `in_trio` therefore
  passes an exception across as a value and raises it on the asyncio side.
  Only `Exception`s go across that way: Trio's `Cancelled` (and any other
  BaseException) must unwind through the handle's cancel scope as before.

`in_trio_handing` lets the Trio side hand its answer over before it ends (an
answer made before the wall, handed over while the cut branch unwinds): the
asyncio side gets the answer at once, and awaits the Trio side's end before it
ends itself, so the call still ends after everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["in_trio", "in_trio_handing"]

T = TypeVar("T")


class _Raised:
    """An exception carried across the crossing as a value."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


async def _captured(proc: Callable[..., Awaitable[T]], *args: Any) -> T | _Raised:
    try:
        return await proc(*args)
    except Exception as exc:
        return _Raised(exc)


async def in_trio(proc: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await proc(*args)` in a Trio task of the trio-asyncio loop, as `trio_as_aio` does."""
    loop: Any = asyncio.get_running_loop()
    # No local holds the future: a raised error's traceback holds this frame.
    return await _outcome(loop.trio_as_future(_captured, proc, *args))


async def _outcome(fut: asyncio.Future[T | _Raised]) -> T:
    """The Trio call's value, or its exception raised here; frees what the crossing holds."""
    try:
        got = await fut
        if not isinstance(got, _Raised):
            return got
        error = got.error
        try:
            raise error
        finally:
            del error, got  # the traceback holds this frame: hold nothing it leads to
    finally:
        if fut.done():
            with contextlib.suppress(AttributeError):  # not overridden: no cycle
                del fut.cancel
        del fut


_ENDED = object()  # the Trio call ended without handing anything over


async def in_trio_handing(
    proc: Callable[..., Awaitable[T]], *args: Any
) -> tuple[T, Coroutine[Any, Any, T] | None]:
    """`await proc(*args, hand)` in a Trio task, returning as soon as `proc` calls
    `hand(answer)` (synchronously, in the loop) or ends.

    Returns the answer and, when it was handed over before the call ended, the
    call's end, which the caller must await (it returns the call's value or raises
    its exception), so nothing the call started outlives the caller. Cancelled
    before the answer, the Trio call is cancelled and awaited, as with `in_trio`.
    """
    loop: Any = asyncio.get_running_loop()
    first: asyncio.Future[Any] = loop.create_future()

    def hand(answer: T) -> None:
        if not first.done():
            first.set_result(answer)

    def ended(_: object) -> None:
        if not first.done():
            first.set_result(_ENDED)

    fut: asyncio.Future[T | _Raised] = loop.trio_as_future(_captured, proc, *args, hand)
    fut.add_done_callback(ended)
    try:
        got = await first
    except asyncio.CancelledError:
        fut.cancel()
        with contextlib.suppress(BaseException):
            await _outcome(fut)
        raise
    outcome = _outcome(fut)
    del fut  # a raised error's traceback holds this frame: hold nothing it leads to
    if got is _ENDED:
        return await outcome, None
    return got, outcome
