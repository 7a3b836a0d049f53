"""RawSocketStream: the memory pool's plain-TCP stream, which parks in Trio only on EAGAIN.

Real sockets (a socketpair): what is pinned is that bytes arrive whole and in
order whatever the buffer sizes, that a cancelled caller is refused at entry
as at any checkpoint, and that an operation that can complete at once costs
no pass through the scheduler (the reason the class exists).
"""

from __future__ import annotations

import socket

import pytest
import trio

from ibex.sources.raw_socket_stream import RawSocketStream


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


@pytest.fixture
def pair() -> tuple[RawSocketStream, socket.socket]:
    a, b = socket.socketpair()
    yield RawSocketStream(a), b
    a.close()
    b.close()


async def test_round_trip_larger_than_the_socket_buffers(
    pair: tuple[RawSocketStream, socket.socket],
) -> None:
    stream, peer = pair
    peer_stream = RawSocketStream(peer)
    payload = bytes(range(256)) * 16_384  # 4 MiB: send_all must wait for room
    got = bytearray()

    async def read_all() -> None:
        while len(got) < len(payload):
            chunk = await peer_stream.receive_some(65_536)
            assert chunk
            got.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await stream.send_all(payload)
    assert bytes(got) == payload


@pytest.mark.parametrize("method", ["receive_some", "receive_reply"])
async def test_receive_waits_for_data_then_returns_it(
    pair: tuple[RawSocketStream, socket.socket], method: str
) -> None:
    stream, peer = pair
    receive = getattr(stream, method)

    async def answer_later() -> None:
        await trio.sleep(0.01)
        peer.send(b"late")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_later)
        assert await receive() == b"late"
    peer.shutdown(socket.SHUT_WR)
    assert await receive() == b""


async def test_eof_is_empty_bytes(pair: tuple[RawSocketStream, socket.socket]) -> None:
    stream, peer = pair
    peer.shutdown(socket.SHUT_WR)
    assert await stream.receive_some() == b""


async def test_a_cancelled_caller_is_refused_even_when_data_waits(
    pair: tuple[RawSocketStream, socket.socket],
) -> None:
    stream, peer = pair
    peer.send(b"ready")
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await stream.receive_some()
        with pytest.raises(trio.Cancelled):
            await stream.send_all(b"x")
    assert await stream.receive_some() == b"ready"  # nothing was consumed


async def test_operations_that_complete_at_once_do_not_yield(
    pair: tuple[RawSocketStream, socket.socket],
) -> None:
    stream, peer = pair
    peer.send(b"answer")
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        await stream.send_all(b"request")
        assert await stream.receive_some() == b"answer"
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert steps.count == 0
    assert peer.recv(100) == b"request"


async def test_a_reset_peer_is_an_oserror(pair: tuple[RawSocketStream, socket.socket]) -> None:
    stream, peer = pair
    peer.close()
    with pytest.raises(OSError):
        for _ in range(100):
            await stream.send_all(b"x" * 65_536)


class CountingSocket(socket.socket):
    """A socket that counts its `recv` calls, the ones that fail with EAGAIN included."""

    recvs = 0

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.recvs += 1
        return super().recv(bufsize, flags)


async def test_an_answer_read_after_its_request_costs_one_recv() -> None:
    """The exchange's first read waits for the answer before its `recv`: no recv is
    tried before the peer can have answered (it would fail with EAGAIN)."""
    from ibex.sources.http_connect import SocketLink
    from ibex.sources.http_exchange import Connection, read_response, send_request
    from ibex.sources.http_framing import ResponseParser

    a, peer = socket.socketpair()
    sock = CountingSocket(a.family, a.type, fileno=a.detach())
    with sock, peer:
        conn = Connection(RawSocketStream(sock), SocketLink(sock))

        async def answer_later() -> None:
            await trio.sleep(0.01)
            assert peer.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
            peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_later)
                await send_request(conn, b"GET / HTTP/1.1\r\n\r\n")
                response, keep = await read_response(conn, ResponseParser(1000))
        assert (response.status, response.body, keep) == (200, b"ok", True)
        assert sock.recvs == 1
