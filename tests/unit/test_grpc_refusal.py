"""Response headers from pre-encoded HPACK blocks (`hpack_block.send_headers_fast`), the
HEADERS gate's trailers-only refusal built on it, and `lighten_h2`.

Pinned here, between a real h2 client and server connection: the caller reads
exactly the headers h2's own `send_headers` would have sent (static-table
fields, indexed names, new names, lengths past one byte); the blocks leave
both HPACK dynamic tables as they were, so every later stream on the
connection still decodes; a pending table-size change (which must lead the
next block), a client connection, an informational status and a long list go
through h2 as before; and a stream the caller already reset is an h2
ProtocolError, as before.
"""

from __future__ import annotations

import logging

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from grpclib.metadata import encode_grpc_message
from h2.exceptions import ProtocolError
from hyperframe.frame import DataFrame, HeadersFrame

from ibex.patches import lighten_h2
from ibex.patches.hpack_block import header_block, send_headers_fast
from ibex.service.admission import GATE_CPU_MESSAGE, GATE_QUEUE_MESSAGE
from ibex.service.edge.refusal import send_refusal

REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/ibex.context.v1.ContextAssemblyService/AssembleContext"),
    (":authority", "127.0.0.1"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("grpc-timeout", "44m"),
]
RESOURCE_EXHAUSTED = 8


def refusal_headers(message: str) -> list[tuple[str, str]]:
    return [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", str(RESOURCE_EXHAUSTED)),
        ("grpc-message", encode_grpc_message(message)),
    ]


class Pair:
    """A client and a server h2 connection wired back to back."""

    def __init__(self) -> None:
        self.client = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.server = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.client.initiate_connection()
        self.server.initiate_connection()
        self.to_client()
        self.to_server()

    def to_server(self) -> list[h2.events.Event]:
        return self.server.receive_data(self.client.data_to_send())

    def to_client(self) -> list[h2.events.Event]:
        return self.client.receive_data(self.server.data_to_send())

    def open(self) -> int:
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, REQUEST)
        self.client.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
        events = self.to_server()
        assert any(isinstance(e, h2.events.RequestReceived) for e in events)
        return sid

    def answer(self, sid: int, events: list[h2.events.Event]) -> list[tuple[str, str]]:
        got = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        assert [e.stream_id for e in got] == [sid]
        assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)
        return [(str(k), str(v)) for k, v in got[0].headers]


@pytest.mark.parametrize("message", [GATE_CPU_MESSAGE, GATE_QUEUE_MESSAGE])
def test_the_block_decodes_to_the_refusal_without_touching_the_dynamic_table(
    message: str,
) -> None:
    decoder = hpack.Decoder()
    decoded = decoder.decode(header_block(tuple(refusal_headers(message))))
    assert [(str(k), str(v)) for k, v in decoded] == refusal_headers(message)
    assert len(decoder.header_table.dynamic_entries) == 0


@pytest.mark.parametrize(
    "headers",
    [
        [(":status", "200"), ("content-type", "application/grpc")],  # full static match
        [(":status", "204"), ("content-length", "0")],  # static field, then indexed name
        [("grpc-status", "0"), ("x-ibex-worker", "1")],  # new names
        [("x-long", "v" * 300), ("www-authenticate", "w" * 140)],  # multi-byte lengths
        [("accept-charset", "utf-8"), ("via", "")],  # indexed names below and above 15
    ],
)
def test_header_blocks_decode_to_their_headers(headers: list[tuple[str, str]]) -> None:
    decoder = hpack.Decoder()
    assert [(str(k), str(v)) for k, v in decoder.decode(header_block(tuple(headers)))] == headers
    assert len(decoder.header_table.dynamic_entries) == 0


def test_the_caller_reads_the_refusal_and_the_connection_keeps_decoding() -> None:
    pair = Pair()
    for _ in range(3):
        sid = pair.open()
        send_refusal(pair.server, sid, RESOURCE_EXHAUSTED, GATE_CPU_MESSAGE)
        assert pair.answer(sid, pair.to_client()) == refusal_headers(GATE_CPU_MESSAGE)
        assert pair.server.streams.get(sid) is None or pair.server.streams[sid].closed
    # A normal answer after the refusals, through h2's encoder and its dynamic table:
    # both ends' tables still agree.
    for _ in range(2):
        sid = pair.open()
        headers = [(":status", "200"), ("content-type", "application/grpc"), ("x-a", "b")]
        pair.server.send_headers(sid, headers)
        pair.server.send_headers(sid, [("grpc-status", "0")], end_stream=True)
        events = pair.to_client()
        assert pair.answer(sid, events) == headers
        trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
        assert [(str(k), str(v)) for k, v in trailers[0].headers] == [("grpc-status", "0")]
    assert pair.server.open_inbound_streams == 0


