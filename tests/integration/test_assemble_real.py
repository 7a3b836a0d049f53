"""`Assembler.assemble` end to end against a real redis-server and a real HTTP memory fake.

Nothing is mocked: the directive comes from Redis through trio-asyncio, the
memories from a loopback HTTP server through the HTTP pool, and the result is the
pipeline's formatted text. Branch timeouts here are generous (seconds), so
these tests are about outcomes and content, not time; the timing cases live
in tests/chaos/test_assembly_chaos.py, which reuses this module's harness.

The dataset is built so each memory branch is visible in the text: the hot
endpoint returns the most confident memories and the cold endpoint the most
similar ones, so with small limits "hot" and "cold" memories are disjoint
sets and a missing branch shows up as missing ids.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio
import trio_asyncio

from ibex.assembly.catalog import Catalog
from ibex.assembly.structs import AssemblyOptions, AssemblyRequest, AssemblyResult, Message
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.xml_format import escape_body
from ibex.config import Settings, load_settings
from ibex.service.root import Assembler, load_static, open_assembler
from ibex.sources.redis_directive import directive_key
from ibex.testing.memory_server import (
    FakeMemoryServer,
    make_memories,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.redis_server import RedisServer

ORG_A = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
AGENT_A = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
ORG_B = "9d2c6a0e-1f7b-4c8e-8a3d-5e4f6a7b8c9d"
AGENT_B = "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d"
TENANTS = {"a": (ORG_A, AGENT_A), "b": (ORG_B, AGENT_B)}

LIMIT = 3  # hot and cold limit: HOT_SET and COLD_SET below are exactly this big
POOL_SIZE = 4
HISTORY = (
    Message("user", "Our billing deploy failed last night."),
    Message("assistant", "Which environment was it, staging or production?"),
)

# Outcome tests: every branch gets seconds, so only faults decide the statuses.
RELAXED_TIMEOUTS = {
    "DIRECTIVE_TIMEOUT_MS": "2s",
    "HOT_TIMEOUT_MS": "2s",
    "COLD_TIMEOUT_MS": "2s",
    "TIMEOUT": "3s",
    "DEADLINE_MS": "3s",
}


def directive_text(tenant: str) -> str:
    return f"Directive of tenant {tenant}: answer briefly and cite the runbook."


class Dataset(msgspec.Struct, frozen=True):
    """The memory ids one tenant's hot and cold endpoints answer with."""

    hot_ids: frozenset[str]
    cold_ids: frozenset[str]
    filler_ids: frozenset[str]

    @property
    def expected_ids(self) -> frozenset[str]:
        return self.hot_ids | self.cold_ids


def seed_tenant(server: FakeMemoryServer, tenant: str, *, seed: int) -> Dataset:
    """Three confident-but-dissimilar, three similar-but-unsure and four middling memories."""
    org, agent = TENANTS[tenant]
    memories = make_memories(org, agent, 3 * LIMIT + 1, seed=seed)
    hot, cold, filler = memories[:LIMIT], memories[LIMIT : 2 * LIMIT], memories[2 * LIMIT :]
    for i, m in enumerate(hot):
        m["confidence"] = 0.97 - i * 0.01
    for m in cold:
        m["confidence"] = 0.31
    for m in filler:
        m["confidence"] = 0.6
    sims = [0.2] * LIMIT + [0.97 - i * 0.01 for i in range(LIMIT)] + [0.5] * len(filler)
    server.add_memories(org, agent, hot + cold + filler, similarities=sims)
    return Dataset(
        hot_ids=frozenset(m["id"] for m in hot),
        cold_ids=frozenset(m["id"] for m in cold),
        filler_ids=frozenset(m["id"] for m in filler),
    )


def seed_directive(redis: RedisServer, tenant: str) -> None:
    org, agent = TENANTS[tenant]
    envelope = {
        "v": 1,
        "content": directive_text(tenant),
        "injection_mode": "system_first",
        "version_id": None,
    }
    redis.set(directive_key(org, agent), json.dumps(envelope))


