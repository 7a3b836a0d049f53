"""HttpPool over in-memory streams through its injectable `connect`.

No sockets: each connection is a `trio.testing.memory_stream_pair`, the server
end answered by a scripted task. What is checked is the pool's side of the
framing: reuse only after a clean, complete answer; anything else closes the
connection (synchronously) and never pools it; a reused connection the server
dropped is re-sent once on a fresh one.
"""

from __future__ import annotations

from collections import deque

import pytest
import trio
import trio.testing

from ibex.sources.http_connect import Link
from ibex.sources.http_framing import TransportError, TransportTimeout
from ibex.sources.http_pool import HttpPool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CAP = 10.0
MemoryStream = trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream]


class FlagLink:
    """Link for a stream without a synchronous close: records that the pool closed it."""

    closed = False

    def close(self) -> None:
        self.closed = True

    def unusable(self) -> bool:
        return self.closed


class MemoryLink:
    """Link for an in-memory stream: memory streams close synchronously too."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.stream.send_stream.close()
        self.stream.receive_stream.close()

    def unusable(self) -> bool:
        return self.closed


class Harness:
    """Scripted replies, one per request, on fresh in-memory connections."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.replies: deque[bytes | None] = deque()  # None: close without answering
        self.requests: list[bytes] = []
        self.links: list[MemoryLink] = []

    async def connect(self) -> tuple[trio.abc.Stream, Link]:
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, server)
        link = MemoryLink(client)
        self.links.append(link)
        return client, link

    async def _serve(self, stream: trio.abc.Stream) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.receive_some()
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head.split(b"\r\n", 1)[0])
                reply = self.replies.popleft()
                if reply is None:
                    return
                await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    def pool(self, **kw: object) -> HttpPool:
        args: dict[str, object] = {
            "headers": {},
            "max_connections": 2,
            "keepalive_expiry": 60.0,
            "timeout": 30.0,
            "max_response_bytes": 1000,
        }
        args.update(kw)
        return HttpPool("http://memory.test", connect=self.connect, **args)  # type: ignore[arg-type]


async def test_a_clean_answer_keeps_the_connection(nursery: trio.Nursery) -> None:
    h = Harness(nursery)
    h.replies.extend([OK, OK])
    pool = h.pool()
    with trio.fail_after(CAP):
        assert await pool.request("GET", "/a") == (200, b"ok")
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert len(h.links) == 1 and not h.links[0].closed
    assert h.requests == [b"GET /a HTTP/1.1", b"GET /b HTTP/1.1"]
    await pool.aclose()
    assert h.links[0].closed


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["leftover", "connection-close"],
)
async def test_an_answer_that_is_not_clean_closes_the_connection(
    nursery: trio.Nursery, reply: bytes
) -> None:
    h = Harness(nursery)
    h.replies.extend([reply, OK])
    pool = h.pool()
    with trio.fail_after(CAP):
        assert await pool.request("GET", "/a") == (200, b"ok")
        assert h.links[0].closed and pool.stats().connections == 0
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert len(h.links) == 2


async def test_protocol_error_closes_and_frees_the_slot(nursery: trio.Nursery) -> None:
    h = Harness(nursery)
    h.replies.extend([b"HTTP/1.1 200 OK\r\nX: a\x00\r\nContent-Length: 2\r\n\r\nok", OK])
    pool = h.pool(max_connections=1)
    with trio.fail_after(CAP):
        with pytest.raises(TransportError, match=r"\(RemoteProtocolError\)"):
            await pool.request("GET", "/a")
        assert h.links[0].closed
        assert (pool.stats().connections, pool.stats().leases) == (0, 0)
        assert await pool.request("GET", "/b") == (200, b"ok")


