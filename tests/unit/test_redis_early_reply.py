"""The early parse of a GET or MGET reply (`parse_values`): only a whole, plain reply of
the expected shape is told early; anything else is left to redis-py's own parse."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ibex.patches.redis_connection import tap_replies
from ibex.sources.redis_early_reply import EarlyReply, parse_values

MGET = b'*3\r\n$13\r\n{"v": 1, "x"}\r\n$-1\r\n$12\r\nline\r\n$3\r\nab\r\n'


def test_a_whole_mget_reply_gives_its_values_and_nil_as_none() -> None:
    assert parse_values(MGET, 3, 100) == [b'{"v": 1, "x"}', None, b"line\r\n$3\r\nab"]
    resp3 = MGET.replace(b"$-1\r\n", b"_\r\n")
    assert parse_values(resp3, 3, 100) == parse_values(MGET, 3, 100)
    for end in range(len(resp3)):
        assert parse_values(resp3[:end], 3, 100) is None, end


def test_every_strict_prefix_of_a_reply_is_incomplete() -> None:
    """Framing comes from the lengths: a value holding `\\r\\n$3\\r\\n` is not a new bulk."""
    for end in range(len(MGET)):
        assert parse_values(MGET[:end], 3, 100) is None, end


def test_a_get_reply_is_one_bulk_string_or_nil() -> None:
    assert parse_values(b"$5\r\nhello\r\n", None, 100) == [b"hello"]
    assert parse_values(b"$-1\r\n", None, 100) == [None]
    assert parse_values(b"_\r\n", None, 100) == [None]  # RESP3's null
    assert parse_values(b"$0\r\n\r\n", None, 100) == [b""]


@pytest.mark.parametrize(
    ("raw", "count"),
    [
        (b"-ERR wrong number of arguments\r\n", 3),  # an error reply
        (b"+PONG\r\n" + MGET, 3),  # a health check's answer first
        (MGET + b"+PONG\r\n", 3),  # bytes past the reply
        (MGET, 2),  # another count than the keys asked
        (b"*3\r\n$101\r\n", 3),  # a value over the limit
        (b"$5\r\nhelloXY", None),  # no CRLF after the value
        (b"$-2\r\n", None),
        (b"$+5\r\nhello\r\n", None),
        (b"$" + b"9" * 20 + b"\r\n", None),  # an overlong header
        (b"*1\r\n:1\r\n", 1),  # an integer, not a bulk string
        (b"_x\r\n", None),
    ],
)
def test_anything_but_a_plain_reply_of_the_expected_shape_is_refused(
    raw: bytes, count: int | None
) -> None:
    with pytest.raises(ValueError):
        parse_values(raw, count, 100)


def test_a_re_lease_after_a_broken_connection_parses_only_the_new_connections_bytes() -> None:
    """The bytes a broken connection got before it broke are no part of the reply the
    re-leased one gets: a value is never framed from the two together."""
    loop = asyncio.new_event_loop()
    try:
        told: list[list[bytes | None]] = []
        early = EarlyReply(True, ["k1", "k2"], 100, told.append)
        for data in (b"*2\r\n$5\r\nhel", b"*2\r\n$5\r\nhello\r\n$-1\r\n"):
            reader = asyncio.StreamReader(loop=loop)
            watched = early.watch(SimpleNamespace(_reader=reader))
            assert watched is not None
            reader.feed_data(data)
            watched.unwatch()
            assert "feed_data" not in vars(reader)  # the reader is left as it was
            assert await_read(loop, reader, len(data)) == data  # and got every byte
    finally:
        loop.close()
    assert told == [[b"hello", None]]


def await_read(loop: asyncio.AbstractEventLoop, reader: asyncio.StreamReader, n: int) -> bytes:
    return loop.run_until_complete(reader.readexactly(n))


def test_a_connection_is_tapped_once_and_untapped_as_it_was() -> None:
    """The tap sees each chunk after the reader holds it; a second tap of the same
    connection is refused; untapping leaves the reader with its own `feed_data`."""
    loop = asyncio.new_event_loop()
    try:
        reader = asyncio.StreamReader(loop=loop)
        conn = SimpleNamespace(_reader=reader)
        seen: list[bytes] = []
        untap = tap_replies(conn, seen.append)
        assert untap is not None
        assert tap_replies(conn, seen.append) is None
        reader.feed_data(b"$2\r\n")
        reader.feed_data(b"ab\r\n")
        untap()
        assert "feed_data" not in vars(reader)
        reader.feed_data(b"+PONG\r\n")
        assert seen == [b"$2\r\n", b"ab\r\n"]
        assert await_read(loop, reader, 15) == b"$2\r\nab\r\n+PONG\r\n"
    finally:
        loop.close()
    assert tap_replies(SimpleNamespace(), seen.append) is None  # no asyncio reader
