"""`benchmarks.aio.run`: plain asyncio even after trio_asyncio installed its policy.

trio_asyncio's policy makes `asyncio.run` build a SyncTrioEventLoop (a Trio run in
a thread of its own); the load generators and the floor's `asyncio` mode must not
pay for that, or their figures are partly trio-asyncio's.
"""

from __future__ import annotations

import asyncio

from trio_asyncio._base import BaseTrioEventLoop

from benchmarks import aio


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_run_uses_the_selector_loop_under_trio_asyncios_policy() -> None:
    assert issubclass(asyncio.run(_loop_type()), BaseTrioEventLoop)  # the reason
    loop_type = aio.run(_loop_type())
    assert issubclass(loop_type, asyncio.SelectorEventLoop)
    assert not issubclass(loop_type, BaseTrioEventLoop)


def test_run_returns_the_coroutines_value_and_closes_its_loop() -> None:
    async def value() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    loop = aio.run(value())
    assert loop.is_closed()
