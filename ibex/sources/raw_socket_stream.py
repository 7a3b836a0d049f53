"""A plain-TCP `trio.abc.Stream` that parks in Trio only when the socket would block."""

from __future__ import annotations

import socket
from typing import Final

import trio

__all__ = ["RECV_BYTES", "RawSocketStream"]

# Bytes asked of the socket per read, here and by the exchange over any stream.
RECV_BYTES: Final = 64 * 1024


class RawSocketStream(trio.abc.Stream):
    """Plain TCP on a non-blocking stdlib socket that parks in Trio only when it must.

    trio's SocketStream yields to the scheduler after every send and receive
    that succeeded at once, each a full scheduler pass: one exchange with the
    memory service costs five Trio steps where two are needed (the start, and
    the wake when the answer is readable). Here each operation checks for
    cancellation on entry (raising at once if cancelled, as any checkpoint
    would), tries the syscall and waits for readiness only on EAGAIN.
    """

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            sent, total = 0, len(view)
            while sent < total:
                try:
                    sent += self.sock.send(view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.sock)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return self.sock.recv(max_bytes or RECV_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)

    async def receive_reply(self, max_bytes: int | None = None) -> bytes:
        """The first read after a request was sent: the peer cannot have answered
        within the send, so this waits for readability before the first `recv`
        instead of trying one that fails with EAGAIN (a syscall and an exception per
        exchange). Cancellation as for `receive_some`: the wait is the checkpoint."""
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                return self.sock.recv(max_bytes or RECV_BYTES)
            except BlockingIOError:
                pass  # a spurious wakeup: wait again

    async def aclose(self) -> None:
        self.sock.close()
        await trio.lowlevel.checkpoint()