async def test_cancelled_mid_answer_closes_and_never_pools(nursery: trio.Nursery) -> None:
    h = Harness(nursery)
    h.replies.extend([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", OK])
    pool = h.pool()
    with trio.fail_after(CAP):
        with trio.move_on_after(0.05) as scope:
            await pool.request("GET", "/a")
        assert scope.cancelled_caught
        assert h.links[0].closed
        stats = pool.stats()
        assert (stats.connections, stats.leases, stats.in_use) == (0, 0, 0)
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert len(h.links) == 2


async def test_a_reused_connection_dropped_by_the_server_is_resent_once(
    nursery: trio.Nursery,
) -> None:
    h = Harness(nursery)
    h.replies.extend([OK, None, OK])
    pool = h.pool()
    with trio.fail_after(CAP):
        assert await pool.request("GET", "/a") == (200, b"ok")
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert h.requests == [b"GET /a HTTP/1.1", b"GET /b HTTP/1.1", b"GET /b HTTP/1.1"]
    assert len(h.links) == 2 and h.links[0].closed


async def test_a_fresh_connection_dropped_is_an_error_not_resent(nursery: trio.Nursery) -> None:
    h = Harness(nursery)
    h.replies.extend([None, OK])
    pool = h.pool()
    with trio.fail_after(CAP):
        with pytest.raises(TransportError, match=r"\(ReadError\)"):
            await pool.request("GET", "/a")
    assert h.requests == [b"GET /a HTTP/1.1"]
    assert pool.stats().connections == 0


async def test_answers_split_anywhere_arrive_whole(nursery: trio.Nursery) -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    client, server = trio.testing.lockstep_stream_pair()  # every send meets one receive

    link = FlagLink()

    async def connect() -> tuple[trio.abc.Stream, Link]:
        return client, link

    async def serve() -> None:
        await server.receive_some()
        for i in range(len(answer)):
            await server.send_all(answer[i : i + 1])

    pool = HttpPool(
        "http://memory.test",
        headers={},
        max_connections=1,
        keepalive_expiry=60.0,
        timeout=30.0,
        max_response_bytes=1000,
        connect=connect,
    )
    nursery.start_soon(serve)
    with trio.fail_after(CAP):
        assert await pool.request("GET", "/a") == (200, b"hello world")
    assert pool.stats().idle == 1 and not link.closed


# -- drains: a call cancelled after its request was written ---------------------


class GatedHarness(Harness):
    """Answers wait for `gate` (set it to let the server answer); `None` never answers."""

    def __init__(self, nursery: trio.Nursery) -> None:
        super().__init__(nursery)
        self.gate = trio.Event()
        self.read = 0  # requests the server has read

    async def _serve(self, stream: trio.abc.Stream) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.receive_some()
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head.split(b"\r\n", 1)[0])
                self.read += 1
                reply = self.replies.popleft()
                if reply is None:
                    await trio.sleep_forever()
                await self.gate.wait()
                await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await trio.aclose_forcefully(stream)


async def _cut(pool: HttpPool, h: GatedHarness, path: str = "/a") -> None:
    """A call cancelled while the server holds its answer (the request was read)."""
    seen = h.read
    with trio.CancelScope() as scope:

        async def cut_when_read() -> None:
            while h.read == seen:  # noqa: ASYNC110 (the harness has no event for it)
                await trio.sleep(0.001)
            scope.cancel()

        async with trio.open_nursery() as inner:
            inner.start_soon(cut_when_read)
            await pool.request("GET", path)
    assert scope.cancelled_caught


async def _settled(pool: HttpPool) -> None:
    while pool.stats().draining:  # noqa: ASYNC110 (a drain is no event)
        await trio.sleep(0.001)


async def test_a_cut_call_drains_its_answer_and_the_next_call_reuses_the_connection(
    nursery: trio.Nursery,
) -> None:
    h = GatedHarness(nursery)
    h.replies.extend([OK, OK])
    pool = h.pool(max_connections=1, background=nursery)
    with trio.fail_after(CAP):
        await _cut(pool, h)
        stats = pool.stats()
        # the drain holds the cut call's slot: still one connection, counted, not idle
        assert (stats.draining, stats.leases, stats.connections, stats.idle) == (1, 1, 1, 0)
        assert not h.links[0].closed
        async with trio.open_nursery() as calls:
            answers: list[tuple[int, bytes]] = []

            async def call() -> None:
                answers.append(tuple(await pool.request("GET", "/b")))  # type: ignore[arg-type]

            calls.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            # a waiter is not handed the draining connection: it queues for the slot
            assert pool.stats().waiters == 1 and h.read == 1
            h.gate.set()
        assert answers == [(200, b"ok")]
    assert len(h.links) == 1 and not h.links[0].closed  # the same connection carried /b
    assert h.requests == [b"GET /a HTTP/1.1", b"GET /b HTTP/1.1"]
    stats = pool.stats()
    assert (stats.draining, stats.leases, stats.connections, stats.idle) == (0, 0, 1, 1)


async def test_a_cut_call_mid_body_drains_the_rest(nursery: trio.Nursery) -> None:
    client, server = trio.testing.memory_stream_pair()
    link = FlagLink()

    async def connect() -> tuple[trio.abc.Stream, Link]:
        return client, link

    pool = HttpPool(
        "http://memory.test",
        headers={},
        max_connections=1,
        keepalive_expiry=60.0,
        timeout=30.0,
        max_response_bytes=1000,
        connect=connect,
        background=nursery,
    )
    with trio.fail_after(CAP):
        with trio.move_on_after(0.05) as scope:
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"
            nursery.start_soon(server.send_all, head + b"half")
            await pool.request("GET", "/a")
        assert scope.cancelled_caught and pool.stats().draining == 1
        await server.send_all(b"-rest")
        await server.send_all(b"!")
        await _settled(pool)
    assert not link.closed and pool.stats().idle == 1


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n" + b"x" * 200,  # over drain_bytes
        b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000,  # over the answer cap
        b"HTTP/1.1 200 OK\r\nX: a\x00\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nclose-delimited",
    ],
    ids=["leftover", "connection-close", "over-drain-cap", "over-answer-cap", "malformed", "eof"],
)
async def test_a_drained_answer_that_is_not_clean_closes_the_connection(
    nursery: trio.Nursery, reply: bytes
) -> None:
    h = GatedHarness(nursery)
    h.replies.extend([reply, OK])
    pool = h.pool(max_connections=1, background=nursery, drain_bytes=100)
    with trio.fail_after(CAP):
        await _cut(pool, h)
        h.gate.set()
        await _settled(pool)
        assert h.links[0].closed
        stats = pool.stats()
        assert (stats.connections, stats.leases, stats.in_use) == (0, 0, 0)
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert len(h.links) == 2


