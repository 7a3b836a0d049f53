"""MemoryHttpSource against a real HTTP server on loopback (ibex/testing/memory_server.py).

Real sockets, so real clocks: every test is capped with trio.fail_after.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio
import trio_asyncio

from ibex.config import Settings, replace_settings
from ibex.service.root import memory_http_source
from ibex.sources.base import SourceError
from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.memory_server import (
    DEMO_AGENT,
    DEMO_ORG,
    FakeMemoryServer,
    make_memories,
    memory_server_fixture,  # noqa: F401  (provides the memory_server fixture)
)

OTHER_ORG = "00000000-0000-4000-8000-000000000002"
OTHER_AGENT = "00000000-0000-4000-8000-0000000000b2"
SECRET_TEXT = "zebra-secret-memory-text"
CAP = 10.0


def _memory(i: int = 1, **overrides: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "id": f"10000000-0000-4000-8000-{i:012d}",
        "org_id": DEMO_ORG,
        "agent_id": DEMO_AGENT,
        "content": f"{SECRET_TEXT} number {i}",
        "category": "factual",
        "confidence": 0.8,
    }
    m.update(overrides)
    return m


def _item(i: int = 1, *, memory: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    item: dict[str, Any] = {
        "memory": memory if memory is not None else _memory(i),
        "similarity": 0.9,
        "rank": i,
        "source": "vector",
    }
    item.update(overrides)
    return item


def _body(*items: dict[str, Any]) -> bytes:
    return json.dumps({"data": {"results": list(items)}}).encode()


async def _error(
    server: FakeMemoryServer, branch: str = "hot", *, token: str | None = None
) -> SourceError:
    """Run one call expected to fail; check the detail leaks neither token nor memory text."""
    with trio.fail_after(CAP):
        async with server.source(token=token) as source:
            with pytest.raises(SourceError) as info:
                if branch == "hot":
                    await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)
                else:
                    await source.cold(DEMO_ORG, DEMO_AGENT, "query", limit=10, min_confidence=0.0)
    exc: BaseException | None = info.value
    while exc is not None:  # the whole chain, as a traceback would print it
        for secret in (server.token, token or server.token, SECRET_TEXT):
            assert secret not in str(exc)
            assert secret not in repr(exc)
        exc = exc.__cause__ or exc.__context__
    assert str(info.value).startswith(f"{branch}: ")
    return info.value


async def test_hot_happy_path_sends_contract_request(memory_server: FakeMemoryServer) -> None:
    memory_server.add_memories(DEMO_ORG, DEMO_AGENT, make_memories(DEMO_ORG, DEMO_AGENT, 12))
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            hits = await source.hot(DEMO_ORG, DEMO_AGENT, limit=5, min_confidence=0.25)

    assert len(hits) == 5
    assert [h.rank for h in hits] == [1, 2, 3, 4, 5]
    assert all(h.branch == "hot" and h.source == "vector" for h in hits)
    assert [h.confidence for h in hits] == sorted((h.confidence for h in hits), reverse=True)
    seen = memory_server.seen[-1]
    assert (seen.method, seen.path) == ("GET", "/v1/memories/hot")
    assert seen.query == {"agent_id": [DEMO_AGENT], "limit": ["5"], "min_confidence": ["0.25"]}
    assert seen.headers["authorization"] == f"Bearer {memory_server.token}"
    assert seen.headers["accept"] == "application/json"
    assert memory_server.requests["hot"] == 1


async def test_cold_happy_path_posts_contract_body(memory_server: FakeMemoryServer) -> None:
    memories = make_memories(DEMO_ORG, DEMO_AGENT, 6, seed=3)
    memory_server.add_memories(
        DEMO_ORG, DEMO_AGENT, memories, similarities=[0.5, 0.9, 0.7, 0.6, 0.8, 0.95]
    )
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            hits = await source.cold(
                DEMO_ORG, DEMO_AGENT, "how to deploy? 部署", limit=4, min_confidence=0.0
            )

    assert [h.similarity for h in hits] == [0.95, 0.9, 0.8, 0.7]
    assert [h.rank for h in hits] == [1, 2, 3, 4]
    assert all(h.branch == "cold" for h in hits)
    by_id = {m["id"]: m for m in memories}
    for h in hits:
        assert h.content == by_id[h.memory_id]["content"]
        assert h.category == by_id[h.memory_id]["category"]
    seen = memory_server.seen[-1]
    assert (seen.method, seen.path) == ("POST", "/v1/memories/search")
    assert json.loads(seen.body) == {
        "agent_id": DEMO_AGENT,
        "query": "how to deploy? 部署",
        "limit": 4,
        "min_confidence": 0.0,
    }
    assert seen.headers["content-type"] == "application/json"
    assert seen.headers["authorization"] == f"Bearer {memory_server.token}"
    assert seen.headers["accept"] == "application/json"


async def test_other_tenant_hits_are_returned_for_the_pipeline_to_filter(
    memory_server: FakeMemoryServer,
) -> None:
    memory_server.add_memories(DEMO_ORG, DEMO_AGENT, [_memory(1)])
    stray = _memory(2, org_id=OTHER_ORG, agent_id=OTHER_AGENT)
    memory_server.add_memories(OTHER_ORG, OTHER_AGENT, [stray], served_to=DEMO_AGENT)
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            hits = await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)
    assert {(h.org_id, h.agent_id) for h in hits} == {
        (DEMO_ORG, DEMO_AGENT),
        (OTHER_ORG, OTHER_AGENT),
    }


async def test_optional_keys_are_parsed_and_default_to_none(
    memory_server: FakeMemoryServer,
) -> None:
    full = _memory(
        1,
        created_at="2025-03-04T05:06:07.123456789Z",
        usefulness=0.25,
        access_count=7,
        future_key={"ignored": True},
    )
    memory_server.hot.body = _body(_item(1, memory=full), _item(2))
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            first, second = await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)
    assert (first.created_at, first.usefulness, first.access_count) == (
        "2025-03-04T05:06:07.123456789Z",
        0.25,
        7,
    )
    assert (second.created_at, second.usefulness, second.access_count) == (None, None, None)


def _without(key: str) -> dict[str, Any]:
    m = _memory(1)
    del m[key]
    return _item(1, memory=m)


BAD_BODIES: dict[str, bytes] = {
    "missing category": _body(_without("category")),
    "missing id": _body(_without("id")),
    "missing similarity": _body({k: v for k, v in _item(1).items() if k != "similarity"}),
    "confidence 1.5": _body(_item(1, memory=_memory(1, confidence=1.5))),
    "confidence negative": _body(_item(1, memory=_memory(1, confidence=-0.1))),
    "similarity as string NaN": _body(_item(1, similarity="NaN")),
    "similarity null": _body(_item(1, similarity=None)),
    "rank 0": _body(_item(1, rank=0)),
    "rank float": _body(_item(1, rank=1.5)),
    "rank as string": _body(_item(1, rank="1")),
    "empty id": _body(_item(1, memory=_memory(1, id=""))),
    "empty org_id": _body(_item(1, memory=_memory(1, org_id=""))),
    "numeric id": _body(_item(1, memory=_memory(1, id=123))),
    "id not a uuid": _body(_item(1, memory=_memory(1, id="not-a-uuid"))),
    "id uuid without hyphens": _body(_item(1, memory=_memory(1, id="1" * 32))),
    "id uuid in braces": _body(_item(1, memory=_memory(1, id="{" + _memory(1)["id"] + "}"))),
    "id uuid urn": _body(_item(1, memory=_memory(1, id="urn:uuid:" + _memory(1)["id"]))),
    "id uuid and newline": _body(_item(1, memory=_memory(1, id=_memory(1)["id"] + "\n"))),
    "id uuid with a non-ascii digit": _body(
        _item(1, memory=_memory(1, id=_memory(1)["id"][:-1] + "\u0661"))
    ),
    "usefulness 2": _body(_item(1, memory=_memory(1, usefulness=2))),
    "access_count negative": _body(_item(1, memory=_memory(1, access_count=-1))),
    "created_at not rfc3339": _body(_item(1, memory=_memory(1, created_at="yesterday"))),
    "created_at month 13": _body(_item(1, memory=_memory(1, created_at="2025-13-01T00:00:00Z"))),
    "one bad item among good": _body(
        _item(1), _item(2), _item(3, memory=_memory(3, confidence=7)), _item(4)
    ),
    "results not a list": b'{"data": {"results": {}}}',
    "no data": b'{"results": []}',
    "top level list": b"[]",
    "huge similarity": _body(_item(1)).replace(b'"similarity": 0.9', b'"similarity": 1e999'),
    "empty body": b"",
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
async def test_bad_shape_fails_the_whole_branch(memory_server: FakeMemoryServer, case: str) -> None:
    memory_server.hot.body = BAD_BODIES[case]
    memory_server.cold.body = BAD_BODIES[case]
    for branch in ("hot", "cold"):
        exc = await _error(memory_server, branch)
        assert "bad response shape" in str(exc) or "invalid JSON" in str(exc)


async def test_bad_item_detail_names_the_path(memory_server: FakeMemoryServer) -> None:
    memory_server.hot.body = BAD_BODIES["one bad item among good"]
    exc = await _error(memory_server)
    assert "$.data.results[2].memory.confidence" in str(exc)


async def test_non_uuid_id_detail_names_the_path_not_the_value(
    memory_server: FakeMemoryServer,
) -> None:
    memory_server.cold.body = _body(_item(1), _item(2, memory=_memory(2, id="not-a-uuid")))
    exc = await _error(memory_server, "cold")
    assert "id must be a canonical UUID - at `$.data.results[1].memory`" in str(exc)
    assert "not-a-uuid" not in str(exc)


async def test_upper_case_uuid_ids_are_accepted_verbatim(memory_server: FakeMemoryServer) -> None:
    upper = _memory(1)["id"].upper().replace("0", "A")
    memory_server.hot.body = _body(_item(1, memory=_memory(1, id=upper)))
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            hits = await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)
    assert [h.memory_id for h in hits] == [upper]


@pytest.mark.parametrize("status", [500, 503, 404, 302, 204])
async def test_non_2xx_or_empty_is_an_error(memory_server: FakeMemoryServer, status: int) -> None:
    memory_server.cold.status = status
    memory_server.cold.body = b"" if status == 204 else b'{"error": "boom"}'
    exc = await _error(memory_server, "cold")
    if status != 204:
        assert str(exc) == f"cold: HTTP {status}"
    assert memory_server.requests["cold"] == 1  # no retry, no redirect followed


async def test_malformed_json_is_an_error(memory_server: FakeMemoryServer) -> None:
    memory_server.hot.fault = "malformed"
    exc = await _error(memory_server)
    assert "invalid JSON" in str(exc)


async def test_wrong_token_is_an_error_and_never_echoed(memory_server: FakeMemoryServer) -> None:
    wrong = "wrong-token-do-not-leak-42"
    exc = await _error(memory_server, token=wrong)
    assert str(exc) == "hot: HTTP 401"
    assert wrong not in str(exc)
    assert memory_server.unauthorized == 1


async def test_reset_mid_response_is_an_error(memory_server: FakeMemoryServer) -> None:
    memory_server.add_memories(DEMO_ORG, DEMO_AGENT, make_memories(DEMO_ORG, DEMO_AGENT, 20))
    memory_server.cold.fault = "reset"
    exc = await _error(memory_server, "cold")
    assert "transport error" in str(exc)


async def test_oversize_response_is_an_error(memory_server: FakeMemoryServer) -> None:
    memory_server.add_memories(DEMO_ORG, DEMO_AGENT, make_memories(DEMO_ORG, DEMO_AGENT, 20))
    with trio.fail_after(CAP):
        async with MemoryHttpSource(
            memory_server.url, memory_server.token, max_response_bytes=1024
        ) as source:
            with pytest.raises(SourceError, match="larger than 1024 bytes"):
                await source.hot(DEMO_ORG, DEMO_AGENT, limit=20, min_confidence=0.0)


async def test_hang_is_cancelled_promptly_and_leaves_nothing(
    memory_server: FakeMemoryServer,
) -> None:
    memory_server.hot.fault = "hang"
    # keepalive_expiry caps the drain's wait (1 s by default) to keep the test short
    async with memory_server.source(keepalive_expiry=0.3) as source:
        start = trio.current_time()
        with trio.move_on_after(0.05) as scope:
            await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)
        elapsed = trio.current_time() - start
        assert scope.cancelled_caught
        assert elapsed < 2.0  # generous: real sockets, loaded CI
        stats = source.pool_stats()
        # the call returned at once; its connection drains, holding the call's slot
        assert (stats.in_use, stats.waiters, stats.idle) == (0, 0, 0)
        assert (stats.draining, stats.leases, stats.connections) == (1, 1, 1)
        # the hang outlasts the drain's time cap: then the connection is closed
        with trio.fail_after(CAP):
            while source.pool_stats().draining:  # noqa: ASYNC110 (a drain is no event)
                await trio.sleep(0.01)
        stats = source.pool_stats()
        assert (stats.in_use, stats.leases, stats.waiters) == (0, 0, 0)
        assert stats.connections == stats.idle == 0
        assert await memory_server.settle_open_connections(0) == 0
        # the same client still works afterwards
        memory_server.hot.fault = "none"
        with trio.fail_after(CAP):
            assert await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0) == []


async def test_transport_timeout_is_an_error(memory_server: FakeMemoryServer) -> None:
    memory_server.hot.latency_ms = 2000
    with trio.fail_after(CAP):
        async with MemoryHttpSource(
            memory_server.url, memory_server.token, transport_timeout=0.05
        ) as source:
            with pytest.raises(SourceError, match=r"^hot: transport timeout \(ReadTimeout\)$"):
                await source.hot(DEMO_ORG, DEMO_AGENT, limit=10, min_confidence=0.0)


async def test_connection_refused_is_an_error() -> None:
    with trio.fail_after(CAP):
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()  # nothing listens there now
        async with MemoryHttpSource(f"http://127.0.0.1:{port}", "t0ken-xyz") as source:
            with pytest.raises(SourceError, match=r"^cold: transport error \(ConnectError\)$"):
                await source.cold(DEMO_ORG, DEMO_AGENT, "q", limit=1, min_confidence=0.0)


async def test_base_url_path_prefix_is_kept(memory_server: FakeMemoryServer) -> None:
    with trio.fail_after(CAP):
        async with MemoryHttpSource(memory_server.url + "/prefix/", memory_server.token) as src:
            with pytest.raises(SourceError, match="HTTP 404"):
                await src.hot(DEMO_ORG, DEMO_AGENT, limit=1, min_confidence=0.0)
    assert memory_server.seen[-1].path == "/prefix/v1/memories/hot"


async def test_lifecycle_and_settings() -> None:
    settings = replace_settings(
        Settings(),
        memory_base_url="http://127.0.0.1:1",
        memory_api_token="s3cr3t",
        memory_pool_size=3,
    )
    source = memory_http_source(settings)
    assert "s3cr3t" not in repr(source)
    with pytest.raises(RuntimeError, match="not open"):
        await source.hot(DEMO_ORG, DEMO_AGENT, limit=1, min_confidence=0.0)
    async with source:
        # A pool per branch (a cold call cut at the wall must not cost hot calls a
        # connect): MEMORY_POOL_SIZE connections each.
        assert source.pool_stats("hot").limit == source.pool_stats("cold").limit == 3
        assert source.pool_stats().limit == 6
        with pytest.raises(RuntimeError, match="already open"):
            await source.open()
    await source.aclose()  # idempotent
    with pytest.raises(ValueError, match="required"):
        memory_http_source(Settings())


async def test_use_from_an_asyncio_task_is_refused(memory_server: FakeMemoryServer) -> None:
    """Under trio-asyncio an asyncio task could reach the Trio-bound pool: refuse it."""
    async with memory_server.source() as source, trio_asyncio.open_loop():

        async def from_asyncio() -> object:
            return await source.hot(DEMO_ORG, DEMO_AGENT, limit=1, min_confidence=0.0)

        with pytest.raises(RuntimeError, match="Trio tasks only"):
            await trio_asyncio.aio_as_trio(from_asyncio)()
        # the pool is untouched and still serves Trio callers
        with trio.fail_after(CAP):
            assert await source.hot(DEMO_ORG, DEMO_AGENT, limit=1, min_confidence=0.0) == []
    assert memory_server.requests["hot"] == 1


def test_outside_trio_is_refused() -> None:
    source = MemoryHttpSource("http://127.0.0.1:1", "tok")
    coro = source.open()
    with pytest.raises(RuntimeError, match="Trio tasks only"):
        coro.send(None)
    coro.close()


async def test_decoded_hits_round_trip_as_msgspec(memory_server: FakeMemoryServer) -> None:
    memory_server.add_memories(DEMO_ORG, DEMO_AGENT, make_memories(DEMO_ORG, DEMO_AGENT, 3))
    with trio.fail_after(CAP):
        async with memory_server.source() as source:
            hits = await source.cold(DEMO_ORG, DEMO_AGENT, "q", limit=3, min_confidence=0.0)
    # frozen Structs that encode cleanly: nothing non-JSON slipped through
    assert len(msgspec.json.decode(msgspec.json.encode(hits))) == 3
