"""A call's directive is read as soon as the call is admitted, not after its own work.

Through the real gRPC socket, real redis-server and the fake memory service: a
call that waits for an assembly slot (held by a call whose cold branch is slow)
has its directive read while it waits, so its directive branch finds the entry
filled instead of starting the read behind the calls ahead of it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from ibex.sources.redis_directive import directive_key
from ibex.testing.grpc_harness import AGENT, ORG, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import FakeMemoryServer, make_memories, running_memory_server
from ibex.testing.redis_server import RedisServer

OTHER_AGENT = str(uuid.UUID(int=0x5B1A2C3D_0000_4000_8000_000000000001))
HOLD_MS = 3000.0  # how long the first call's cold branch keeps the only slot


@pytest.fixture
def memory() -> Iterator[FakeMemoryServer]:
    with running_memory_server() as server:
        for agent in (AGENT, OTHER_AGENT):
            server.add_memories(ORG, agent, make_memories(ORG, agent, 4))
        yield server


def request(agent: str) -> Any:
    return context_pb2.AssembleContextRequest(
        org_id=ORG, agent_id=agent, model="gpt-4o", query="deploy billing", request_id=agent
    )


def reads(redis_server: RedisServer) -> int:
    """GET and MGET calls redis-server has counted (since the last CONFIG RESETSTAT)."""
    total = 0
    for line in redis_server.command("INFO", "commandstats").decode().splitlines():
        if line.startswith(("cmdstat_get:", "cmdstat_mget:")):
            total += int(line.split("calls=")[1].split(",")[0])
    return total


async def test_a_call_waiting_for_its_slot_has_its_directive_read_meanwhile(
    memory: FakeMemoryServer, redis_server: RedisServer
) -> None:
    for agent in (AGENT, OTHER_AGENT):
        envelope = {"v": 1, "content": f"directive of {agent}", "version_id": None}
        redis_server.set(directive_key(ORG, agent), json.dumps(envelope))
    settings = dict(
        redis_url=redis_server.url,
        memory_base_url=memory.url,
        memory_api_token=memory.token,
        max_concurrent_assemblies=1,
        max_queue_wait=10.0,
        timeout=10.0,
        deadline=10.0,
        directive_timeout=10.0,
        hot_timeout=10.0,
        cold_timeout=10.0,
    )
    async with running_daemon(**settings) as d:
        with d.channel() as channel:
            stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
            memory.cold.latency_ms = HOLD_MS
            first = stub.AssembleContext.future(request(AGENT), timeout=20)
            with trio.fail_after(5):  # the first call holds the slot, all three reads sent
                while (  # noqa: ASYNC110  (counts of server threads and of redis-server)
                    memory.requests["cold"] < 1
                    or memory.requests["hot"] < 1
                    or reads(redis_server) < 1
                ):
                    await trio.sleep(0.005)
            redis_server.command("CONFIG", "RESETSTAT")
            second = stub.AssembleContext.future(request(OTHER_AGENT), timeout=20)
            with trio.fail_after(5):
                while reads(redis_server) < 1:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            # Read while the first call still holds the only slot: the second has not
            # started its retrieval (one hot request so far, the first call's).
            assert not first.done()
            assert memory.requests["hot"] == 1
            answers = [await in_thread(f.result) for f in (first, second)]
    for agent, answer in zip((AGENT, OTHER_AGENT), answers, strict=True):
        directive = next(b for b in answer.branches if b.source == "directive")
        assert directive.status == "success"
        assert f"directive of {agent}" in answer.assembled_context