def make_settings(
    redis_url: str, memory_url: str, token: str, timeouts: Mapping[str, str]
) -> Settings:
    env = {
        "REDIS_URL": redis_url,
        "MEMORY_BASE_URL": memory_url,
        "MEMORY_API_TOKEN": token,
        "MEMORY_POOL_SIZE": str(POOL_SIZE),
        "HOT_LIMIT": str(LIMIT),
        "COLD_LIMIT": str(LIMIT),
        # These tests hold the Redis path to its contract on every call; the directive
        # cache in front of it has tests of its own (test_directive_cache_*).
        "DIRECTIVE_CACHE_ENTRIES": "0",
        **timeouts,
    }
    return load_settings({f"IBEX_CONTEXT_{k}": v for k, v in env.items()})


@functools.cache
def static_parts() -> tuple[Catalog, Tokenizers]:
    """Catalog and verified tokenizers take most of a second to load: once per session."""
    return load_static(Settings())


@asynccontextmanager
async def open_stack(
    redis: RedisServer, memory: FakeMemoryServer, timeouts: Mapping[str, str]
) -> AsyncIterator[Assembler]:
    """The daemon's shape: a trio-asyncio loop around an assembler with both real sources."""
    settings = make_settings(redis.url, memory.url, memory.token, timeouts)
    catalog, tokenizers = static_parts()
    async with (
        trio_asyncio.open_loop(),
        open_assembler(settings, catalog=catalog, tokenizers=tokenizers) as assembler,
    ):
        yield assembler


def make_request(tenant: str = "a", **options: Any) -> AssemblyRequest:
    org, agent = TENANTS[tenant]
    return AssemblyRequest(
        agent_id=agent,
        org_id=org,
        query="How do I deploy the billing service?",
        model="gpt-4o",
        recent_messages=HISTORY,
        options=AssemblyOptions(**options),
        request_id=f"req-{tenant}",
    )


def statuses(result: AssemblyResult) -> dict[str, str]:
    return {b.source: b.status for b in result.branches}


def included_ids(result: AssemblyResult) -> set[str]:
    return {m.memory_id for m in result.memories_used}


def ids_in_text(result: AssemblyResult, ids: Iterable[str]) -> set[str]:
    return {i for i in ids if f'id="{i}"' in result.assembled_context}


def has_directive(result: AssemblyResult, tenant: str) -> bool:
    return escape_body(directive_text(tenant)) in result.assembled_context


def history_present(result: AssemblyResult) -> bool:
    return all(escape_body(m.content) in result.assembled_context for m in HISTORY)


def assert_full(result: AssemblyResult, tenant: str, data: Dataset) -> None:
    """L0: every branch succeeded and every expected memory reached the text."""
    assert statuses(result) == {"directive": "success", "hot": "success", "cold": "success"}
    assert result.degradation_level == "L0"
    assert has_directive(result, tenant)
    assert history_present(result)
    assert ids_in_text(result, data.expected_ids) == data.expected_ids
    assert included_ids(result) == set(data.expected_ids)


def bad_item_body(good: Mapping[str, Any]) -> bytes:
    """One valid result and one whose confidence is outside [0, 1]."""
    bad_memory = {**good, "id": "bad-item-0001", "content": "BAD ITEM TEXT", "confidence": 1.5}
    results = [
        {"memory": dict(good), "similarity": 0.9, "rank": 1, "source": "cache"},
        {"memory": bad_memory, "similarity": 0.8, "rank": 2, "source": "cache"},
    ]
    return json.dumps({"data": {"results": results}}).encode()


# -- tests ---------------------------------------------------------------------


async def test_full_assembly_is_l0_with_directive_hot_and_cold(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=1)
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert_full(result, "a", data)
    assert not ids_in_text(result, data.filler_ids)  # beyond both limits
    assert result.tokens_used <= result.budget.ceiling
    assert result.request_id == "req-a"
    seen = {s.path: s for s in memory_server.seen}
    assert seen["/v1/memories/hot"].headers["authorization"] == f"Bearer {memory_server.token}"
    assert json.loads(seen["/v1/memories/search"].body)["query"] == make_request().query


