"""redis-py's writes under a `wait_for` that never drops a cancellation (Python < 3.12).

Python 3.11's `asyncio.wait_for` runs the awaitable in a task of its own; a
cancellation that arrives as that task finishes is dropped and the result
returned (CPython gh-86296). redis-py writes every command under it, so a
directive GET cancelled at its 5 ms budget while reconnecting went on to wait
for a sleeping server (tests/chaos/test_redis_chaos.py saw it under load).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio.connection as redis_connection

from ibex.patches.redis_connection import honour_cancellation_in_redis_writes, wait_for


def outcomes(impl: Callable[[Any, float], Any]) -> list[str]:
    """A write that suspends once, cancelled after 0..5 loop steps: how each call ended."""

    async def main() -> list[str]:
        out = []
        for steps in range(6):

            async def write() -> str:
                await asyncio.sleep(0)
                return "written"

            coro = write()
            task = asyncio.ensure_future(impl(coro, 1.0))
            for _ in range(steps):
                await asyncio.sleep(0)
            if not task.cancel():
                out.append("done before the cancel")
                await task
                continue
            try:
                out.append(await task)
            except asyncio.CancelledError:
                out.append("cancelled")
            coro.close()  # cancelled before it started: never awaited (a no-op otherwise)
        return out

    return asyncio.run(main())


def test_a_cancelled_write_ends_cancelled_whenever_the_cancel_lands() -> None:
    got = outcomes(wait_for)
    assert "written" not in got  # a cancel that found the call running always wins
    assert "cancelled" in got


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in Python 3.12")
def test_the_standard_wait_for_of_this_python_drops_such_a_cancel() -> None:
    """Why the module exists: the same sequence against asyncio.wait_for."""
    assert "written" in outcomes(asyncio.wait_for)


def test_timeouts_behave_as_asyncio_wait_for() -> None:
    async def main() -> None:
        assert await wait_for(asyncio.sleep(0, "r"), None) == "r"
        assert await wait_for(asyncio.sleep(0, "r"), 1.0) == "r"
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.sleep(1.0), 0.01)
        done = asyncio.get_running_loop().create_future()
        done.set_result("already")
        assert await wait_for(done, 0) == "already"
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.sleep(1.0), 0)
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.sleep(1.0), -1.0)

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="not patched from Python 3.12")
def test_redis_pys_connection_module_writes_under_it() -> None:
    honour_cancellation_in_redis_writes()
    honour_cancellation_in_redis_writes()  # idempotent
    patched = redis_connection.asyncio
    assert patched.wait_for is wait_for
    assert patched.TimeoutError is asyncio.TimeoutError  # everything else is asyncio's
    assert patched.open_connection is asyncio.open_connection
    assert asyncio.wait_for is not wait_for  # nobody else's wait_for changed
