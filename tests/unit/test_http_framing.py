"""The sans-IO response framing (llhttp via httptools) on plain bytes, and fuzzed.

Expected values come from RFC 9112: what a message means, when it ends, and
which shapes a recipient must refuse (smuggling shapes above all). Every
failure must be a TransportError; no llhttp exception may escape.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ibex.sources.http_framing import (
    MAX_HEAD_BYTES,
    Response,
    ResponseParser,
    ResponseTooLarge,
    TransportError,
)

CAP = 1000
PROTOCOL_ERROR = r"^transport error \(RemoteProtocolError\)$"


def parse(*pieces: bytes, eof: bool = False, cap: int = CAP) -> tuple[Response, bool]:
    """(answer, reusable) after feeding the pieces; EOF after them if asked."""
    parser = ResponseParser(cap)
    for piece in pieces:
        if parser.feed(piece):
            return parser.response, parser.keep_alive
    if eof:
        return parser.feed_eof(), parser.keep_alive
    raise AssertionError("the answer did not complete")


VALID = {
    "content-length": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\nok",
        (200, b"ok", True),
    ),
    "no reason phrase": (b"HTTP/1.1 404\r\nContent-Length: 0\r\n\r\n", (404, b"", True)),
    "chunked with extension and trailer": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        (200, b"hello world", True),
    ),
    "chunked any case": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\nB\r\nhello world\r\n0\r\n\r\n",
        (200, b"hello world", True),
    ),
    "interim 100 and 103 skipped": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        (200, b"ok", True),
    ),
    "204 has no body": (b"HTTP/1.1 204 No Content\r\n\r\n", (204, b"", True)),
    "connection close": (
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        (200, b"ok", False),
    ),
    "http/1.0 closes by default": (
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        (200, b"ok", False),
    ),
    "http/1.0 keep-alive": (
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
        (200, b"ok", True),
    ),
    "leftover bytes": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", (200, b"ok", False)),
    "a second answer nobody asked for": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno",
        (200, b"ok", False),
    ),
}


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_answers(case: str) -> None:
    raw, (status, body, keep) = VALID[case]
    assert parse(raw) == ((status, body), keep)
    # Byte by byte, the parser stops at the end of the answer: bytes after it stay
    # on the connection, which the pool's idle check then sees.
    assert parse(*(raw[i : i + 1] for i in range(len(raw))))[0] == (status, body)


def test_close_delimited_body_ends_at_eof_and_is_not_reusable() -> None:
    raw = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"
    assert parse(raw[:20], raw[20:], eof=True) == ((200, b"until the end"), False)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
    ids=["nothing", "short content-length", "short chunked", "short head"],
)
def test_eof_before_the_end_is_a_read_error(raw: bytes) -> None:
    with pytest.raises(TransportError, match=r"^transport error \(ReadError\)$"):
        parse(raw, eof=True)


# RFC 9112 cases a recipient must refuse, each a RemoteProtocolError.
REJECTED = {
    # 2.2: a bare LF inside the header block would here yield a second Content-Length
    "bare lf smuggles a second content-length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\nContent-Length: 7\r\n\r\nokSMUGGLE"
    ),
    "bare lf ends a header": b"HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 2\r\n\r\nok",
    # 5.5: bare CR and NUL are not allowed in field values
    "bare cr in value": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "nul in value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    # 4: status-code is 3 digits, and 000-099 are no HTTP status
    "status 000": b"HTTP/1.1 000 OK\r\nContent-Length: 2\r\n\r\nok",
    "status 042": b"HTTP/1.1 042 OK\r\nContent-Length: 2\r\n\r\nok",
    "status 099": b"HTTP/1.1 099 OK\r\nContent-Length: 2\r\n\r\nok",
    "status not digits": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
    # 6.1: Transfer-Encoding in an HTTP/1.0 message means faulty framing
    "te on http/1.0 kept alive": (
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n"
    ),
    # 6.3: TE with CL is a smuggling shape; conflicting lengths are unrecoverable
    "te and cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
    "cl and te": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
    "conflicting cl": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    "cl list": b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok",
    "cl negative": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nok",
    "te gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx",
    "te gzip, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "http/2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "not http": b"HTTX/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "space before colon": b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok",
    "folded header": b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  folded\r\nContent-Length: 2\r\n\r\nok",
    "switching protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    "chunk size 0x": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
    "chunk without crlf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokX0\r\n\r\n",
    "huge head in one piece": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(REJECTED))
@pytest.mark.parametrize("split", [False, True])
def test_rfc9112_violations_are_refused(case: str, split: bool) -> None:
    raw = REJECTED[case]
    pieces = [raw[i : i + 3] for i in range(0, len(raw), 3)] if split else [raw]
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parse(*pieces, eof=True)


def test_an_endless_head_is_refused_before_it_is_buffered_whole() -> None:
    parser = ResponseParser(CAP)
    parser.feed(b"HTTP/1.1 200 OK\r\nX-Big: ")
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        for _ in range(MAX_HEAD_BYTES // 1024 + 2):
            parser.feed(b"a" * 1024)


@pytest.mark.parametrize(
    ("start", "forever"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: ", b"t"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=", b"e"),
        (b"", b"HTTP/1.1 100 Continue\r\n\r\n"),
    ],
    ids=["endless trailer", "endless chunk extension", "endless interim answers"],
)
def test_endless_bytes_that_are_not_body_are_refused(start: bytes, forever: bytes) -> None:
    parser = ResponseParser(CAP)
    parser.feed(start)
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        for _ in range(4 * MAX_HEAD_BYTES // 512):
            parser.feed(forever * (512 // len(forever)))


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1001\r\n\r\n"],  # refused before any body byte
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"3e9\r\n", b"a" * 1001],
        [b"HTTP/1.1 200 OK\r\n\r\n", b"a" * 600, b"a" * 600],
    ],
    ids=["content-length", "chunked", "close-delimited"],
)
def test_body_cap(pieces: list[bytes]) -> None:
    with pytest.raises(ResponseTooLarge, match="larger than 1000 bytes"):
        parse(*pieces, eof=True)


def test_body_exactly_at_the_cap_is_accepted() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"a" * 1000
    assert parse(raw) == ((200, b"a" * 1000), True)


# -- fuzz ---------------------------------------------------------------------
_TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda t: t not in ("content-length", "transfer-encoding", "connection")
)
_VALUE = st.binary(max_size=30).map(
    lambda b: bytes(c for c in b if c == 9 or 32 <= c < 127 or c >= 128).strip(b" \t")
)


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, Response, bool]:
    """A valid answer: its bytes, what it means, and whether it ends before EOF."""
    status = draw(st.sampled_from([200, 201, 204, 299, 404, 500, 599]))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    body = b"" if status == 204 else draw(st.binary(max_size=300))
    headers = [(n.encode(), v) for n, v in draw(st.lists(st.tuples(_TOKEN, _VALUE), max_size=5))]
    interim = draw(st.lists(st.sampled_from([100, 102, 103, 199]), max_size=2))
    out = b"".join(b"HTTP/1.1 %d Wait\r\n\r\n" % code for code in interim)
    out += b"HTTP/1.1 %d Whatever\r\n" % status
    out += b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    if status == 204:
        framing = "none"
    if framing == "length":
        out += b"Content-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        out += b"Transfer-Encoding: chunked\r\n\r\n"
        rest = body
        while rest:
            n = draw(st.integers(1, len(rest)))
            out += b"%x\r\n" % n + rest[:n] + b"\r\n"
            rest = rest[n:]
        out += b"0\r\n\r\n"
    else:
        out += b"\r\n" + body
    return out, Response(status, body), framing != "close"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers(), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_split_of_a_valid_answer_parses_the_same(
    answer: tuple[bytes, Response, bool], cuts: list[int]
) -> None:
    raw, expected, self_delimited = answer
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(points)]
    assert parse(raw, eof=True) == (expected, self_delimited)
    assert parse(*pieces, eof=True) == (expected, self_delimited)


def _feed_all(pieces: list[bytes], eof: bool) -> None:
    parser = ResponseParser(CAP)
    try:
        for piece in pieces:
            if parser.feed(piece):
                parser.response  # noqa: B018 (complete: must be readable)
                return
        if eof:
            parser.feed_eof()
    except TransportError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6), st.booleans())
def test_random_bytes_raise_only_transport_errors(pieces: list[bytes], eof: bool) -> None:
    _feed_all(pieces, eof)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers(), st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3)), max_size=4))
def test_mutated_answers_raise_only_transport_errors(
    answer: tuple[bytes, Response, bool], edits: list[tuple[int, bytes]]
) -> None:
    raw = bytearray(answer[0])
    for at, insert in edits:
        i = at % (len(raw) + 1)
        raw[i : i + 1] = insert  # replace one byte, or delete it, or insert several
    _feed_all([bytes(raw[i : i + 7]) for i in range(0, len(raw), 7)], eof=True)


def test_a_finished_parser_leaves_no_reference_cycle() -> None:
    """The body must be freed by reference counting when the exchange ends, not
    wait for the cyclic GC (the parser holds our callbacks; we drop it)."""
    gc.collect()
    gc.disable()
    try:
        for raw in (VALID["content-length"][0], REJECTED["nul in value"]):
            parser = ResponseParser(CAP)
            with contextlib.suppress(TransportError):
                parser.feed(raw)
        parser = ResponseParser(CAP)
        parser.feed(b"HTTP/1.1 200 OK\r\n\r\nbody")
        parser.feed_eof()
        del parser
        assert gc.collect() == 0
    finally:
        gc.enable()


# -- exact bounds and states (what mutation testing found unpinned) ---------------------------

_MAX_OVERHEAD = 2 * MAX_HEAD_BYTES  # non-body bytes allowed, plus 8 per body byte


def _head_with(n: int) -> bytes:
    """A head whose counted fields (reason phrase, and name + value + 4 per field) are
    n + 30 bytes: "OK" 2, "X-Big" 5 + n + 4, "Content-Length" 14 + 1 + 4."""
    return b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * n + b"\r\nContent-Length: 2\r\n\r\nok"


def test_a_head_of_exactly_the_bound_is_accepted_and_one_byte_more_is_not() -> None:
    raw = _head_with(MAX_HEAD_BYTES - 30)
    # The status line split across two reads (llhttp reports the reason in two parts),
    # the rest in one read, so only the counted fields decide.
    assert parse(raw[:14], raw[14:]) == ((200, b"ok"), True)
    over = _head_with(MAX_HEAD_BYTES - 29)
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parse(over[:14], over[14:])


def test_counted_fields_add_up_over_several_headers() -> None:
    one = b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (MAX_HEAD_BYTES // 2)
    two = b"\r\nX-B: " + b"b" * (MAX_HEAD_BYTES // 2) + b"\r\nContent-Length: 2\r\n\r\nok"
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):  # neither alone is over
        parse(one + two)


def _accepts_exactly(start: bytes, filler: bytes, total: int) -> None:
    """`start`, then `filler` bytes up to `total` bytes fed in all, are taken without an
    answer; one more byte is refused."""
    parser = ResponseParser(CAP)
    assert parser.feed(start) is False
    left = total - len(start)
    while left:
        step = min(4096, left)
        assert parser.feed(filler * step) is False
        left -= step
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parser.feed(filler)


def test_an_unfinished_head_may_hold_exactly_the_bound() -> None:
    _accepts_exactly(b"HTTP/1.1 200 OK\r\nX-Big: ", b"a", MAX_HEAD_BYTES)


def test_bytes_that_are_not_body_are_bounded_by_the_body_they_carry() -> None:
    """2 x MAX_HEAD_BYTES plus 8 per body byte: a 4-byte chunked body and then an endless
    trailer may take exactly 131,072 + 32 non-body bytes, and not one more."""
    start = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\nX-T: "
    _accepts_exactly(start, b"t", _MAX_OVERHEAD + 8 * 4 + 4)  # the 4 body bytes are fed too


def test_an_interim_102_is_skipped_like_any_other_1xx() -> None:
    raw = b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    assert parse(raw) == ((200, b"ok"), True)


def test_an_interim_answer_has_no_body_whatever_its_content_length_says() -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\nContent-Length: 5000\r\n\r\n"  # over the cap, but not a body
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    assert parse(raw) == ((200, b"ok"), True)


@pytest.mark.parametrize(
    "fields",
    [
        b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",  # one list: gzip, chunked
        b"Transfer-Encoding: Xchunked\r\n",
    ],
    ids=["two fields", "not quite chunked"],
)
def test_transfer_encoding_must_be_exactly_chunked_across_all_its_fields(fields: bytes) -> None:
    raw = b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n0\r\n\r\n"
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parse(raw, eof=True)


def test_bytes_fed_after_the_answer_make_the_connection_unusable() -> None:
    parser = ResponseParser(CAP)
    assert parser.keep_alive is False  # nothing complete yet
    assert parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") is True
    assert parser.feed(b"") is True
    assert parser.keep_alive is True  # nothing more arrived
    assert parser.feed(b"x") is True
    assert parser.keep_alive is False
    assert parser.response == (200, b"ok")


@pytest.mark.parametrize(
    "first",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",  # llhttp refuses it
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",  # our policy refuses it
        b"HTTP/1.1 100 Continue\r\n\r\n" * (_MAX_OVERHEAD // 25 + 1),  # the non-body bound
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD_BYTES,  # the unfinished-head bound
    ],
    ids=["llhttp", "policy", "non-body bound", "head bound"],
)
def test_a_failed_parser_fails_again_the_same_way(first: bytes) -> None:
    parser = ResponseParser(CAP)
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parser.feed(first)
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")


def test_after_a_read_error_at_eof_more_bytes_are_refused() -> None:
    parser = ResponseParser(CAP)
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok")
    with pytest.raises(TransportError, match=r"^transport error \(ReadError\)$"):
        parser.feed_eof()
    with pytest.raises(TransportError, match=PROTOCOL_ERROR):
        parser.feed(b"abc")


def test_a_discarded_body_is_dropped_but_still_framed_and_capped() -> None:
    """discard_body: what was read and what follows are kept nowhere, the answer still ends
    where its framing says (reusable), and the body cap still counts every byte."""
    parser = ResponseParser(CAP)
    assert not parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
    parser.discard_body()
    assert parser.feed(b"world")
    assert parser.response == Response(200, b"") and parser.keep_alive
    kept = ResponseParser(CAP)
    assert kept.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhelloworld")
    assert kept.response == Response(200, b"helloworld")  # without discard_body, all of it
    capped = ResponseParser(8)
    capped.discard_body()
    with pytest.raises(ResponseTooLarge):
        capped.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhelloworld")
