"""Trailers-only answers to a call refused from its HEADERS, before grpclib starts it."""

from __future__ import annotations

from grpclib.metadata import encode_grpc_message
from h2.connection import H2Connection

from ibex.patches.hpack_block import send_headers_fast

__all__ = ["BAD_TIMEOUT_MESSAGE", "refusal_headers", "send_refusal"]

#: grpclib's answer to a malformed `grpc-timeout`, given here from the HEADERS.
BAD_TIMEOUT_MESSAGE = "Invalid grpc-timeout header"


def refusal_headers(status: int, message: str) -> list[tuple[str, str]]:
    """A trailers-only answer's headers."""
    return [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", str(status)),
        ("grpc-message", encode_grpc_message(message)),
    ]


def send_refusal(h2: H2Connection, stream_id: int, status: int, message: str) -> None:
    """Answer a just-opened stream trailers-only (HEADERS with END_STREAM).

    From `header_block` when it can, so a refusal skips h2's general header encoder
    (docs/performance.md). Raises h2's ProtocolError when the stream is gone (e.g.
    reset by the caller).
    """
    headers = refusal_headers(status, message)
    if not send_headers_fast(h2, stream_id, headers, True):
        h2.send_headers(stream_id, headers, end_stream=True)
