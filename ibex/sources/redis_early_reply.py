"""Reading a GET or MGET reply's values as its bytes arrive (RESP2 and RESP3 plain replies).

redis-py parses a reply in the task that awaits it, one pass of the loop after its
bytes arrive. `EarlyReply` watches one leased connection's incoming bytes and tells
its values in the transport's data callback once the reply is whole, so the calls
waiting on a directive read are answered a pass earlier. The bytes come from
`ibex.patches.redis_connection.tap_replies` (a hook on redis-py's reader, for the
lease only); only replies of exactly the expected shape are taken, anything else
is left to redis-py's own parse. `parse_values` is pure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ibex.patches.redis_connection import tap_replies

__all__ = ["EarlyReply", "parse_values"]

log = logging.getLogger(__name__)


class EarlyReply:
    """Watches one leased connection's incoming bytes for the reply to a GET or MGET, and
    tells `early` its values in the transport's data callback once it is whole.

    Only the bytes fed after the lease are parsed, from their first byte (a leased
    connection has none pending: redis-py checks that when it leases), and only a
    reply of exactly the expected shape, ending at the last byte received, is told:
    anything else (an error reply, a health-check PONG first, a value over `limit`,
    bytes past the reply) stops the watch, and the usual parse answers alone. The
    value bytes are never taken for framing: each bulk's length is read first."""

    __slots__ = ("_buf", "_early", "_limit", "_many", "_n", "_told", "_untap")

    def __init__(
        self, many: bool, keys: list[str], limit: int, early: Callable[[list[bytes | None]], None]
    ) -> None:
        self._many, self._n, self._limit, self._early = many, len(keys), limit, early
        self._buf = bytearray()
        self._told = False
        self._untap: Callable[[], None] | None = None

    def watch(self, conn: Any) -> EarlyReply | None:
        """Watch `conn`, just leased (a re-lease after a broken connection starts over:
        the bytes the broken one got are not part of the new reply)."""
        self._buf = bytearray()
        if self._told:
            return None
        self._untap = tap_replies(conn, self._fed)
        return None if self._untap is None else self

    def unwatch(self) -> None:
        if self._untap is not None:
            self._untap()

    def _fed(self, data: bytes) -> None:
        if not self._told:
            self._seen(data)

    def _seen(self, data: bytes) -> None:
        self._buf += data
        try:
            values = parse_values(self._buf, self._n if self._many else None, self._limit)
        except ValueError:
            self._told = True  # not a plain reply: leave it to the usual parse
            return
        if values is not None:
            self._told = True
            try:
                self._early(values)
            except Exception:  # raised into the transport's callback, it would close it
                log.exception("directive_early_answers_failed")


def parse_values(
    buf: bytes | bytearray, count: int | None, limit: int
) -> list[bytes | None] | None:
    """The values of a whole GET reply (`count` None: one bulk string) or MGET reply (an
    array of `count` bulk strings), a missing key's value a null (RESP2's `$-1`, RESP3's
    `_`), ending exactly at the end of `buf`; None while it is incomplete. ValueError for
    anything else, or a value over `limit` bytes."""
    pos = 0
    if count is not None:
        head = _line(buf, 0, b"*")
        if head is None:
            return None
        digits, pos = head
        if digits != str(count).encode():
            raise ValueError("not the expected array")
    values: list[bytes | None] = []
    for _ in range(1 if count is None else count):
        if buf[pos : pos + 1] == b"_":  # RESP3's null (redis-py speaks RESP3 when it can)
            if len(buf) < pos + 3:
                return None
            if buf[pos + 1 : pos + 3] != b"\r\n":
                raise ValueError("not a plain null")
            values.append(None)
            pos += 3
            continue
        head = _line(buf, pos, b"$")
        if head is None:
            return None
        digits, pos = head
        if digits == b"-1":
            values.append(None)
            continue
        if not digits.isdigit() or len(digits) > 10 or int(digits) > limit:
            raise ValueError("not a plain bulk string")
        end = pos + int(digits)
        if len(buf) < end + 2:
            return None
        if buf[end : end + 2] != b"\r\n":
            raise ValueError("not a plain bulk string")
        values.append(bytes(buf[pos:end]))
        pos = end + 2
    if pos != len(buf):
        raise ValueError("bytes past the reply")
    return values


def _line(buf: bytes | bytearray, pos: int, kind: bytes) -> tuple[bytes, int] | None:
    """The header line at `pos` of type `kind` (its digits, the position after it); None
    while it is incomplete. ValueError for another type or an overlong line."""
    if len(buf) <= pos:
        return None
    if buf[pos : pos + 1] != kind:
        raise ValueError("unexpected reply type")
    end = buf.find(b"\r\n", pos, pos + 16)
    if end < 0:
        if len(buf) - pos >= 16:
            raise ValueError("overlong header")
        return None
    return bytes(buf[pos + 1 : end]), end + 2
