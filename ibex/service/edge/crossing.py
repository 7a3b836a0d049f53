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

grpclib cancels a handler's task at the caller's deadline, when the caller
resets the stream, says GOAWAY or the connection is lost. If the Trio side was
past its last checkpoint, trio-asyncio hands its result over anyway and the
cancel never surfaces in the handler (`cancel_swallowed`). Sending the answer
then meets h2's closed stream or connection, and finishing normally makes grpclib
log "Failed to handle cancellation" at error level: the caller is gone, so the
handler ends cancelled instead (`raise_swallowed_cancel`), which its wrapper
counts as a deadline miss or a caller gone. `in_trio` and `answer_in_trio` check
this before anything is sent.

`answer_in_trio` answers a unary call from the Trio side: the answer, returned
or handed over before the Trio call ends (an answer made before the wall, handed
over while the cut branch unwinds), is written to the call's stream there and
then when the connection takes the whole reply at once (`send_reply_now`), so no
pass of the asyncio side is on its way out; otherwise the handler sends it. The
handler ends only after the Trio side has, so the call still ends after
everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpclib.server

from ibex.service.edge.unary_reply import send_reply, send_reply_now

__all__ = ["Reply", "answer_in_trio", "cancel_swallowed", "in_trio", "raise_swallowed_cancel"]

log = logging.getLogger(__name__)

T = TypeVar("T")

Reply = tuple[Mapping[str, str], Any]
"""A unary call's reply: its initial metadata and its one message."""


def cancel_swallowed() -> bool:
    """True when grpclib cancelled the current handler's task but the cancel never surfaced."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_swallowed_cancel() -> None:
    """End the handler cancelled, as grpclib expects, when its cancel was swallowed."""
    if cancel_swallowed():
        raise asyncio.CancelledError from None


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
    """`await proc(*args)` in a Trio task of the trio-asyncio loop, as `trio_as_aio` does;
    a cancel of the handler that the Trio side's result swallowed is raised."""
    loop: Any = asyncio.get_running_loop()
    # No local holds the future: a raised error's traceback holds this frame.
    got = await _outcome(loop.trio_as_future(_captured, proc, *args))
    raise_swallowed_cancel()
    return got


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


class _Handed:
    """An answer handed to the asyncio side: its reply, and whether it has left already."""

    __slots__ = ("answer", "reply", "sent")

    def __init__(self, answer: Any, reply: Reply | None, sent: bool) -> None:
        # `sent` is set after the handler was told: it reads it only once it runs.
        self.answer, self.reply, self.sent = answer, reply, sent


_ENDED = _Handed(None, None, False)  # the Trio call ended without handing anything over


async def answer_in_trio(
    stream: grpclib.server.Stream[Any, Any],
    reply_of: Callable[[T], Reply],
    proc: Callable[..., Awaitable[T]],
    *args: Any,
    sending: Callable[[T], None] | None = None,
) -> None:
    """Answer a unary call with `reply_of(answer)`, where `answer` is what
    `await proc(*args, hand)` returns in a Trio task, or what it hands over before
    that with `hand(answer)` (synchronously, in the loop).

    The reply is made and written on the Trio side as soon as the answer is known
    (`send_reply_now`); where the connection cannot take all of it at once, the
    handler sends it. `sending(answer)` is told of every answer sent: after it was
    written on the Trio side (off the answer's way out), or before the handler
    sends it. The handler returns once the Trio call has ended, raising its
    exception if it raised one. Cancelled before the answer, the Trio call is
    cancelled and awaited, as with `in_trio`; a swallowed cancel ends the handler
    cancelled, and nothing is sent after it.
    """
    loop: Any = asyncio.get_running_loop()
    first: asyncio.Future[_Handed] = loop.create_future()

    def hand(answer: T) -> None:
        if first.done():  # handed over already, or the handler was cancelled
            return
        reply = reply_of(answer)
        handed = _Handed(answer, reply, False)
        first.set_result(handed)  # the handler wakes after this step, whatever it does
        try:
            handed.sent = send_reply_now(stream, *reply)
        except Exception:
            log.exception("reply_failed")
        if handed.sent and sending is not None:
            sending(answer)

    async def answering(*args: Any) -> T:
        answer = await proc(*args)
        hand(answer)
        return answer

    def ended(_: object) -> None:
        if not first.done():
            first.set_result(_ENDED)

    fut: asyncio.Future[T | _Raised] = loop.trio_as_future(_captured, answering, *args, hand)
    fut.add_done_callback(ended)
    try:
        got = await first
    except asyncio.CancelledError:
        fut.cancel()
        with contextlib.suppress(BaseException):
            await _outcome(fut)
        raise
    end = _outcome(fut)
    del fut  # a raised error's traceback holds this frame: hold nothing it leads to
    try:
        if got.reply is not None and not got.sent and not cancel_swallowed():
            if sending is not None:
                sending(got.answer)
            await send_reply(stream, *got.reply)
            await stream.send_trailing_metadata()
    finally:
        await end
    raise_swallowed_cancel()