def test_a_pending_table_size_change_leads_the_refusal_through_h2() -> None:
    pair = Pair()
    pair.client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 256})
    pair.to_server()
    pair.to_client()
    assert pair.server.encoder.table_size_changes == [256]
    sid = pair.open()
    send_refusal(pair.server, sid, RESOURCE_EXHAUSTED, GATE_QUEUE_MESSAGE)
    assert pair.server.encoder.table_size_changes == []
    assert pair.answer(sid, pair.to_client()) == refusal_headers(GATE_QUEUE_MESSAGE)
    sid = pair.open()
    send_refusal(pair.server, sid, RESOURCE_EXHAUSTED, GATE_QUEUE_MESSAGE)
    assert pair.answer(sid, pair.to_client()) == refusal_headers(GATE_QUEUE_MESSAGE)


def test_a_stream_reset_by_the_caller_is_a_protocol_error_and_nothing_is_sent() -> None:
    pair = Pair()
    sid = pair.open()
    pair.client.reset_stream(sid)
    pair.to_server()
    pair.server.data_to_send()
    with pytest.raises(ProtocolError):
        send_refusal(pair.server, sid, RESOURCE_EXHAUSTED, GATE_CPU_MESSAGE)
    assert pair.server.data_to_send() == b""


def test_lighten_h2_keeps_header_values_out_of_debug_logs_and_frames_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lighten_h2()
    lighten_h2()  # idempotent
    caplog.set_level(logging.DEBUG)
    encoded = hpack.Encoder().encode([("authorization", "Bearer s3cret")])
    assert hpack.Decoder().decode(encoded) == [("authorization", "Bearer s3cret")]
    assert not [r for r in caplog.records if r.name.startswith("hpack")]
    assert "s3cret" not in caplog.text
    frame = DataFrame(7, data=b"memory text " * 100)
    assert repr(frame) == "DataFrame(stream_id=7)"
    assert repr(HeadersFrame(9)) == "HeadersFrame(stream_id=9)"


def test_long_messages_still_decode_and_the_longest_go_through_h2() -> None:
    pair = Pair()
    for message in ("overloaded: " + "x" * 200, "overloaded: " + "y" * 600):
        sid = pair.open()
        send_refusal(pair.server, sid, RESOURCE_EXHAUSTED, message)
        assert pair.answer(sid, pair.to_client()) == refusal_headers(message)
    # Only the long one went through h2's encoder: into both dynamic tables.
    assert len(pair.server.encoder.header_table.dynamic_entries) > 0
    assert len(pair.client.decoder.header_table.dynamic_entries) > 0


def test_an_answer_headers_then_trailers_through_the_blocks() -> None:
    pair = Pair()
    for level in ("L0", "L1", "L0"):
        sid = pair.open()
        headers = [
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("x-ibex-degradation", level),
        ]
        assert send_headers_fast(pair.server, sid, headers, False)
        pair.server.send_data(sid, b"\x00\x00\x00\x00\x00")
        assert send_headers_fast(pair.server, sid, [("grpc-status", "0")], True)
        events = pair.to_client()
        assert pair.answer(sid, events) == headers
        data = [e for e in events if isinstance(e, h2.events.DataReceived)]
        assert [e.data for e in data] == [b"\x00\x00\x00\x00\x00"]
        trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
        assert [(str(k), str(v)) for k, v in trailers[0].headers] == [("grpc-status", "0")]
    assert len(pair.server.encoder.header_table.dynamic_entries) == 0
    assert pair.server.open_inbound_streams == 0


def test_what_only_h2_can_send_is_left_to_it() -> None:
    pair = Pair()
    sid = pair.open()
    pair.server.data_to_send()
    assert not send_headers_fast(pair.server, sid, [(":status", "100")], False)  # 1xx
    assert not send_headers_fast(pair.server, sid, [("x-a", "b" * 600)], False)  # long
    assert pair.server.data_to_send() == b""
    assert not send_headers_fast(pair.client, 3, [(":method", "POST")], False)  # a client
    assert pair.client.data_to_send() == b""
    # Trailers must end the stream, as in h2.
    assert send_headers_fast(pair.server, sid, [(":status", "200")], False)
    with pytest.raises(ProtocolError):
        send_headers_fast(pair.server, sid, [("grpc-status", "0")], False)
