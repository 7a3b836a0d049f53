"""Directive source backed by the proxy-filled Redis cache (contract section 3).

The daemon's Trio code calls `get_directive`; the Redis I/O is redis-py's asyncio
client, crossed with `trio_asyncio.aio_as_trio`, so every call must run inside
`trio_asyncio.open_loop()`. The connection pool is built in `__init__` (that only
parses the URL) and binds to the running loop on first use: use one source per
process and per loop, and `aclose()` it inside the same loop.

Time policy: the caller owns the deadline (the directive branch's 5 ms cancel
scope). The socket timeouts below are only a backstop for callers without a
deadline; connects are not retried, so a dead Redis surfaces in well under a
millisecond, and one immediate re-lease after a broken connection picks up a
restarted Redis without operator action.

Cancellation: a GET cancelled mid-flight leaves its reply on the wire. If that
connection went back to the pool, the next lease would read the previous
tenant's directive. redis-py 8 closes the socket on BaseException inside
`read_response`/`send_packed_command`, but this module does not rely on it: the
lease below closes the connection on any BaseException *before* releasing it.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Final, cast

import msgspec
import redis.asyncio as aredis
import trio_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ibex.assembly.structs import Directive, InjectionMode
from ibex.sources.base import SourceError

__all__ = ["RedisDirectiveSource", "decode_directive", "directive_key"]

ENVELOPE_VERSION: Final = 1
_MODES: Final[frozenset[str]] = frozenset({"system_first", "system_append", "user_prepend"})

# Backstop timeouts (seconds). Loopback or same-zone Redis answers in well under
# a millisecond; anything slower than this is useless to a 5 ms branch anyway.
DEFAULT_CONNECT_TIMEOUT: Final = 0.1
DEFAULT_SOCKET_TIMEOUT: Final = 0.1
# A GET whose *established* connection breaks mid-command is re-leased once, at
# once, after the pool's idle connections are dropped. That is what makes a
# restarted server work on the very next call: pooled sockets still point at the
# old process, and asyncio may not have seen their FIN yet, so the pool's own
# stale-connection check can miss them. A failed connect is not retried, nor is a
# timeout: a refused or stuck server stays so within a 5 ms branch, and a backoff
# sleep alone costs ~1.5 ms under trio-asyncio. (redis-py's client default is 3
# retries up to 10 s apart with 5 s socket timeouts: seconds before a dead Redis
# surfaces.)
DEFAULT_RETRIES: Final = 1
# PING a connection that sat idle this long before reusing it (seconds).
DEFAULT_HEALTH_CHECK_INTERVAL: Final = 30.0
DEFAULT_MAX_CONNECTIONS: Final = 64
DEFAULT_MAX_VALUE_BYTES: Final = 1024 * 1024


class _Envelope(msgspec.Struct, frozen=True):
    """The cached value as the proxy writes it; injection_mode is checked after decode."""

    v: int
    content: str
    injection_mode: str = "system_first"
    version_id: uuid.UUID | None = None


class _VersionProbe(msgspec.Struct):
    """Only the version, to tell "newer format" from "broken value" on the error path."""

    v: Any = None


_decode_envelope = msgspec.json.Decoder(_Envelope).decode
_decode_probe = msgspec.json.Decoder(_VersionProbe).decode


def directive_key(org_id: str, agent_id: str) -> str:
    """`{org_id}:directive:{agent_id}` with lower-case canonical UUIDs."""
    try:
        org = uuid.UUID(org_id)
        agent = uuid.UUID(agent_id)
    except (ValueError, TypeError, AttributeError):
        raise SourceError("directive key: org_id and agent_id must be UUIDs") from None
    return f"{org}:directive:{agent}"


def decode_directive(raw: bytes) -> Directive:
    """Parse a cached value; SourceError (with no content in it) if it breaks the contract."""
    try:
        # msgspec checks UTF-8 only in the strings it keeps; the contract wants the
        # whole value valid, and checking it costs about a microsecond per 4 KiB.
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError("directive value: not UTF-8") from None
    try:
        env = _decode_envelope(raw)
    except msgspec.DecodeError as exc:
        raise SourceError(_decode_failure(raw, exc)) from None
    except RecursionError:  # msgspec's depth limit, even inside an ignored key
        raise SourceError("directive value: malformed JSON (nested too deeply)") from None
    if env.v != ENVELOPE_VERSION:
        raise SourceError(f"directive value: unsupported envelope version {env.v}")
    mode: InjectionMode = "system_first"
    if env.injection_mode in _MODES:
        mode = cast(InjectionMode, env.injection_mode)
    version = str(env.version_id) if env.version_id is not None else None
    return Directive(content=env.content, injection_mode=mode, version_id=version)


def _decode_failure(raw: bytes, exc: msgspec.DecodeError) -> str:
    """A short, content-free reason. msgspec's messages name only paths and types."""
    try:
        probe = _decode_probe(raw)
    except (msgspec.DecodeError, RecursionError):
        return "directive value: malformed JSON or not an object"
    v = probe.v
    if isinstance(v, int) and not isinstance(v, bool) and v != ENVELOPE_VERSION:
        return f"directive value: unsupported envelope version {str(v)[:20]}"
    if isinstance(exc, msgspec.ValidationError):
        # e.g. "Expected `str`, got `int` - at `$.content`": a type and a path, no value.
        return f"directive value: {str(exc)[:120]}"
    return "directive value: malformed JSON"


