"""Reads on leased connections of one redis-py pool (one endpoint, or Sentinel's master).

A lease closes its connection on any BaseException before releasing it, so a reply
left on the wire by a cancelled or timed-out command is never read by the next
lease; one broken connection gets one re-lease, after the pool's idle siblings are
dropped (a broken pooled socket usually means the server restarted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from ibex.errors import SourceError
from ibex.sources.redis_early_reply import EarlyReply

__all__ = ["PoolReader"]


class PoolReader:
    """GETs on leased connections of one pool (one endpoint, or Sentinel's master)."""

    def __init__(
        self, pool: aredis.ConnectionPool, retries: int, sentinel: Sentinel | None = None
    ) -> None:
        self.pool = pool
        self._retries = retries
        self._sentinel = sentinel

    async def get(self, key: str) -> object:
        return await self._command("GET", key)

    async def get_many(self, keys: list[str]) -> list[object]:
        """One MGET: the keys share one connection and one round trip."""
        reply = await self._command("MGET", *keys)
        if not isinstance(reply, list):
            raise SourceError(f"redis: unexpected reply type {type(reply).__name__}")
        return reply

    async def get_early(
        self, keys: list[str], early: Callable[[list[bytes | None]], None], limit: int
    ) -> list[object]:
        """GET (one key) or MGET, with `early` told the values in the transport's data
        callback, as soon as the whole reply has arrived: the task that reads the reply
        (and whatever waits on it) runs a pass of the loop later. A reply that is not a
        plain one (an error, a value over `limit` bytes, bytes before it such as a
        health-check PONG) is never told early; the usual parse still answers."""
        command = ("GET", *keys) if len(keys) == 1 else ("MGET", *keys)
        reply = await self._command(*command, early=EarlyReply(len(keys) > 1, keys, limit, early))
        if len(keys) == 1:
            return [reply]
        if not isinstance(reply, list):
            raise SourceError(f"redis: unexpected reply type {type(reply).__name__}")
        return reply

    async def _command(self, *command: str, early: EarlyReply | None = None) -> object:
        retries = self._retries
        while True:
            try:
                return await self._leased(*command, early=early)
            except _BrokenConnection:
                if retries <= 0:
                    raise
                retries -= 1
                # One broken pooled socket usually means the server restarted: its
                # idle siblings are stale too, so drop them rather than burn requests.
                await _drop_idle(self.pool)

    async def warm(self, connections: int) -> None:
        """Lease `connections` connections at once, PING each, release them (LIFO: the
        last released is the next GET's). A failed one is closed before release."""
        pool = self.pool
        leased: list[Any] = []
        try:
            for _ in range(max(1, connections)):
                leased.append(await pool.get_connection())
            for conn in leased:
                await conn.send_command("PING")
                await conn.read_response()
        except BaseException:
            for conn in leased:
                await conn.disconnect(nowait=True)
            raise
        finally:
            for conn in reversed(leased):
                await pool.release(conn)

    async def close(self) -> None:
        try:
            await self.pool.disconnect()
        finally:
            if self._sentinel is not None:
                await self._sentinel.aclose()

    async def _leased(self, *command: str, early: EarlyReply | None = None) -> object:
        pool = self.pool
        conn = await pool.get_connection()
        watched = None if early is None else early.watch(conn)
        try:
            await conn.send_command(*command)
            return await conn.read_response(disable_decoding=True)
        except BaseException as exc:
            # Close before release, so a reply still on the wire (cancellation,
            # timeout) can never be read by the next lease. disconnect(nowait=True)
            # closes the transport before its first suspension point, so even a
            # second cancellation cannot skip the close.
            await conn.disconnect(nowait=True)
            if isinstance(exc, RedisConnectionError):
                raise _BrokenConnection(str(exc)) from exc
            raise
        finally:
            if watched is not None:
                watched.unwatch()
            await pool.release(conn)


async def _drop_idle(pool: aredis.ConnectionPool) -> None:
    """Best effort: disconnect the pool's idle connections.

    redis-py gathers the disconnects with `return_exceptions=True` and re-raises
    the first failure, including an asyncio.CancelledError that belongs to one
    of those connections (seen during a sentinel failover), not to this task.
    Raised out of a GET, it escaped the directive branch as a cancellation. Only
    this task's own cancellation propagates.
    """
    try:
        await pool.disconnect(inuse_connections=False)
    except (RedisError, OSError):
        pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise


class _BrokenConnection(RedisConnectionError):
    """An established (maybe stale) connection failed mid-command: worth one re-lease."""
