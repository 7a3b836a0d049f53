"""`count_open_streams_inline`: h2's open-stream count, read without per-stream properties.

RFC 9113 §5.1.2: the streams that count against SETTINGS_MAX_CONCURRENT_STREAMS are the
open and the two half-closed ones. h2 also moves each closed stream out of `streams`
into `_closed_streams` (with who closed it) as it counts; both must stay as h2 has them.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from h2.connection import H2Connection
from h2.exceptions import TooManyStreamsError
from h2.stream import StreamClosedBy
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex.patches import count_open_streams_inline
from ibex.patches.grpclib_h2 import _open_streams

REQUEST = [(":method", "POST"), (":path", "/p"), (":scheme", "http"), (":authority", "a")]
RESPONSE = [(":status", "200")]


def pair(max_streams: int = 100) -> tuple[H2Connection, H2Connection]:
    """A client and a server connection with their preambles and settings exchanged."""
    client = H2Connection(h2.config.H2Configuration(client_side=True))
    server = H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    for _ in range(2):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    return client, server


def to_server(client: H2Connection, server: H2Connection) -> list[h2.events.Event]:
    return server.receive_data(client.data_to_send())


@pytest.fixture(autouse=True)
def _installed() -> None:
    count_open_streams_inline()
    count_open_streams_inline()  # idempotent


def test_the_patch_is_h2s_count() -> None:
    assert H2Connection._open_streams is _open_streams


def test_open_and_half_closed_streams_count_and_closed_ones_move_out() -> None:
    client, server = pair()
    for sid in (1, 3, 5, 7, 9):
        client.send_headers(sid, REQUEST)
    client.end_stream(3)  # half-closed (remote) at the server: still counts
    to_server(client, server)
    server.send_headers(5, RESPONSE, end_stream=True)  # half-closed (local): still counts
    client.end_stream(7)
    to_server(client, server)
    server.send_headers(7, RESPONSE, end_stream=True)  # both ends sent: closed
    server.reset_stream(9)  # reset by the server: closed
    assert server.open_inbound_streams == 3  # 1 open, 3 and 5 half-closed
    assert server.open_outbound_streams == 0
    assert sorted(server.streams) == [1, 3, 5]
    assert server._closed_streams[7] == StreamClosedBy.SEND_END_STREAM
    assert server._closed_streams[9] == StreamClosedBy.SEND_RST_STREAM


def test_max_concurrent_streams_refuses_one_more_and_admits_after_a_close() -> None:
    client, server = pair(max_streams=2)
    for sid in (1, 3):
        client.send_headers(sid, REQUEST)
    to_server(client, server)
    # A client that ignores the limit: its own copy of the server's settings says 100.
    client.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 100
    client.remote_settings.acknowledge()
    client.send_headers(5, REQUEST)
    with pytest.raises(TooManyStreamsError):
        to_server(client, server)
    client, server = pair(max_streams=2)
    for sid in (1, 3):
        client.send_headers(sid, REQUEST, end_stream=True)
    to_server(client, server)
    server.send_headers(1, RESPONSE, end_stream=True)  # stream 1 closes: room for one
    client.receive_data(server.data_to_send())
    client.send_headers(5, REQUEST)
    events = to_server(client, server)
    assert [type(e) for e in events] == [h2.events.RequestReceived]
    assert server.open_inbound_streams == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["open", "end", "answer", "reset"]), st.integers(0, 7)),
        max_size=40,
    )
)
def test_the_count_follows_every_stream_state(steps: list[tuple[str, int]]) -> None:
    """Random opens, half-closes and closes: the count is the streams neither side has
    closed, and the closed ones leave `streams` for `_closed_streams` once counted."""
    client, server = pair()
    ended: set[int] = set()  # the client has ended its side
    closed: set[int] = set()
    opened: list[int] = []
    for action, k in steps:
        if action == "open":
            sid = 2 * len(opened) + 1
            client.send_headers(sid, REQUEST)
            opened.append(sid)
            to_server(client, server)
            continue
        live = [s for s in opened if s not in closed]
        if not live:
            continue
        sid = live[k % len(live)]
        if action == "end" and sid not in ended:
            client.end_stream(sid)
            ended.add(sid)
            to_server(client, server)
        elif action == "answer":
            server.send_headers(sid, RESPONSE, end_stream=True)
            client.receive_data(server.data_to_send())
            closed.update({sid} & ended)
            if sid not in ended:  # the server's half is done; the client's may follow
                client.end_stream(sid)
                ended.add(sid)
                to_server(client, server)
                closed.add(sid)
        elif action == "reset":
            server.reset_stream(sid)
            client.receive_data(server.data_to_send())
            closed.add(sid)
    assert server.open_inbound_streams == len(opened) - len(closed)
    assert set(server.streams) == set(opened) - closed
    assert set(server._closed_streams) >= closed
