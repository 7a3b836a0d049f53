"""`tcp_connect`: the memory pool's plain-TCP connect to an IP literal.

Real loopback sockets. What is pinned: the connection works both ways and has the
options trio's own streams set (TCP_NODELAY), a refused connect is a
ConnectError, a cancelled connect leaves no socket open, and an IP literal is
connected in the calling task, with no resolver and no nursery of connection
attempts (the reason the direct path exists: the pool connects on the request
path whenever no idle connection is free).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import trio

from ibex.sources.http_connect import Link, tcp_connect
from ibex.sources.http_framing import TransportError
from ibex.sources.raw_socket_stream import RawSocketStream


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    yield ls
    ls.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Spawned(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def test_an_ip_literal_connects_in_the_calling_task(listener: socket.socket) -> None:
    connect = tcp_connect("127.0.0.1", listener.getsockname()[1], None)
    spawned = Spawned()
    trio.lowlevel.add_instrument(spawned)
    try:
        with trio.fail_after(10):
            stream, link = await connect()
    finally:
        trio.lowlevel.remove_instrument(spawned)
    assert spawned.count == 0  # no resolver thread, no Happy Eyeballs nursery
    peer, _ = listener.accept()
    try:
        assert isinstance(stream, RawSocketStream)
        assert stream.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert stream.sock.getblocking() is False
        with trio.fail_after(10):
            await stream.send_all(b"ping")
            assert peer.recv(4) == b"ping"
            peer.sendall(b"pong")
            assert await stream.receive_some(4) == b"pong"
        assert not link.unusable()
    finally:
        link.close()
        peer.close()


async def test_a_refused_connect_is_a_connect_error_and_leaves_no_socket() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    connect = tcp_connect("127.0.0.1", port, None)
    before = _open_fds()
    with trio.fail_after(10), pytest.raises(TransportError, match="ConnectError"):
        await connect()
    assert _open_fds() == before


async def test_a_cancelled_connect_leaves_no_socket(listener: socket.socket) -> None:
    connect = tcp_connect("127.0.0.1", listener.getsockname()[1], None)
    before = _open_fds()
    with trio.CancelScope() as scope:
        scope.cancel()
        await connect()
    assert scope.cancelled_caught
    assert _open_fds() == before


async def test_a_host_name_still_connects(listener: socket.socket) -> None:
    connect = tcp_connect("localhost", listener.getsockname()[1], None)
    try:
        with trio.fail_after(10):
            stream, link = await connect()
    except TransportError:
        pytest.skip("localhost does not resolve to 127.0.0.1 here")
    await _one_byte_across(stream, link, listener)


async def _one_byte_across(stream: trio.abc.Stream, link: Link, listener: socket.socket) -> None:
    """The accepted peer receives what `stream` sends; both ends closed after."""
    peer, _ = listener.accept()
    try:
        with trio.fail_after(10):
            await stream.send_all(b"x")
            assert peer.recv(1) == b"x"
    finally:
        link.close()
        peer.close()


async def test_an_ipv6_literal_connects() -> None:
    try:
        ls = socket.socket(socket.AF_INET6)
        ls.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with ls:
        ls.listen(1)
        connect = tcp_connect("::1", ls.getsockname()[1], None)
        with trio.fail_after(10):
            stream, link = await connect()
        await _one_byte_across(stream, link, ls)
