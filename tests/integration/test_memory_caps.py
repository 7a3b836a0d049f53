"""Oversized and hostile memory-service answers (issue 11 items 3 and 8), end to end.

Real redis-server, real loopback memory stand-in, the daemon's assembler:

- one memory of 4 MB: the branch succeeds, that memory is excluded `failed`
  (its content never reaches the pipeline), the others are used;
- 40,000 results when 20 were asked for: at most 20 reach the pipeline;
- a body over the response cap, or JSON nested 100,000 deep (from the memory
  service or from Redis): that branch is an error, never an escaped exception.
"""

from __future__ import annotations

import json
from typing import Any

from ibex.assembly.structs import AssemblyResult
from ibex.sources.redis_directive import directive_key
from ibex.testing.memory_server import (
    FakeMemoryServer,
    make_memories,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.redis_server import RedisServer
from tests.integration.test_assemble_real import (
    AGENT_A,
    LIMIT,
    ORG_A,
    RELAXED_TIMEOUTS,
    included_ids,
    make_request,
    open_stack,
    seed_directive,
    seed_tenant,
    statuses,
)

# Megabytes cross a loopback stand-in that shares the GIL with the test: give
# every branch plenty of time, these tests are about outcomes, not speed.
TIMEOUTS = {**RELAXED_TIMEOUTS} | {
    "DIRECTIVE_TIMEOUT_MS": "60s",
    "HOT_TIMEOUT_MS": "60s",
    "COLD_TIMEOUT_MS": "60s",
    "TIMEOUT": "90s",
    "DEADLINE_MS": "90s",
}
HUGE = 4_000_000  # bytes of one memory's content: the 4 MB memory
NESTED = b"[" * 100_000


def memory_statuses(result: AssemblyResult) -> dict[str, str]:
    """Hot and cold only: under a loaded machine Redis's 100 ms backstop may fire."""
    return {k: v for k, v in statuses(result).items() if k != "directive"}


def _tiny(i: int) -> dict[str, Any]:
    return {
        "id": f"00000000-0000-4000-9000-{i:012d}",
        "content": f"note {i}",
        "category": "factual",
        "confidence": 0.5,
    }


async def test_one_huge_memory_is_excluded_failed_and_the_branch_succeeds(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=11)
    huge = make_memories(ORG_A, AGENT_A, 1, seed=12)[0]
    huge["id"] = "00000000-0000-4000-9999-000000000001"
    huge["content"] = "H" * HUGE
    huge["confidence"] = 0.99  # first in the hot answer
    memory_server.add_memories(ORG_A, AGENT_A, [huge], similarities=[0.1])
    memory_server.hot.body = memory_server.results_body("hot", AGENT_A, limit=LIMIT)
    async with open_stack(redis_server, memory_server, TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert memory_statuses(result) == {"hot": "success", "cold": "success"}
    assert result.degradation_level == "L0"
    failed = [m for m in result.excluded if m.memory_id == huge["id"]]
    assert [m.exclusion for m in failed] == ["failed"]
    assert huge["id"] not in included_ids(result)
    assert "HHHHHHHH" not in result.assembled_context
    # the hot answer was the huge memory and the two most confident others
    assert len(included_ids(result) & data.hot_ids) == LIMIT - 1
    assert data.cold_ids <= included_ids(result)


async def test_forty_thousand_results_when_twenty_were_asked(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    memory_server.add_memories(ORG_A, AGENT_A, [_tiny(i) for i in range(40_000)])
    # A memory service that ignores `limit` (and the same 40,000 for both branches).
    body = memory_server.results_body("hot", AGENT_A, limit=40_000)
    memory_server.hot.body = memory_server.cold.body = body
    env = {
        **TIMEOUTS,
        "HOT_LIMIT": "20",
        "COLD_LIMIT": "20",
        "MEMORY_MAX_RESPONSE_BYTES": str(64 * 1024 * 1024),  # let the whole answer in
    }
    async with open_stack(redis_server, memory_server, env) as assembler:
        result = await assembler.assemble(make_request())
    assert memory_statuses(result) == {"hot": "success", "cold": "success"}
    hot = next(s for s in memory_server.seen if s.path == "/v1/memories/hot")
    assert hot.query["limit"] == ["20"]
    seen_ids = included_ids(result) | {m.memory_id for m in result.excluded}
    assert seen_ids <= {f"00000000-0000-4000-9000-{i:012d}" for i in range(40_000)}
    # hot and cold each took at most 20; both answers start with the same memories
    assert 0 < len(seen_ids) <= 40
    assert len(result.memories_used) + len(result.excluded) <= 40


async def test_an_answer_over_the_response_cap_is_a_branch_error(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    seed_directive(redis_server, "a")
    data = seed_tenant(memory_server, "a", seed=13)
    big = make_memories(ORG_A, AGENT_A, 1, seed=14)[0]
    big["content"] = "B" * (5 * 1024 * 1024)  # over the 4 MiB default
    body = {"data": {"results": [{"memory": big, "similarity": 0.9, "rank": 1, "source": "x"}]}}
    memory_server.hot.body = json.dumps(body).encode()
    async with open_stack(redis_server, memory_server, TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert memory_statuses(result) == {"hot": "error", "cold": "success"}
    hot = next(b for b in result.branches if b.source == "hot")
    assert "larger than 4194304 bytes" in hot.detail
    assert data.cold_ids <= included_ids(result)


async def test_deeply_nested_json_is_a_branch_error_on_every_source(
    redis_server: RedisServer, memory_server: FakeMemoryServer
) -> None:
    org, agent = ORG_A, AGENT_A
    redis_server.set(directive_key(org, agent), b'{"v": 1, "content": "x", "extra": ' + NESTED)
    memory_server.hot.body = b'{"data": {"results": []}, "extra": ' + NESTED
    memory_server.cold.body = b'{"data": {"results": [{"memory": ' + NESTED
    async with open_stack(redis_server, memory_server, TIMEOUTS) as assembler:
        result = await assembler.assemble(make_request())
    assert statuses(result) == {"directive": "error", "hot": "error", "cold": "error"}
    details = {b.source: b.detail for b in result.branches}
    assert "nested too deeply" in details["directive"]
    assert "nested too deeply" in details["hot"]
    assert "nested too deeply" in details["cold"]
