"""The HPACK block of a server's response headers, pre-encoded, and the HEADERS frame
that carries it (sans-IO: bytes in, bytes out, and h2's own connection state).

h2 encodes every header list it sends, field by field, against its dynamic
table; a gRPC server sends the same few lists over and over (the response
headers, the usual trailers, the overload refusal). `header_block` encodes a
list once, from the static table and literals only, so the block is valid on
any connection at any time; `send_headers_fast` puts it on an h2 connection in
place of h2's `send_headers`. It drives h2's state machines and output buffer
directly (private parts of h2, whose version `ibex.patches.grpclib_h2` checks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from h2.connection import ConnectionInputs, H2Connection
from h2.exceptions import ProtocolError
from h2.stream import StreamInputs
from hpack.hpack import encode_integer
from hpack.table import HeaderTable

MAX_STREAM_ID = 2**31 - 1
_STATIC_FIELDS = {field: i for i, field in enumerate(HeaderTable.STATIC_TABLE, start=1)}
_STATIC_NAMES: dict[bytes, int] = {}
for _i, (_name, _) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _STATIC_NAMES.setdefault(_name, _i)
_HEADERS = 0x01  # frame type
_END_STREAM = 0x01
_END_HEADERS = 0x04
_BLOCK_CACHE_CHARS = 512  # header lists longer than this are encoded by h2, never cached


def _string(raw: bytes) -> bytes:
    """An HPACK string literal, not Huffman-coded (RFC 7541 5.2)."""
    return bytes(encode_integer(len(raw), 7)) + raw


def _field(name: bytes, value: bytes) -> bytes:
    """One field from the static table or as a literal without indexing (RFC 7541 6.1, 6.2.2)."""
    index = _STATIC_FIELDS.get((name, value))
    if index is not None:
        out = encode_integer(index, 7)
        out[0] |= 0x80
        return bytes(out)
    index = _STATIC_NAMES.get(name)
    if index is not None:
        return bytes(encode_integer(index, 4)) + _string(value)
    return b"\x00" + _string(name) + _string(value)


@functools.lru_cache(maxsize=256)
def header_block(headers: tuple[tuple[str, str], ...]) -> bytes:
    """The HPACK block of `headers`, built once per distinct list.

    Only the static table and literals without indexing: the block leaves both
    ends' dynamic tables as they were, so it is valid on any connection at any
    time (except right after a table-size change, which must lead the next
    block). A few more bytes on the wire than h2's indexed encoding, and none
    of its per-call encoding work.
    """
    return b"".join(_field(n.encode(), v.encode()) for n, v in headers)


def send_headers_fast(
    h2: H2Connection, stream_id: int, headers: Sequence[tuple[str, str]], end_stream: bool
) -> bool:
    """Send a server's response headers or trailers as h2's `send_headers` would, from
    `header_block`; False (nothing done) where only h2 can: a client connection, a
    pending table-size change, an informational status, a long or non-text list.

    Raises h2's ProtocolError when the stream cannot send (e.g. reset by the caller).
    """
    if h2.config.client_side or h2.encoder.table_size_changes:
        return False
    key = tuple(headers)
    chars = 0
    for field in key:
        if not isinstance(field, tuple) or len(field) != 2:
            return False
        name, value = field
        if not isinstance(name, str) or not isinstance(value, str):
            return False
        chars += len(name) + len(value)
    if chars > _BLOCK_CACHE_CHARS:
        return False
    if key and key[0][0] == ":status" and key[0][1].startswith("1"):
        return False  # 1xx: h2 tracks informational responses apart
    block = header_block(key)
    h2.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
    stream = h2._get_stream_by_id(stream_id)
    stream.state_machine.process_input(StreamInputs.SEND_HEADERS)
    flags = _END_HEADERS
    if end_stream:
        stream.state_machine.process_input(StreamInputs.SEND_END_STREAM)
        flags |= _END_STREAM
    elif stream.state_machine.trailers_sent:
        raise ProtocolError("Trailers must have END_STREAM set.")
    h2._data_to_send += (
        len(block).to_bytes(3, "big")
        + bytes((_HEADERS, flags))
        + (stream_id & MAX_STREAM_ID).to_bytes(4, "big")
        + block
    )
    return True