async def test_a_drain_that_outlasts_its_time_cap_closes_the_connection(
    nursery: trio.Nursery,
) -> None:
    h = GatedHarness(nursery)
    h.replies.extend([None, OK])  # never answered
    pool = h.pool(max_connections=1, background=nursery, drain_seconds=0.05)
    with trio.fail_after(CAP):
        await _cut(pool, h)
        assert pool.stats().draining == 1
        await _settled(pool)
        assert h.links[0].closed
        assert (pool.stats().connections, pool.stats().leases) == (0, 0)
        h.gate.set()
        assert await pool.request("GET", "/b") == (200, b"ok")
    assert len(h.links) == 2


def test_the_drain_caps_never_exceed_the_answer_cap_or_the_idle_timeout() -> None:
    pool = HttpPool(
        "http://memory.test",
        headers={},
        max_connections=1,
        keepalive_expiry=0.25,
        timeout=30.0,
        max_response_bytes=1000,
    )
    assert (pool._drain_bytes, pool._drain_seconds) == (1000, 0.25)


async def test_closing_the_pool_cancels_its_drains(nursery: trio.Nursery) -> None:
    h = GatedHarness(nursery)
    h.replies.extend([None])
    pool = h.pool(max_connections=1, background=nursery, drain_seconds=3600.0)
    with trio.fail_after(CAP):
        await _cut(pool, h)
        assert pool.stats().draining == 1
        await pool.aclose()
        await trio.testing.wait_all_tasks_blocked()
    assert h.links[0].closed
    stats = pool.stats()
    assert (stats.draining, stats.connections, stats.leases) == (0, 0, 0)


async def test_a_call_cut_while_writing_closes_the_connection(nursery: trio.Nursery) -> None:
    client, _server = trio.testing.lockstep_stream_pair()  # the server never reads
    link = FlagLink()

    async def connect() -> tuple[trio.abc.Stream, Link]:
        return client, link

    pool = HttpPool(
        "http://memory.test",
        headers={},
        max_connections=1,
        keepalive_expiry=60.0,
        timeout=30.0,
        max_response_bytes=1000,
        connect=connect,
        background=nursery,
    )
    with trio.fail_after(CAP):
        with trio.move_on_after(0.02) as scope:
            await pool.request("GET", "/a")
    assert scope.cancelled_caught
    assert link.closed  # its state is unknown: never drained
    stats = pool.stats()
    assert (stats.draining, stats.connections, stats.leases) == (0, 0, 0)


async def test_a_closed_nursery_means_close_not_drain() -> None:
    async with trio.open_nursery() as gone:
        pass
    async with trio.open_nursery() as nursery:
        h = GatedHarness(nursery)
        h.replies.extend([OK])
        pool = h.pool(max_connections=1, background=gone)
        with trio.fail_after(CAP):
            await _cut(pool, h)
        assert h.links[0].closed
        assert (pool.stats().draining, pool.stats().leases) == (0, 0)
        nursery.cancel_scope.cancel()


async def _silent_connect() -> tuple[trio.abc.Stream, Link]:
    """A connection whose server reads the request and never answers."""
    client, _server = trio.testing.memory_stream_pair()
    return client, MemoryLink(client)


def _silent_pool() -> HttpPool:
    """One connection at a time, a 30 s safety-net timeout, a server that never answers."""
    return HttpPool(
        "http://memory.test", headers={}, max_connections=1, keepalive_expiry=60.0,
        timeout=30.0, max_response_bytes=1000, connect=_silent_connect,
    )  # fmt: skip


@pytest.mark.parametrize("caller_deadline", [None, 60.0])
async def test_the_pool_timeout_ends_a_call_the_caller_would_let_run_longer(
    autojump_clock: trio.testing.MockClock, caller_deadline: float | None
) -> None:
    pool = _silent_pool()
    start = trio.current_time()
    caller = trio.CancelScope(deadline=start + (caller_deadline or float("inf")))
    with caller, pytest.raises(TransportTimeout, match=r"^transport timeout \(ReadTimeout\)$"):
        await pool.request("GET", "/a")
    assert trio.current_time() - start == pytest.approx(30.0)
    assert (pool.stats().leases, pool.stats().connections) == (0, 0)


async def test_a_caller_deadline_before_the_pool_timeout_cancels_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = _silent_pool()
    start = trio.current_time()
    with trio.move_on_after(5.0) as scope:
        await pool.request("GET", "/a")
    assert scope.cancelled_caught
    assert trio.current_time() - start == pytest.approx(5.0)
    assert (pool.stats().leases, pool.stats().connections) == (0, 0)
