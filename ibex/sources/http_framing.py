"""HTTP/1.1 response framing, sans-IO, by llhttp (`httptools`, Node's parser, as in uvicorn).

The exchange (`ibex.sources.http_exchange`) and the pool around it
(`ibex.sources.http_pool`) own sockets, slots and cancellation; this module
owns bytes: feed it what the connection delivered and it says when the answer
is complete, what it was, and whether the connection may carry another
request. It never reads or writes; tests drive it with plain bytes and with
in-memory streams.

llhttp does the byte-level work (status line, header syntax, Content-Length,
chunked bodies and trailers, bare CR/LF, NUL and other bad characters,
duplicate or non-numeric Content-Length, Transfer-Encoding with
Content-Length). On top of it this module applies the policy llhttp leaves to
its caller, each rule from RFC 9112:

- HTTP/1.0 and HTTP/1.1 only; status codes 100-999 (000-099 are not HTTP).
- Interim 1xx answers are skipped; 101 is refused (we never ask to switch).
- Transfer-Encoding must be exactly `chunked`, and never on an HTTP/1.0
  answer (section 6.1: its framing is faulty, so it is refused, not kept).
- The head is bounded (MAX_HEAD_BYTES) and so is the body (`ResponseTooLarge`,
  raised from Content-Length before any body byte is buffered).
- An answer without Content-Length or Transfer-Encoding ends when the server
  closes the connection (`feed_eof`), which then cannot be reused.
- Bytes after the answer were never asked for: the connection is not reusable.

Every failure is a `TransportError`; no llhttp exception escapes.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import httptools

from ibex.sources.base import SourceError

__all__ = [
    "MAX_HEAD_BYTES",
    "Response",
    "ResponseParser",
    "ResponseTooLarge",
    "TransportError",
    "TransportTimeout",
    "malformed",
    "transport_error",
]

MAX_HEAD_BYTES: Final = 64 * 1024
_MAX_OVERHEAD: Final = 2 * MAX_HEAD_BYTES
_NO_BODY: Final = frozenset({204, 304})


class TransportError(SourceError):
    """Connecting, sending or receiving failed, or the answer was not HTTP/1.x.

    str() is `transport error (<Kind>)`, with httpx's kind names
    (ConnectError, WriteError, ReadError, RemoteProtocolError): safe to log.
    """


class TransportTimeout(TransportError):
    """The pool's own safety-net timeout fired (the caller's cancel scope did not)."""


class ResponseTooLarge(TransportError):
    """The body is over the configured cap; the connection is dropped unread."""


class Response(NamedTuple):
    status: int
    body: bytes


def transport_error(kind: str) -> TransportError:
    return TransportError(f"transport error ({kind})")


def malformed() -> TransportError:
    return transport_error("RemoteProtocolError")


class _Stop(Exception):
    """Raised from a callback to stop llhttp once the answer is complete."""


class ResponseParser:
    """One exchange's answer: `feed` bytes until it returns True (or `feed_eof` at EOF).

    Then `response` is the answer and `keep_alive` says whether the connection
    may be pooled again. Use a fresh parser for every request.
    """

    __slots__ = (
        "_body",
        "_body_len",
        "_close_delimited",
        "_discard",
        "_done",
        "_error",
        "_fed_head",
        "_fed_total",
        "_head_bytes",
        "_headers_done",
        "_keep",
        "_leftover",
        "_length",
        "_max_body",
        "_parser",
        "_status",
        "_te",
    )

    def __init__(self, max_body: int) -> None:
        self._max_body = max_body
        # The parser holds our bound callbacks and we hold it: a reference cycle,
        # broken (`_parser = None`) as soon as the answer is complete or failed,
        # so the body is freed by reference counting, not by the cyclic GC.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._done = False
        self._leftover = False
        self._keep = False
        self._error: TransportError | None = None
        self._fed_total = 0  # every byte of this exchange, interim answers included
        self._discard = False
        self._reset()

    def _reset(self) -> None:
        """State of one message (an interim 1xx answer is followed by the real one)."""
        self._status = 0
        self._head_bytes = 0  # status and header fields, as llhttp delivered them
        self._fed_head = 0  # bytes fed while the head was incomplete
        self._headers_done = False
        self._close_delimited = False
        self._te: bytes | None = None
        self._length: bytes | None = None
        self._body: list[bytes] = []
        self._body_len = 0

    # -- the interface the pool uses ----------------------------------------
    @property
    def response(self) -> Response:
        if not self._done:
            raise RuntimeError("the answer is not complete")
        return Response(self._status, b"".join(self._body))

    @property
    def keep_alive(self) -> bool:
        """Complete, keep-alive by its version and headers, and nothing after it."""
        return self._done and self._keep and not self._leftover

    def feed(self, data: bytes | bytearray | memoryview) -> bool:
        """Parse the next bytes of the connection; True once the final answer is complete."""
        if self._done:  # the caller reads past the answer only by mistake: not reusable
            self._leftover = self._leftover or bool(data)
            return True
        parser = self._parser
        if parser is None:  # fed again after a failure
            raise malformed()
        try:
            parser.feed_data(data)
        except httptools.HttpParserError:
            self._parser = None
            if self._error is not None:
                raise self._error from None
            if self._done:  # bytes after the answer that are not even HTTP
                self._leftover = True
                return True
            raise malformed() from None
        if self._done:
            self._parser = None
            return True
        # Bytes that are not body (heads, interim answers, chunk sizes and
        # extensions, trailers) are bounded too: llhttp would buffer an endless
        # trailer, and endless 1xx answers would never end the exchange.
        self._fed_total += len(data)
        if self._fed_total - self._body_len > _MAX_OVERHEAD + 8 * self._body_len:
            self._parser = None
            raise malformed()
        if not self._headers_done:
            # llhttp buffers a header it has not finished; bound what it may hold.
            self._fed_head += len(data)
            if self._fed_head > MAX_HEAD_BYTES:
                self._parser = None
                raise malformed()
        return False

    def discard_body(self) -> None:
        """Drop the body read so far and keep none of the rest (still counted and capped).

        For draining an answer nobody waits for any more: only its framing matters.
        """
        self._discard = True
        self._body = []

    def feed_eof(self) -> Response:
        """The server closed the connection: the end of a close-delimited body, else an error."""
        self._parser = None
        if self._done:
            return self.response
        if self._close_delimited:
            self._done = True
            self._keep = False
            return self.response
        raise transport_error("ReadError")

    # -- llhttp callbacks -----------------------------------------------------
    def _fail(self, error: TransportError) -> TransportError:
        self._error = error
        return error

    def on_message_begin(self) -> None:
        if self._done:
            self._leftover = True
            raise _Stop

    def on_status(self, status: bytes) -> None:
        self._head_bytes += len(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._headers_done:
            return  # a trailer field: nothing we use
        self._head_bytes += len(name) + len(value) + 4
        key = name.lower()
        if key == b"transfer-encoding":
            self._te = value if self._te is None else self._te + b"," + value
        elif key == b"content-length":
            self._length = value  # llhttp refuses a second one and any non-digit

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser is None:  # only llhttp calls this, from feed(), which holds it
            raise self._fail(malformed())
        status = parser.get_status_code()
        if (
            self._head_bytes > MAX_HEAD_BYTES
            or parser.get_http_version() not in ("1.1", "1.0")
            or status < 100
            or status == 101  # we never asked to switch protocols
        ):
            raise self._fail(malformed())
        te = self._te
        if te is not None and (
            parser.get_http_version() == "1.0" or te.strip(b" \t").lower() != b"chunked"
        ):
            raise self._fail(malformed())  # faulty framing (RFC 9112 6.1) or a coding unasked for
        self._status = status
        self._headers_done = True
        if status < 200 or status in _NO_BODY:
            return
        if self._length is not None:
            if int(self._length) > self._max_body:
                raise self._fail(self._too_large())
        elif te is None:
            self._close_delimited = True

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._max_body:
            raise self._fail(self._too_large())
        if not self._discard:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._status < 200:  # an interim answer: the real one follows
            self._reset()
            return
        self._done = True
        self._keep = self._parser is not None and self._parser.should_keep_alive()

    def _too_large(self) -> ResponseTooLarge:
        return ResponseTooLarge(f"response larger than {self._max_body} bytes")
