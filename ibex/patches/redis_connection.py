"""redis-py's asyncio connections: writes under a `wait_for` that never drops a
cancellation, and a leased connection's incoming bytes seen as they arrive.

redis-py writes every command under `asyncio.wait_for`, which before Python
3.12 returns the write's result and drops the cancellation when both land in
the same loop step (CPython gh-86296): a cancelled GET goes on to wait for
the reply of a sleeping server, far past its branch's deadline. redis-py's
connection module therefore gets `wait_for` as Python 3.12 has it, on top of
`asyncio.timeout`. Installed explicitly at start-up, through
`ibex.patches.install_patches`.

`tap_replies` hooks one leased connection's `asyncio.StreamReader.feed_data`
(redis-py's private `_reader`) as an instance attribute, for the lease only:
what `ibex.sources.redis_early_reply` reads a reply's values from, a pass of the
loop before redis-py parses it. redis-py's version is checked with the
`wait_for` patch above, at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import redis.asyncio.connection as _redis_connection

from ibex.versions import require


async def wait_for(aw: Any, timeout: float | None) -> Any:  # noqa: ASYNC109  (its signature)
    """`asyncio.wait_for` as Python 3.12 has it: the awaitable runs in this task under
    `asyncio.timeout`, so a cancellation of this task is never traded for a result."""
    if timeout is None:
        return await aw
    if timeout <= 0:
        fut = asyncio.ensure_future(aw)
        if fut.done():
            return fut.result()
        fut.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fut
        try:
            return fut.result()
        except asyncio.CancelledError as exc:
            raise TimeoutError from exc
    async with asyncio.timeout(timeout):
        return await aw


class _AsyncioWithWaitFor(types.ModuleType):
    """The `asyncio` module as redis-py's connection module sees it, but for `wait_for`."""

    wait_for = staticmethod(wait_for)

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


def honour_cancellation_in_redis_writes() -> None:
    """Give redis-py's asyncio connections the `wait_for` above (idempotent; Python < 3.12).

    Checked, so a redis-py that stops using `asyncio.wait_for` this way fails loudly.
    """
    require("redis")
    if sys.version_info >= (3, 12):
        return
    current = getattr(_redis_connection, "asyncio", None)
    if isinstance(current, _AsyncioWithWaitFor):
        return
    if current is not asyncio:
        raise RuntimeError("redis-py's asyncio connection module changed; cannot patch wait_for")
    _redis_connection.asyncio = _AsyncioWithWaitFor("asyncio")


def tap_replies(conn: Any, seen: Callable[[bytes], None]) -> Callable[[], None] | None:
    """Tell `seen` every chunk of bytes the leased connection `conn` receives, in the
    transport's data callback, once its reader holds it; the function returned removes
    the tap and leaves the reader as it was. None when `conn` has no asyncio reader or
    is tapped already."""
    reader = getattr(conn, "_reader", None)
    if not isinstance(reader, asyncio.StreamReader) or "feed_data" in vars(reader):
        return None
    feed = reader.feed_data

    def fed(data: bytes) -> None:
        feed(data)
        seen(data)

    def untap() -> None:
        vars(reader).pop("feed_data", None)

    reader.feed_data = fed  # type: ignore[method-assign, assignment]
    return untap