async def test_wrong_tenant_items_are_filtered_never_emitted(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    seed_tenant(memory_server, "a", seed=2)
    foreign = make_memories(ORG_B, AGENT_B, 2, seed=3)
    for m in foreign:
        m["confidence"] = 1.0  # top of both endpoints' answers
    # A confused memory service serves tenant B's memories to tenant A's agent.
    memory_server.add_memories(ORG_B, AGENT_B, foreign, similarities=[0.999] * 2, served_to=AGENT_A)
    foreign_ids = {m["id"] for m in foreign}
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "success", "cold": "success"}
    assert result.degradation_level == "L0"
    # Counted, never named: no id, category or score of another tenant's hit.
    assert result.pack.tenant_filtered == 2 * len(foreign)  # served by hot and by cold
    assert not foreign_ids & {m.memory_id for m in result.excluded}
    assert not foreign_ids & included_ids(result)
    assert not ids_in_text(result, foreign_ids)
    for m in foreign:
        assert escape_body(m["content"]) not in result.assembled_context
    assert included_ids(result)  # the legitimate memories are still there


async def test_one_bad_item_fails_its_branch_and_keeps_the_others(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=4)
    good = make_memories(ORG_A, AGENT_A, 1, seed=5)[0]
    memory_server.hot.body = bad_item_body(good)
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "error", "cold": "success"}
    assert result.degradation_level == "L1"
    hot = result.branches[1]
    assert "bad response shape" in hot.detail
    assert "BAD ITEM TEXT" not in hot.detail
    # neither the bad item nor its valid sibling became a memory
    assert {"bad-item-0001", good["id"]}.isdisjoint(included_ids(result))
    assert "BAD ITEM TEXT" not in result.assembled_context
    assert ids_in_text(result, data.cold_ids) == data.cold_ids
    assert has_directive(result, "a")


async def test_hot_500_is_an_error_and_level_l1(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=6)
    memory_server.hot.status = 500
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "error", "cold": "success"}
    assert result.branches[1].detail == "hot: HTTP 500"
    assert result.degradation_level == "L1"
    assert included_ids(result) == set(data.cold_ids)
    assert has_directive(result, "a")


async def test_both_memory_endpoints_failing_is_l2_with_directive_and_history(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    seed_tenant(memory_server, "a", seed=7)
    memory_server.hot.status = 503
    memory_server.cold.fault = "malformed"
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "error", "cold": "error"}
    assert result.degradation_level == "L2"
    assert result.memories_used == ()
    assert 'id="' not in result.assembled_context
    assert has_directive(result, "a")
    assert history_present(result)
    assert result.tokens_used <= result.budget.ceiling


async def test_missing_directive_key_is_success_without_a_directive_section(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    data = seed_tenant(memory_server, "a", seed=8)
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "success", "cold": "success"}
    assert result.degradation_level == "L0"
    assert "<directive" not in result.assembled_context
    assert result.directive_version_id == ""
    assert included_ids(result) == set(data.expected_ids)


async def test_malformed_directive_json_is_a_directive_error(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    data = seed_tenant(memory_server, "a", seed=9)
    redis_server.set(directive_key(ORG_A, AGENT_A), b'{"v": 1, "content": "half a direct')
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "error", "hot": "success", "cold": "success"}
    assert "malformed" in result.branches[0].detail
    assert "half a direct" not in result.branches[0].detail
    assert "<directive" not in result.assembled_context
    assert result.degradation_level == "L0"  # levels count memory sources only
    assert included_ids(result) == set(data.expected_ids)


async def test_skip_hot_memories_sends_no_hot_request(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=10)
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request(skip_hot_memories=True))
    assert statuses(result) == {"directive": "success", "hot": "skipped", "cold": "success"}
    assert result.degradation_level == "L0"  # skipped on request is not missing
    assert memory_server.requests["hot"] == 0
    assert memory_server.requests["cold"] == 1
    assert included_ids(result) == set(data.cold_ids)
    assert has_directive(result, "a")


