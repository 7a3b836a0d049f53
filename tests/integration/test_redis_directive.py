"""RedisDirectiveSource against a real redis-server (contract section 3)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
import trio
import trio_asyncio

from ibex.assembly.structs import Directive
from ibex.sources.base import Answer, DirectiveSource, SourceError
from ibex.sources.directive_cache import DirectiveCache, DirectiveCacheConfig
from ibex.sources.redis_directive import RedisDirectiveSource, RedisOptions, directive_key
from ibex.testing.redis_server import RedisServer

ORG = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
AGENT = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
VERSION = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
KEY = f"{ORG}:directive:{AGENT}"
SECRET_TEXT = "top-secret directive text"


@pytest.fixture
async def source(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> AsyncIterator[RedisDirectiveSource]:
    src = RedisDirectiveSource(redis_server.url)
    try:
        yield src
    finally:
        await src.aclose()


def envelope(**overrides: object) -> str:
    value: dict[str, object] = {
        "v": 1,
        "content": SECRET_TEXT,
        "injection_mode": "system_append",
        "version_id": VERSION,
    }
    value.update(overrides)
    return json.dumps(value)


def test_implements_the_directive_source_protocol() -> None:
    src: DirectiveSource = RedisDirectiveSource("redis://127.0.0.1:1/0")
    assert isinstance(src, RedisDirectiveSource)


def test_key_uses_lower_case_canonical_uuids() -> None:
    assert directive_key(ORG.upper(), AGENT.replace("-", "")) == KEY


def test_key_rejects_non_uuids() -> None:
    with pytest.raises(SourceError, match="UUID"):
        directive_key("org-1", AGENT)


def test_malformed_url_is_refused_without_echoing_it() -> None:
    with pytest.raises(SourceError) as info:
        RedisDirectiveSource("http://user:hunter2@example.invalid/0")
    assert "hunter2" not in str(info.value)


async def test_happy_path(redis_server: RedisServer, source: RedisDirectiveSource) -> None:
    redis_server.set(KEY, envelope())
    got = await source.get_directive(ORG, AGENT)
    assert got == Directive(content=SECRET_TEXT, injection_mode="system_append", version_id=VERSION)


async def test_ids_are_canonicalised_before_lookup(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    redis_server.set(KEY, envelope())
    got = await source.get_directive(ORG.upper(), AGENT.upper())
    assert got is not None
    assert got.content == SECRET_TEXT


async def test_null_version_id_and_every_known_mode(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    for mode in ("system_first", "system_append", "user_prepend"):
        redis_server.set(KEY, envelope(injection_mode=mode, version_id=None))
        assert await source.get_directive(ORG, AGENT) == Directive(
            content=SECRET_TEXT, injection_mode=mode, version_id=None
        )


async def test_missing_key_is_none(source: RedisDirectiveSource) -> None:
    assert await source.get_directive(ORG, AGENT) is None


async def test_unknown_injection_mode_falls_back_to_system_first(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    redis_server.set(KEY, envelope(injection_mode="system_sideways"))
    got = await source.get_directive(ORG, AGENT)
    assert got is not None
    assert got.injection_mode == "system_first"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param(envelope(v=2).encode(), "version 2", id="wrong-v"),
        pytest.param(envelope(v="1").encode(), r"\$\.v", id="v-as-string"),
        pytest.param(b"not json " + SECRET_TEXT.encode(), "JSON", id="non-json"),
        pytest.param(b"[1, 2]", "JSON", id="json-array"),
        pytest.param(envelope().encode().replace(b"top", b"\xff\xfe"), "UTF-8", id="non-utf8"),
        pytest.param(envelope(content=7).encode(), r"\$\.content", id="content-not-str"),
        pytest.param(envelope(injection_mode=1).encode(), "injection_mode", id="mode-not-str"),
        pytest.param(envelope(version_id=12).encode(), "version_id", id="version-id-not-str"),
        pytest.param(envelope(version_id="v7").encode(), "version_id", id="version-id-not-uuid"),
        pytest.param(json.dumps({"v": 1}).encode(), "content", id="content-missing"),
    ],
)  # fmt: skip
async def test_contract_violations_are_source_errors_without_content(
    redis_server: RedisServer, source: RedisDirectiveSource, value: bytes, reason: str
) -> None:
    redis_server.set(KEY, value)
    with pytest.raises(SourceError, match=reason) as info:
        await source.get_directive(ORG, AGENT)
    assert SECRET_TEXT not in str(info.value)
    assert len(str(info.value)) <= 160


async def test_wrong_redis_type_is_a_source_error(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    assert redis_server.command("HSET", KEY, "content", SECRET_TEXT) == b":1"
    with pytest.raises(SourceError, match="WRONGTYPE") as info:
        await source.get_directive(ORG, AGENT)
    assert SECRET_TEXT not in str(info.value)


async def test_oversize_value_is_a_source_error(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    redis_server.set(KEY, envelope(content="x" * 2000))
    src = RedisDirectiveSource(redis_server.url, RedisOptions(max_value_bytes=1000))
    try:
        with pytest.raises(SourceError, match="exceeds"):
            await src.get_directive(ORG, AGENT)
    finally:
        await src.aclose()


async def test_unix_socket_url(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    redis_server.set(KEY, envelope())
    src = RedisDirectiveSource(redis_server.unix_url)
    try:
        got = await src.get_directive(ORG, AGENT)
    finally:
        await src.aclose()
    assert got is not None
    assert got.content == SECRET_TEXT


async def test_tenants_get_their_own_directive_concurrently(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    # Isolation, not time, is under test: generous backstops so 60 concurrent first
    # connects on a loaded machine cannot turn into timeouts.
    source = RedisDirectiveSource(
        redis_server.url, RedisOptions(connect_timeout=5.0, socket_timeout=5.0)
    )
    tenants = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(20)]
    for org, agent in tenants:
        redis_server.set(directive_key(org, agent), envelope(content=f"for {org}/{agent}"))
    results: dict[tuple[str, str], Directive | None] = {}

    async def one(org: str, agent: str) -> None:
        results[org, agent] = await source.get_directive(org, agent)

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                for org, agent in tenants:
                    nursery.start_soon(one, org, agent)
    finally:
        await source.aclose()
    assert len(results) == len(tenants)
    for (org, agent), got in results.items():
        assert got is not None
        assert got.content == f"for {org}/{agent}"


async def test_aclose_disconnects_and_refuses_further_use(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    src = RedisDirectiveSource(redis_server.url)
    assert await src.get_directive(ORG, AGENT) is None
    assert b"ibex-directive" in redis_server.command("CLIENT", "LIST")
    await src.aclose()
    await src.aclose()  # idempotent
    for _ in range(200):  # the server notices the close asynchronously
        if b"ibex-directive" not in redis_server.command("CLIENT", "LIST"):
            break
        await trio.sleep(0.01)
    else:
        pytest.fail("the source's connection is still open after aclose()")
    with pytest.raises(SourceError, match="closed"):
        await src.get_directive(ORG, AGENT)


async def test_pool_exhaustion_is_a_source_error_not_a_wait(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    redis_server.set(KEY, envelope())
    # The first GET must still be waiting on the sleeping server when the second one
    # asks for a connection, however long a busy machine takes to get there: a long
    # sleep, timeouts longer still, and the second GET only once the first holds it.
    patient = RedisOptions(max_connections=1, connect_timeout=10.0, socket_timeout=10.0)
    src = RedisDirectiveSource(redis_server.url, patient)
    pool = src._reader.pool  # type: ignore[attr-defined]
    errors: list[str] = []

    async def one() -> None:
        try:
            await src.get_directive(ORG, AGENT)
        except SourceError as exc:
            errors.append(str(exc))

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(redis_server.debug_sleep, 1.0)
            nursery.start_soon(one)
            with trio.fail_after(5):
                while not pool._in_use_connections:  # noqa: ASYNC110 (redis-py has no event)
                    await trio.sleep(0.001)
            await one()
        assert errors == ["redis: connection pool exhausted"]
        assert await src.get_directive(ORG, AGENT) is not None
    finally:
        await src.aclose()


async def test_tls_url_verifies_the_server(
    redis_tls_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    redis_tls_server.set(KEY, envelope())
    # Verification, not time, is under test: a TLS handshake on a loaded machine can pass
    # the 100 ms production backstop, which would read as a timeout instead.
    slow_ok = RedisOptions(connect_timeout=5.0, socket_timeout=5.0)
    src = RedisDirectiveSource(
        redis_tls_server.tls_url, slow_ok, ssl_ca_certs=str(redis_tls_server.ca_path)
    )
    untrusted = RedisDirectiveSource(redis_tls_server.tls_url, slow_ok)
    try:
        got = await src.get_directive(ORG, AGENT)
        assert got is not None
        assert got.content == SECRET_TEXT
        with pytest.raises(SourceError, match="connection failed"):
            await untrusted.get_directive(ORG, AGENT)
    finally:
        await src.aclose()
        await untrusted.aclose()


async def test_a_revoked_directive_stops_being_served_after_the_cache_max_age(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    """Rotated v1 -> v2, then deleted: a caller still naming v1 gets it from the cache
    only until the entry's maximum age, then Redis (which no longer has it) answers."""
    v2 = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
    cache = DirectiveCache(source, DirectiveCacheConfig(ttl=0.05, max_age=0.3))
    redis_server.set(KEY, envelope())
    assert (await cache.fetch(ORG, AGENT, VERSION)).detail == ""
    redis_server.set(KEY, envelope(version_id=v2, content="rotated"))
    redis_server.command("DEL", KEY)
    served = await cache.fetch(ORG, AGENT, VERSION)  # within the max age: still the cache's
    assert served.detail == "cache" and served.value.content == SECRET_TEXT
    await trio.sleep(0.35)
    assert await cache.fetch(ORG, AGENT, VERSION) == Answer(None, "")


