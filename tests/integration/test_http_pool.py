"""HttpPool against a scripted HTTP/1.1 server on loopback (real sockets, Trio on both ends).

The server answers each request with the next scripted reply, byte for byte,
so framing edge cases (chunked, close-delimited, interim 1xx, malformed heads,
stale keep-alive connections) are exercised exactly. Every test is capped by
trio.fail_after; a few sleeps give a FIN or an expiry time to land.
"""

from __future__ import annotations

import re
import ssl
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio
import trustme

from ibex.sources.http_framing import ResponseTooLarge, TransportError, TransportTimeout
from ibex.sources.http_pool import HttpPool
from ibex.sources.memory_http import MemoryHttpSource

CAP = 10.0
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CLOSE = b""  # a reply of no bytes: close the connection without answering


@dataclass
class Reply:
    data: bytes
    close: bool = False  # close the connection after sending
    pieces: int = 1  # send in this many writes, 1 ms apart


@dataclass
class Scripted:
    replies: deque[Reply] = field(default_factory=deque)
    heads: list[bytes] = field(default_factory=list)
    accepted: int = 0
    open: int = 0
    gate: trio.Event = field(default_factory=trio.Event)  # answers to /slow wait for it

    def script(self, *replies: bytes | Reply) -> None:
        for r in replies:
            self.replies.append(r if isinstance(r, Reply) else Reply(r))

    async def handle(self, stream: trio.abc.Stream) -> None:
        self.accepted += 1
        self.open += 1
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                n = int(m.group(1)) if m else 0
                while len(buf) < n:
                    buf += await stream.receive_some(65536)
                buf = buf[n:]
                self.heads.append(head)
                if b"/slow " in head.split(b"\r\n", 1)[0]:
                    await self.gate.wait()
                reply = self.replies.popleft()
                if not reply.data:
                    return
                step = -(-len(reply.data) // reply.pieces)
                for i in range(0, len(reply.data), step):
                    await stream.send_all(reply.data[i : i + step])
                    if reply.pieces > 1:
                        await trio.sleep(0.001)
                if reply.close:
                    return
        except trio.BrokenResourceError:
            return
        finally:
            self.open -= 1
            await trio.aclose_forcefully(stream)

    def paths(self) -> list[bytes]:
        return [h.split(b" ")[1] for h in self.heads]


@asynccontextmanager
async def serve(
    nursery: trio.Nursery, *, tls: ssl.SSLContext | None = None, **pool_kw: object
) -> AsyncIterator[tuple[Scripted, HttpPool, int]]:
    server = Scripted()
    if tls is None:
        listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), server.handle, 0)
    else:
        serve_tls = partial(trio.serve_ssl_over_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve_tls, server.handle, 0, tls)
    listener = listeners[0]
    sock = listener.transport_listener.socket if tls else listener.socket
    port = sock.getsockname()[1]
    kw: dict[str, object] = {
        "headers": {"Authorization": "Bearer t0k"},
        "max_connections": 4,
        "keepalive_expiry": 5.0,
        "timeout": 5.0,
        "max_response_bytes": 1000,
    }
    kw.update(pool_kw)
    scheme = "https" if tls else "http"
    pool = HttpPool(f"{scheme}://127.0.0.1:{port}/api/", **kw)  # type: ignore[arg-type]
    try:
        yield server, pool, port
    finally:
        await pool.aclose()


async def test_keep_alive_reuses_one_connection_and_sends_the_contract_head(
    nursery: trio.Nursery,
) -> None:
    async with serve(nursery) as (server, pool, port):
        server.script(OK, OK, OK)
        with trio.fail_after(CAP):
            for _ in range(2):
                assert await pool.request("GET", "/v1/x?a=1") == (200, b"ok")
            assert await pool.request("POST", "/v1/y", b'{"q":1}', "application/json") == (
                200,
                b"ok",
            )
        assert server.accepted == 1
        stats = pool.stats()
        assert (stats.opened, stats.connections, stats.idle, stats.in_use) == (1, 1, 1, 0)
        get, _, post = server.heads
        assert get.split(b"\r\n") == [
            b"GET /api/v1/x?a=1 HTTP/1.1",
            f"Host: 127.0.0.1:{port}".encode(),
            b"Authorization: Bearer t0k",
        ]
        assert b"Content-Type: application/json\r\nContent-Length: 7" in post


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world",
    ],
    ids=["chunked+trailer", "chunked-case", "interim-100"],
)
@pytest.mark.parametrize("pieces", [1, 7])
async def test_framings_are_parsed_and_the_connection_kept(
    nursery: trio.Nursery, reply: bytes, pieces: int
) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(Reply(reply, pieces=pieces), OK)
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"hello world")
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert server.accepted == 1


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiEXTRA",  # bytes nobody asked for
    ],
    ids=["connection-close", "http-1.0", "leftover-bytes"],
)
async def test_connection_not_reusable_is_closed(nursery: trio.Nursery, reply: bytes) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(reply, OK)
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"hi")
            assert pool.stats().connections == 0
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert server.accepted == 2


