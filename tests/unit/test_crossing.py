"""A call crossed from asyncio into Trio is freed by reference counting when it ends.

`trio_as_aio` alone leaves its future and the Trio task's handle in a reference
cycle (the handle holds the future, the future's replaced `cancel` holds the
handle) that keeps each call's arguments and answer alive until the cyclic
collector runs. These tests run with the collector off, so anything still alive
after the call is held by such a cycle.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import trio
import trio_asyncio

from ibex.service.edge.crossing import answer_in_trio, in_trio


class Payload:
    """Something a weak reference can watch."""


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def cross(
    body: Callable[[], object], caller: Callable[..., object] = in_trio
) -> tuple[weakref.ref[Payload], weakref.ref[Payload], str]:
    """Cross `body` from an asyncio task into Trio; weak refs to its argument and answer."""
    seen: dict[str, weakref.ref[Payload]] = {}

    async def in_trio_side(arg: Payload) -> Payload:
        await trio.lowlevel.checkpoint()
        out = Payload()
        seen["answer"] = weakref.ref(out)
        body()
        return out

    async def asyncio_side() -> str:
        arg = Payload()
        seen["arg"] = weakref.ref(arg)
        try:
            await caller(in_trio_side, arg)  # type: ignore[operator]
        except ValueError:
            return "raised"
        return "answered"

    outcome = await trio_asyncio.aio_as_trio(asyncio_side)()
    return seen["arg"], seen["answer"], outcome


async def test_an_answered_call_leaves_nothing_alive(no_collector: None) -> None:
    async with trio_asyncio.open_loop():
        arg, answer, outcome = await cross(lambda: None)
    assert outcome == "answered"
    assert arg() is None
    assert answer() is None


async def test_a_call_that_raises_leaves_nothing_alive(no_collector: None) -> None:
    def fail() -> None:
        raise ValueError("no")

    async with trio_asyncio.open_loop():
        arg, answer, outcome = await cross(fail)
    assert outcome == "raised"
    assert arg() is None
    assert answer() is None


async def test_trio_as_aio_alone_keeps_the_call_alive(no_collector: None) -> None:
    """The control: without `in_trio` the cycle holds the call, so the tests above can fail
    (if trio-asyncio stops making the cycle, this fails and `in_trio` can go)."""

    def plain(proc: Callable[..., object], *args: object) -> object:
        return trio_asyncio.trio_as_aio(proc)(*args)

    async with trio_asyncio.open_loop():
        arg, answer, outcome = await cross(lambda: None, plain)
    assert outcome == "answered"
    assert answer() is not None
    gc.collect()
    assert answer() is None and arg() is None


async def test_a_cancelled_caller_cancels_the_trio_side_and_leaves_nothing_alive(
    no_collector: None,
) -> None:
    started = trio.Event()
    ended: list[str] = []
    refs: dict[str, weakref.ref[Payload]] = {}

    async def slow(arg: Payload) -> Payload:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            ended.append("cancelled")
            raise
        return arg

    async def asyncio_side() -> str:
        arg = Payload()
        refs["arg"] = weakref.ref(arg)
        task = asyncio.ensure_future(in_trio(slow, arg))
        del arg
        await trio_asyncio.trio_as_aio(started.wait)()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "answered"

    async with trio_asyncio.open_loop():
        outcome = await trio_asyncio.aio_as_trio(asyncio_side)()
    assert outcome == "cancelled"
    assert ended == ["cancelled"]
    assert refs["arg"]() is None


class Stream:
    """What `answer_in_trio` uses of grpclib's server stream when the Trio side cannot write
    the reply (it has sent its headers already, as far as `send_reply_now` can tell)."""

    _send_initial_metadata_done = True

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.ended = asyncio.Event()  # the trailers went out

    async def send_initial_metadata(self, *, metadata: object) -> None:
        self.sent.append("headers")

    async def send_message(self, message: object) -> None:
        self.sent.append("message")

    async def send_trailing_metadata(self) -> None:
        self.sent.append("trailers")
        self.ended.set()


async def test_a_handed_answer_is_sent_before_the_trio_side_ends_and_nothing_stays_alive(
    no_collector: None,
) -> None:
    """Handed over early, the reply goes out (trailers too) while the Trio call still runs;
    the handler returns only once it has ended; nothing of the call is left alive."""
    release = trio.Event()
    order: list[str] = []
    refs: dict[str, weakref.ref[Payload]] = {}

    async def trio_side(arg: Payload, hand: Callable[[Payload], None]) -> Payload:
        out = Payload()
        refs["answer"] = weakref.ref(out)
        hand(out)
        await release.wait()
        order.append("trio side ended")
        return out

    def reply_of(answer: Payload) -> tuple[dict[str, str], Payload]:
        return {"x": "1"}, answer

    async def asyncio_side() -> None:
        arg = Payload()
        refs["arg"] = weakref.ref(arg)
        stream = Stream()
        task = asyncio.ensure_future(answer_in_trio(stream, reply_of, trio_side, arg))
        del arg
        await stream.ended.wait()
        assert stream.sent == ["headers", "message", "trailers"]
        order.append("sent")
        release.set()
        await task
        order.append("handler returned")

    async with trio_asyncio.open_loop():
        with trio.fail_after(10):
            await trio_asyncio.aio_as_trio(asyncio_side)()
    assert order == ["sent", "trio side ended", "handler returned"]
    assert refs["arg"]() is None
    assert refs["answer"]() is None