class RedisDirectiveSource:
    """DirectiveSource over a Redis (or Redis-compatible) server, read-only.

    `url` may be `redis://`, `rediss://` or `unix://`; URL query options (for
    example `?socket_timeout=0.5`) override the keyword defaults. Extra keyword
    arguments go to `redis.asyncio.ConnectionPool` (e.g. TLS CA files).
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        **pool_kwargs: Any,
    ) -> None:
        options: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout,
            "socket_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": health_check_interval,
            "max_connections": max_connections,
            # Named in CLIENT LIST for operators; CLIENT SETINFO skipped (one less
            # round trip per new connection, and Redis < 7.2 rejects it anyway).
            "client_name": "ibex-directive",
            "driver_info": None,
            **pool_kwargs,
        }
        try:
            self._pool: aredis.ConnectionPool = aredis.ConnectionPool.from_url(url, **options)
        except ValueError:
            # The URL may hold a password: never echo it.
            raise SourceError(
                "redis url: malformed (expected redis://, rediss:// or unix://)"
            ) from None
        self._retries = retries
        self._max_value_bytes = max_value_bytes
        self._closed = False

    async def get_directive(self, org_id: str, agent_id: str) -> Directive | None:
        """The directive, or None when the key is missing. Trio-async; cancel freely."""
        if self._closed:
            raise SourceError("redis directive source is closed")
        key = directive_key(org_id, agent_id)
        raw = await trio_asyncio.aio_as_trio(self._get)(key)
        if raw is None:
            return None
        if len(raw) > self._max_value_bytes:
            raise SourceError(f"directive value: {len(raw)} bytes exceeds the limit")
        return decode_directive(raw)

    async def aclose(self) -> None:
        """Disconnect every pooled connection. Trio-async, inside the same loop."""
        if self._closed:
            return
        self._closed = True
        # A dead or paused server cannot stop the close: the sockets are ours to drop.
        with contextlib.suppress(RedisError, OSError):
            await trio_asyncio.aio_as_trio(self._pool.disconnect)()

    async def _get(self, key: str) -> bytes | None:
        """asyncio side: one GET on a leased connection, errors mapped to SourceError."""
        try:
            return await self._get_re_leasing_broken(key)
        except RedisTimeoutError:
            raise SourceError("redis: timed out") from None
        except MaxConnectionsError:
            raise SourceError("redis: connection pool exhausted") from None
        except RedisConnectionError:
            raise SourceError("redis: connection failed") from None
        except ResponseError as exc:
            # The server's error prefix (e.g. WRONGTYPE) says enough; the rest may echo input.
            prefix = str(exc).split(" ", 1)[0][:32]
            raise SourceError(f"redis: error reply {prefix}") from None
        except (RedisError, OSError) as exc:
            raise SourceError(f"redis: {type(exc).__name__}") from None

    async def _get_re_leasing_broken(self, key: str) -> bytes | None:
        retries = self._retries
        while True:
            try:
                return await self._leased_get(key)
            except _BrokenConnection:
                if retries <= 0:
                    raise
                retries -= 1
                # One broken pooled socket usually means the server restarted: its
                # idle siblings are stale too, so drop them rather than burn requests.
                with contextlib.suppress(RedisError, OSError):
                    await self._pool.disconnect(inuse_connections=False)

    async def _leased_get(self, key: str) -> bytes | None:
        pool = self._pool
        conn = await pool.get_connection()
        try:
            try:
                await conn.send_command("GET", key)
                reply = await conn.read_response(disable_decoding=True)
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
            await pool.release(conn)
        if reply is not None and not isinstance(reply, bytes):
            raise SourceError(f"redis: unexpected reply type {type(reply).__name__}")
        return reply


class _BrokenConnection(RedisConnectionError):
    """An established (maybe stale) connection failed mid-command: worth one re-lease."""