async def test_directive_cache_answers_a_known_version_without_redis(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    """With the caller's directive_version_id, the second answer needs no Redis GET; a
    version the cache does not hold goes to Redis; another tenant never gets the entry."""
    org, agent = TENANTS["a"]
    version = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
    redis_server.set(
        directive_key(org, agent),
        json.dumps({"v": 1, "content": directive_text("a"), "version_id": version}),
    )
    seed_directive(redis_server, "b")

    def gets() -> int:
        stats = redis_server.command("INFO", "commandstats").decode()
        line = next((x for x in stats.splitlines() if x.startswith("cmdstat_get:")), "")
        return int(line.split("calls=")[1].split(",")[0]) if line else 0

    caching = {
        "DIRECTIVE_CACHE_ENTRIES": "100",
        "DIRECTIVE_CACHE_TTL": "0.05s",
        "DIRECTIVE_TIMEOUT_MS": "500",
        "TIMEOUT": "1s",
        "DEADLINE_MS": "1000",
    }
    async with open_stack(redis_server, memory_server, caching) as assembler:
        req = msgspec.structs.replace(make_request("a"), directive_version_id=version)
        first = await assembler.assemble(req)
        before = gets()
        second = await assembler.assemble(req)
        assert gets() == before
        assert first.branches[0].detail == "" and second.branches[0].detail == "cache"
        assert has_directive(second, "a") and second.directive_version_id == version
        other = await assembler.assemble(make_request("b"))
        assert has_directive(other, "b") and not has_directive(other, "a")
        newer = msgspec.structs.replace(
            req, directive_version_id="6ba7b810-9dad-11d1-80b4-00c04fd430c8"
        )
        third = await assembler.assemble(newer)
        assert gets() == before + 2  # tenant b's first lookup and the unknown version
        assert "cached, 6ba7b810" in third.branches[0].detail


async def test_a_memory_id_that_is_not_a_uuid_fails_both_memory_branches(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    """Contract section 2: ids are UUIDs and a malformed item is an `error` of its branch."""
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=6)
    odd = make_memories(ORG_A, AGENT_A, 1, seed=7)[0]
    odd.update(id="not-a-uuid", content="NOT A UUID TEXT", confidence=1.0)
    # Top of both endpoints' answers, so hot and cold each return it within their limit.
    memory_server.add_memories(ORG_A, AGENT_A, [odd], similarities=[0.999])
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "success", "hot": "error", "cold": "error"}
    assert result.degradation_level == "L2"
    for branch in result.branches[1:]:
        assert "id must be a canonical UUID - at `$.data.results[0].memory`" in branch.detail
        assert "not-a-uuid" not in branch.detail
    assert "NOT A UUID TEXT" not in result.assembled_context
    assert not included_ids(result) and not ids_in_text(result, data.expected_ids | {"not-a-uuid"})
    assert has_directive(result, "a") and history_present(result)


def pool_clients(redis: RedisServer) -> int:
    """Connections Redis holds other than the one asking (CLIENT LIST, one line each)."""
    return len(redis.command("CLIENT", "LIST").strip().splitlines()) - 1


async def test_the_redis_probe_leaves_a_warmed_connection_for_a_read_meanwhile(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    """Start-up warms two Redis connections; the liveness probe while serving holds one,
    so a read started while it runs takes the other instead of connecting on its path."""
    seed_directive(redis_server, "a")
    org, agent = TENANTS["a"]
    async with open_stack(redis_server, memory_server, RELAXED_TIMEOUTS) as assembler:
        (redis_dep,) = [d for d in assembler.dependencies if d.name == "redis"]
        assert redis_dep.check is not None
        await redis_dep.warm()
        assert pool_clients(redis_server) == 2
        source = assembler.directive_source
        assert source is not None
        for _ in range(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(redis_dep.check)
                nursery.start_soon(source.get_directive, org, agent, "")
        assert pool_clients(redis_server) == 2