def read_commands(redis_server: RedisServer) -> dict[str, int]:
    """The GET and MGET calls redis-server has counted (INFO commandstats)."""
    counts = {"get": 0, "mget": 0}
    for line in redis_server.command("INFO", "commandstats").decode().splitlines():
        name, _, stats = line.partition(":")
        if name.removeprefix("cmdstat_") in counts:
            counts[name.removeprefix("cmdstat_")] = int(stats.split("calls=")[1].split(",")[0])
    return counts


async def test_five_agents_missing_together_cost_one_round_trip(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    """Five calls for five agents that miss the cache together are read with one MGET,
    and each gets its own agent's directive."""
    agents = [str(uuid.uuid4()) for _ in range(5)]
    for agent in agents:
        redis_server.set(directive_key(ORG, agent), envelope(content=f"for {agent}"))
    got: dict[str, Answer[Directive | None]] = {}

    async def one(cache: DirectiveCache, agent: str) -> None:
        got[agent] = await cache.fetch(ORG, agent, "")

    redis_server.command("CONFIG", "RESETSTAT")
    async with (
        DirectiveCache(source, DirectiveCacheConfig()) as cache,
        trio.open_nursery() as nursery,
    ):
        for agent in agents:
            nursery.start_soon(one, cache, agent)
    assert read_commands(redis_server) == {"get": 0, "mget": 1}
    for agent in agents:
        assert got[agent].value is not None and got[agent].value.content == f"for {agent}"


async def test_several_agents_in_one_read_each_get_their_own_answer(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    """One MGET: a directive, a missing key (no directive), a value that breaks the
    envelope (that agent's error alone, without its text), another directive."""
    agents = [str(uuid.uuid4()) for _ in range(4)]
    redis_server.set(directive_key(ORG, agents[0]), envelope(content="first"))
    redis_server.set(directive_key(ORG, agents[2]), "plain text, " + SECRET_TEXT)
    redis_server.set(directive_key(ORG, agents[3]), envelope(content="last"))
    redis_server.command("CONFIG", "RESETSTAT")
    got = await source.get_directives([(ORG, agent, "") for agent in agents])
    assert read_commands(redis_server) == {"get": 0, "mget": 1}
    assert [d.content if isinstance(d, Directive) else d for d in got[:2]] == ["first", None]
    assert isinstance(got[2], SourceError) and SECRET_TEXT not in str(got[2])
    assert isinstance(got[3], Directive) and got[3].content == "last"


async def test_a_batch_read_against_a_stopped_server_is_one_error_for_all(
    redis_server: RedisServer, source: RedisDirectiveSource
) -> None:
    redis_server.kill()
    with pytest.raises(SourceError, match=r"^redis: "):
        await source.get_directives([(ORG, AGENT, ""), (ORG, str(uuid.uuid4()), "")])