async def test_close_delimited_body(nursery: trio.Nursery) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(Reply(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", close=True, pieces=3))
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"until the end")
        assert pool.stats().connections == 0


MALFORMED = {
    "not http": b"HTTX/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "status not digits": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
    "te and cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
    "te gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx",
    "chunk size 0x": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
    "chunk no crlf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokX0\r\n\r\n",
    "conflicting cl": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    # RFC 9112 6.3 lets a recipient reject even identical repeats; llhttp does.
    "repeated cl": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "cl negative": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nok",
    "cl plus": b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok",
    "folded header": b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  folded\r\nContent-Length: 2\r\n\r\nok",
    "no colon": b"HTTP/1.1 200 OK\r\nbroken header\r\nContent-Length: 2\r\n\r\nok",
    "switching": b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    "huge head": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_answer_is_an_error_and_the_connection_dropped(
    nursery: trio.Nursery, case: str
) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(MALFORMED[case], OK)
        with trio.fail_after(CAP):
            with pytest.raises(TransportError, match=r"^transport error \(RemoteProtocolError\)$"):
                await pool.request("GET", "/a")
            stats = pool.stats()
            assert (stats.connections, stats.leases) == (0, 0)
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert server.accepted == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1001\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"200\r\n"
        + b"a" * 512
        + b"\r\n"
        + b"200\r\n"
        + b"a" * 512
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n" + b"a" * 1500,
    ],
    ids=["content-length", "chunked", "close-delimited"],
)
async def test_size_cap(nursery: trio.Nursery, reply: bytes) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(Reply(reply, close=True, pieces=3))
        with trio.fail_after(CAP):
            with pytest.raises(ResponseTooLarge, match="larger than 1000 bytes"):
                await pool.request("GET", "/a")
        assert pool.stats().connections == 0


async def test_idle_connection_closed_by_the_server_is_not_reused(nursery: trio.Nursery) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(Reply(OK, close=True), OK)  # closes after answering, without saying so
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"ok")
            await trio.sleep(0.05)  # the FIN arrives
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert pool.stats().opened == 2
        assert server.paths() == [b"/api/a", b"/api/b"]  # no request was lost or repeated


async def test_reused_connection_dropped_before_answering_is_retried_once_fresh(
    nursery: trio.Nursery,
) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(OK, CLOSE, OK)
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"ok")
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert server.paths() == [b"/api/a", b"/api/b", b"/api/b"]
        assert (server.accepted, pool.stats().opened) == (2, 2)


async def test_fresh_connection_dropped_before_answering_is_an_error(
    nursery: trio.Nursery,
) -> None:
    async with serve(nursery) as (server, pool, _):
        server.script(CLOSE, OK)
        with trio.fail_after(CAP):
            with pytest.raises(TransportError, match=r"\(ReadError\)"):
                await pool.request("GET", "/a")
        assert server.paths() == [b"/api/a"]  # not retried
        assert pool.stats().connections == 0


async def test_idle_connections_expire(nursery: trio.Nursery) -> None:
    async with serve(nursery, keepalive_expiry=0.05) as (server, pool, _):
        server.script(OK, OK)
        with trio.fail_after(CAP):
            await pool.request("GET", "/a")
            await trio.sleep(0.1)
            await pool.request("GET", "/b")
            assert (server.accepted, pool.stats().opened, pool.stats().connections) == (2, 2, 1)
            while server.open > 1:  # noqa: ASYNC110 (the expired one, closed by us)
                await trio.sleep(0.005)


