"""TLS keep-alive desync (issue 11 item 5) against a real TLS memory stand-in on loopback.

The stand-in answers, then sends a stray second answer (another agent's
memories) in the same TCP segment. Over TLS the client's TLS layer reads both
records off the socket at once, so the socket polls quiet while the stray
waits above it; a reuse check that looks only at the socket would hand the
stray to the next request. Each request must get its own answer.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator

import pytest
import trio
import trio.testing
import trustme

from ibex.testing.memory_server import FakeMemoryServer, make_memories
from ibex.testing.samples import AGENT, ORG

STRAY_ORG = "00000000-0000-4000-8000-000000000002"
STRAY_AGENT = "00000000-0000-4000-8000-0000000000b2"
CAP = 10.0


@pytest.fixture(name="tls")
def tls_fixture() -> Iterator[tuple[FakeMemoryServer, ssl.SSLContext]]:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    with FakeMemoryServer(ssl_context=server_ctx) as server:
        yield server, client_ctx


def _stray_answer() -> bytes:
    memories = make_memories(STRAY_ORG, STRAY_AGENT, 3, seed=7)
    results = [
        {"memory": m, "similarity": 0.99, "rank": n, "source": "vector"}
        for n, m in enumerate(memories, start=1)
    ]
    body = json.dumps({"data": {"results": results}}).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("rounds", [1, 5])
async def test_a_stray_answer_in_the_tls_buffer_is_never_the_next_answer(
    tls: tuple[FakeMemoryServer, ssl.SSLContext], rounds: int
) -> None:
    server, client_ctx = tls
    own = make_memories(ORG, AGENT, 4, seed=1)
    server.add_memories(ORG, AGENT, own)
    own_ids = {m["id"] for m in own}
    async with server.source(client_ssl_context=client_ctx, pool_size=1) as source:
        with trio.fail_after(CAP):
            for _ in range(rounds):
                server.hot.stray = _stray_answer()
                first = await source.hot(ORG, AGENT, limit=10, min_confidence=0.0)
                assert {h.memory_id for h in first} == own_ids
                server.hot.stray = None
                for _ in range(2):
                    hits = await source.hot(ORG, AGENT, limit=10, min_confidence=0.0)
                    assert {h.memory_id for h in hits} == own_ids
                    assert all(h.org_id == ORG and h.agent_id == AGENT for h in hits)
    assert server.requests["hot"] == 3 * rounds


async def test_a_clean_tls_connection_is_still_reused(
    tls: tuple[FakeMemoryServer, ssl.SSLContext],
) -> None:
    server, client_ctx = tls
    server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 4, seed=1))
    async with server.source(client_ssl_context=client_ctx, pool_size=1) as source:
        with trio.fail_after(CAP):
            for _ in range(5):
                assert len(await source.hot(ORG, AGENT, limit=10, min_confidence=0.0)) == 4
        assert source.pool_stats().opened == 1
    assert server.accepted_connections == 1


def test_trio_ssl_stream_still_keeps_its_incoming_bio_where_the_pool_looks() -> None:
    """SocketLink.unusable reads trio.SSLStream's private `_incoming` BIO (encrypted
    records already read off the socket). If a trio upgrade moves it, fail here."""
    client, _ = trio.testing.memory_stream_pair()
    tls = trio.SSLStream(client, ssl.create_default_context(), server_hostname="127.0.0.1")
    assert isinstance(getattr(tls, "_incoming", None), ssl.MemoryBIO)
