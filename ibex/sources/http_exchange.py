"""One request and its answer on one pooled connection.

The request's bytes (target under the origin's path prefix, Host and the
fixed headers), sending them, and reading the answer through the sans-IO
parser (`ibex.sources.http_framing`) to its end. One request at a time per
connection: no pipelining. The pool around it (`ibex.sources.http_pool`)
owns the slots, the idle list and cancellation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, NamedTuple
from urllib.parse import urlsplit

import trio

from ibex.sources.http_connect import Link, link_unusable
from ibex.sources.http_framing import Response, ResponseParser, transport_error
from ibex.sources.raw_socket_stream import RECV_BYTES, RawSocketStream

__all__ = [
    "Connection",
    "Origin",
    "RequestEncoder",
    "StaleConnection",
    "discard_rest",
    "header_lines",
    "read_response",
    "send_request",
    "split_base_url",
]

_TOKEN_SEPARATORS: Final = frozenset(b' \t"(),/:;<=>?@[\\]{}')


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int
    prefix: str  # path every request target is appended to, without a trailing slash
    authority: str  # the Host header value


def split_base_url(base_url: str) -> Origin:
    """Check and split a base URL; ValueError (never echoing the URL) when unusable."""
    parts = urlsplit(base_url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError("base URL must start with http:// or https://")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("base URL must not carry credentials, a query or a fragment")
    host = parts.hostname
    if not host:
        raise ValueError("base URL has no host")
    default_port = 443 if scheme == "https" else 80
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError("base URL has an invalid port") from None
    authority = f"[{host}]" if ":" in host else host
    if port != default_port:
        authority = f"{authority}:{port}"
    return Origin(scheme, host, port, parts.path.rstrip("/"), authority)


def header_lines(headers: Mapping[str, str]) -> list[str]:
    """`Name: value\r\n` lines, or ValueError for a name or value that could split the head."""
    lines = []
    for name, value in headers.items():
        if not name or any(ord(c) in _TOKEN_SEPARATORS or ord(c) < 33 for c in name):
            raise ValueError("invalid header name")
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"header {name}: value must not contain CR, LF or NUL")
        lines.append(f"{name}: {value}\r\n")
    return lines


class RequestEncoder:
    """Request bytes for one origin: the Host and fixed headers are encoded once."""

    __slots__ = ("_prefix", "_static")

    def __init__(self, origin: Origin, headers: Mapping[str, str]) -> None:
        """ValueError for a header that could split the head."""
        self._prefix = origin.prefix
        lines = [f"Host: {origin.authority}\r\n", *header_lines(headers)]
        self._static = "".join(lines).encode("latin-1")

    def encode(
        self,
        method: str,
        target: str,
        body: bytes | None,
        content_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """The whole request; ValueError for a target or header that could split it."""
        if not target.startswith("/") or not target.isascii() or any(c in target for c in " \r\n"):
            raise ValueError("request target must be an absolute, percent-encoded path")
        head = f"{method} {self._prefix}{target} HTTP/1.1\r\n".encode("ascii") + self._static
        if headers:
            head += "".join(header_lines(headers)).encode("latin-1")
        if body is None:
            return head + b"\r\n"
        extra = f"Content-Type: {content_type}\r\n" if content_type else ""
        tail = f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        return b"".join((head, tail, body))


class StaleConnection(Exception):
    """A reused connection failed before any response byte: the server had closed it."""


class Connection:
    """A connection's stream and link, and what the pool knows of it."""

    __slots__ = ("idle_since", "link", "reused", "stream")

    def __init__(self, stream: trio.abc.Stream, link: Link) -> None:
        self.stream = stream
        self.link = link
        # Pooled before: a failure before the first answer byte means the server closed
        # it while idle (`StaleConnection`), not that this request failed.
        self.reused = False
        self.idle_since = 0.0  # Trio clock; idle connections expire from here

    def close(self) -> None:
        self.link.close()

    def dead_or_dirty(self) -> bool:
        return link_unusable(self.link)


async def send_request(conn: Connection, data: bytes) -> None:
    """Write the whole request; StaleConnection or TransportError (WriteError) on failure."""
    try:
        await conn.stream.send_all(data)
    except (trio.BrokenResourceError, OSError):
        if conn.reused:
            raise StaleConnection from None
        raise transport_error("WriteError") from None


async def read_response(conn: Connection, parser: ResponseParser) -> tuple[Response, bool]:
    """Feed the parser until the answer is complete; (answer, may the connection be reused)."""
    first = True
    stream = conn.stream
    chunk: bytes | bytearray
    while True:
        try:
            if first and isinstance(stream, RawSocketStream):
                chunk = await stream.receive_reply(RECV_BYTES)  # no recv before the answer
            else:
                chunk = await stream.receive_some(RECV_BYTES)
        except (trio.BrokenResourceError, OSError):
            if first and conn.reused:
                raise StaleConnection from None
            raise transport_error("ReadError") from None
        if not chunk:
            if first and conn.reused:
                raise StaleConnection
            return parser.feed_eof(), False
        first = False
        if parser.feed(chunk):
            return parser.response, parser.keep_alive


async def discard_rest(conn: Connection, parser: ResponseParser, budget: int) -> bool:
    """Feed the parser to the end of the answer, reading at most `budget` more bytes;
    True if the connection may be reused (complete, keep-alive, nothing after it)."""
    parser.discard_body()
    while True:
        chunk = await conn.stream.receive_some(RECV_BYTES)
        if not chunk:
            return False
        budget -= len(chunk)
        if budget < 0:
            return False
        if parser.feed(chunk):
            return parser.keep_alive