async def test_waiters_get_slots_first_come_first_served(nursery: trio.Nursery) -> None:
    async with serve(nursery, max_connections=1) as (server, pool, _):
        server.script(*[OK] * 5)
        done: list[str] = []

        async def call(path: str) -> None:
            await pool.request("GET", path)
            done.append(path)

        with trio.fail_after(CAP):
            async with trio.open_nursery() as calls:
                calls.start_soon(call, "/slow")
                await trio.testing.wait_all_tasks_blocked()
                for path in ("/b", "/c", "/d", "/e"):
                    calls.start_soon(call, path)
                    await trio.testing.wait_all_tasks_blocked()
                stats = pool.stats()
                assert (stats.leases, stats.waiters, stats.in_use) == (1, 4, 1)
                server.gate.set()
        assert done == ["/slow", "/b", "/c", "/d", "/e"]
        assert server.accepted == 1


async def test_cancelled_waiter_and_cancelled_read_leave_nothing(nursery: trio.Nursery) -> None:
    async with serve(nursery, max_connections=1) as (server, pool, _):
        server.script(OK, OK)
        with trio.fail_after(CAP):
            async with trio.open_nursery() as calls:
                calls.start_soon(pool.request, "GET", "/slow")
                await trio.testing.wait_all_tasks_blocked()
                with trio.move_on_after(0.02) as waiter:  # queued behind /slow
                    await pool.request("GET", "/b")
                assert waiter.cancelled_caught
                assert pool.stats().waiters == 0
                calls.cancel_scope.cancel()  # and the one reading (never answered)
            stats = pool.stats()
            assert (stats.connections, stats.leases, stats.waiters, stats.in_use) == (0, 0, 0, 0)
            server.gate.set()  # its answer now goes to a connection we closed, not pooled
            while server.open:  # noqa: ASYNC110 (the server sees the close on its next read)
                await trio.sleep(0.005)
            assert await pool.request("GET", "/c") == (200, b"ok")
            assert server.accepted == 2


async def test_safety_net_timeout(nursery: trio.Nursery) -> None:
    async with serve(nursery, timeout=0.05) as (_, pool, _port):
        with trio.fail_after(CAP):
            with pytest.raises(TransportTimeout, match=r"^transport timeout \(ReadTimeout\)$"):
                await pool.request("GET", "/slow")
        assert pool.stats().connections == 0


async def test_tls_with_reuse_and_a_wrong_ca(nursery: trio.Nursery) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with serve(nursery, tls=server_ctx, ssl_context=client_ctx) as (server, pool, port):
        server.script(OK, OK)
        with trio.fail_after(CAP):
            assert await pool.request("GET", "/a") == (200, b"ok")
            assert await pool.request("GET", "/b") == (200, b"ok")
        assert pool.stats().opened == 1
        stranger = HttpPool(
            f"https://127.0.0.1:{port}",
            headers={},
            max_connections=1,
            keepalive_expiry=5.0,
            timeout=5.0,
            max_response_bytes=1000,
            ssl_context=ssl.create_default_context(),  # does not trust the test CA
        )
        with trio.fail_after(CAP), pytest.raises(TransportError, match=r"\(ConnectError\)"):
            await stranger.request("GET", "/a")
        assert stranger.stats().connections == 0


@pytest.mark.parametrize(
    ("url", "headers"),
    [
        ("ftp://h", {}),
        ("http://user:pw@h", {}),
        ("http://h?x=1", {}),
        ("http://h", {"X-A": "1\r\nX-Injected: 1"}),
        ("http://h", {"Bad Name": "1"}),
    ],
)
def test_bad_configuration_is_refused(url: str, headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        HttpPool(
            url,
            headers=headers,
            max_connections=1,
            keepalive_expiry=1.0,
            timeout=1.0,
            max_response_bytes=1,
        )


def test_memory_source_refuses_a_bad_base_url_at_construction() -> None:
    with pytest.raises(ValueError) as info:
        MemoryHttpSource("http://user:hunter2@memory.internal", "t0k")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError, match="invalid port"):
        MemoryHttpSource("http://memory.internal:99999", "t0k")
