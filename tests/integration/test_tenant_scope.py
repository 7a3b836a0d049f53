"""Tenant scope enforced by the daemon: tokens bound to orgs, a required principal, and the
per-org fairness cap keyed on a bound caller's scope (docs/security.md, "Tenant scope").

The real daemon on a loopback gRPC socket, the stock grpcio client, and the memory
stand-in serving two orgs (it searches by agent and leaves out of feedback updates the
ids that are unknown or of another org, as the contract says the memory service does).
Without the daemon's own check, a token meant for one org read and scored the other's
memories: these tests hold the answers the docs promise instead.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trio
import trio_asyncio
from google.protobuf.timestamp_pb2 import Timestamp
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from ibex import wire
from ibex.client import ContextClient
from ibex.testing.grpc_harness import AGENT, ORG, RunningDaemon, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc, principal_context_pb2
from ibex.testing.memory_server import (
    Endpoint,
    FakeMemoryServer,
    make_memories,
    running_memory_server,
)

BOUND = "token-of-org-a-only-0123456789"  # bound to ORG by AUTH_TOKEN_ORGS
PROXY = "proxy-token-not-listed-98765"  # not listed: acts for any org
ORG_B = "00000000-0000-4000-8000-0000000000b0"
AGENT_B = "00000000-0000-4000-8000-0000000000b1"
ORG_C = "00000000-0000-4000-8000-0000000000c0"
UNKNOWN_ID = "10000000-0000-4000-8000-0000000000ff"
MEMORIES_A = make_memories(ORG, AGENT, 3, seed=11)
MEMORY_B = make_memories(ORG_B, AGENT_B, 1, seed=12)[0]
# docs/api.md, "Tenant scope": the words of every refusal for an org outside the scope.
OUT_OF_SCOPE = "the authenticated caller may not act for this org_id"
DENIED = grpc.StatusCode.PERMISSION_DENIED


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
def memory() -> Iterator[FakeMemoryServer]:
    with running_memory_server() as server:
        server.add_memories(ORG, AGENT, MEMORIES_A)
        server.add_memories(ORG_B, AGENT_B, [MEMORY_B])
        yield server


def scoped(memory: FakeMemoryServer, orgs: tuple[str, ...] = (ORG,), **overrides: Any) -> Any:
    """A daemon accepting BOUND (bound to `orgs`) and PROXY (not listed)."""
    return running_daemon(
        memory_base_url=memory.url,
        memory_api_token=memory.token,
        auth_tokens_sha256=(sha256(BOUND), sha256(PROXY)),
        auth_token_orgs=((sha256(BOUND), orgs),),
        **overrides,
    )


def principal(org_id: str = ORG, agent_id: str = AGENT) -> Any:
    now = int(time.time())
    return principal_context_pb2.PrincipalContext(
        org_id=org_id,
        agent_id=agent_id,
        principal_id="user-1",
        principal_type="user",
        issued_at=Timestamp(seconds=now - 60),
        expires_at=Timestamp(seconds=now + 300),
    )


def assemble(org_id: str = ORG, agent_id: str = AGENT, **fields: Any) -> Any:
    return context_pb2.AssembleContextRequest(
        org_id=org_id, agent_id=agent_id, model="gpt-4o", query="deploy billing", **fields
    )


def search(org_id: str = ORG, agent_id: str = AGENT, **fields: Any) -> Any:
    return context_pb2.SearchMemoriesRequest(
        org_id=org_id, agent_id=agent_id, query="deploy", limit=10, **fields
    )


def feedback(org_id: str = ORG, ids: tuple[str, ...] = (), **fields: Any) -> Any:
    return context_pb2.RecordMemoryFeedbackRequest(
        org_id=org_id,
        memory_ids=list(ids or (MEMORIES_A[0]["id"],)),
        feedback="negative",
        session_id=fields.pop("session_id", "sess-1"),
        **fields,
    )


METHOD = {
    "AssembleContextRequest": "AssembleContext",
    "SearchMemoriesRequest": "SearchMemories",
    "RecordMemoryFeedbackRequest": "RecordMemoryFeedback",
}


def call(daemon: RunningDaemon, req: Any, token: str, deadline: float = 5.0) -> Any:
    with daemon.channel() as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        method = getattr(stub, METHOD[type(req).__name__])
        return method(req, timeout=deadline, metadata=[("authorization", f"Bearer {token}")])


async def answer(
    daemon: RunningDaemon, req: Any, token: str = BOUND, deadline: float = 5.0
) -> tuple[grpc.StatusCode, str, Any]:
    """(status, details, response or None): what the caller learns from one call with
    a gRPC `deadline` (seconds)."""
    try:
        response = await in_thread(call, daemon, req, token, deadline)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None
    return grpc.StatusCode.OK, "", response


def memory_calls(memory: FakeMemoryServer) -> int:
    return sum(memory.requests[name] for name in ("hot", "cold", "feedback"))


async def test_a_token_bound_to_one_org_is_refused_for_another_on_every_rpc(
    memory: FakeMemoryServer,
) -> None:
    async with scoped(memory) as daemon:
        before = memory_calls(memory)
        for req in (
            assemble(ORG_B, AGENT_B),
            search(ORG_B, AGENT_B),
            feedback(ORG_B, (MEMORY_B["id"],)),
            # Another spelling of the same UUID is the same org: still out of scope.
            assemble(ORG_B.upper(), AGENT_B),
        ):
            code, details, _ = await answer(daemon, req)
            assert (code, details) == (DENIED, OUT_OF_SCOPE), type(req).__name__
        # Refused before any I/O: nothing of org B was read or scored.
        assert memory_calls(memory) == before
        assert memory.usefulness(ORG_B, MEMORY_B["id"]) == MEMORY_B["usefulness"]

        sample = daemon.daemon.metrics.registry.get_sample_value
        assert sample("ibex_feedback_total", {"outcome": "denied"}) == 1

        # Its own org is served, in any spelling of its UUID.
        for req in (assemble(), search(), feedback(), assemble(ORG.upper())):
            assert (await answer(daemon, req))[0] == grpc.StatusCode.OK, type(req).__name__


async def test_a_token_not_listed_still_acts_for_any_org(memory: FakeMemoryServer) -> None:
    async with scoped(memory) as daemon:
        code, _, found = await answer(daemon, search(ORG_B, AGENT_B), token=PROXY)
        assert code == grpc.StatusCode.OK
        assert [m.id for m in found.memories] == [MEMORY_B["id"]]
        code, _, result = await answer(daemon, assemble(ORG_B, AGENT_B), token=PROXY)
        assert code == grpc.StatusCode.OK and MEMORY_B["id"] in {
            m.memory_id for m in result.memories_used
        }
        code, _, fb = await answer(daemon, feedback(ORG_B, (MEMORY_B["id"],)), token=PROXY)
        assert code == grpc.StatusCode.OK and [u.memory_id for u in fb.updates] == [MEMORY_B["id"]]


async def test_feedback_on_an_unknown_id_answers_as_on_another_orgs_id(
    memory: FakeMemoryServer,
) -> None:
    """The answer, status and message never tell whether an id exists in an org the caller
    may not act for, and a new session_id (a new idempotency key) does not change that."""
    async with scoped(memory) as daemon:
        before = memory.requests["feedback"]
        # Named as org B's: refused alike, before the memory service is asked.
        outside = [
            await answer(daemon, feedback(ORG_B, (memory_id,), session_id=f"sess-{i}"))
            for i, memory_id in enumerate((MEMORY_B["id"], UNKNOWN_ID, MEMORY_B["id"]))
        ]
        assert outside == [(DENIED, OUT_OF_SCOPE, None)] * 3
        assert memory.requests["feedback"] == before

        # Named as the caller's own org: both ids are left out of the updates alike.
        inside = []
        for i, memory_id in enumerate((MEMORY_B["id"], UNKNOWN_ID)):
            code, details, response = await answer(
                daemon, feedback(ORG, (memory_id,), session_id=f"own-{i}")
            )
            inside.append((code, details, response.success, list(response.updates)))
        assert inside == [(grpc.StatusCode.OK, "", True, [])] * 2
        assert memory.usefulness(ORG_B, MEMORY_B["id"]) == MEMORY_B["usefulness"]


async def test_require_principal_refuses_calls_without_a_matching_one(
    memory: FakeMemoryServer,
) -> None:
    async with scoped(memory, require_principal=True) as daemon:
        before = memory_calls(memory)
        for req in (assemble(), search(), feedback()):
            code, details, _ = await answer(daemon, req, token=PROXY)
            assert (code, details) == (DENIED, "principal_context is required")
        # A principal for another org (or agent) does not bind the request.
        mismatched = (
            search(principal_context=principal(org_id=ORG_B)),
            search(principal_context=principal(agent_id=AGENT_B)),
            feedback(principal_context=principal(org_id=ORG_B)),
        )
        for req in mismatched:
            code, details, _ = await answer(daemon, req, token=PROXY)
            assert code == DENIED and "principal_context" in details
            assert ORG_B not in details and AGENT_B not in details
        assert memory_calls(memory) == before

        # Feedback names no agent: an org-wide principal and an agent's both bind it.
        matching = (
            assemble(principal_context=principal()),
            search(principal_context=principal()),
            search(principal_context=principal(agent_id="")),
            feedback(principal_context=principal()),
            feedback(principal_context=principal(agent_id="")),
        )
        for req in matching:
            assert (await answer(daemon, req, token=PROXY))[0] == grpc.StatusCode.OK
        # The scope still applies with a principal: one for org B does not widen BOUND's.
        req = assemble(ORG_B, AGENT_B, principal_context=principal(ORG_B, AGENT_B))
        assert (await answer(daemon, req))[:2] == (DENIED, OUT_OF_SCOPE)


async def test_a_principal_on_search_and_feedback_is_checked_without_the_requirement(
    memory: FakeMemoryServer,
) -> None:
    async with scoped(memory) as daemon:
        for req in (
            search(principal_context=principal(org_id=ORG_B)),
            feedback(principal_context=principal(org_id=ORG_B)),
        ):
            code, details, _ = await answer(daemon, req, token=PROXY)
            assert code == DENIED and "principal_context" in details
        assert (await answer(daemon, search(), token=PROXY))[0] == grpc.StatusCode.OK


async def test_rotating_org_ids_under_one_bound_token_shares_one_fairness_cap(
    memory: FakeMemoryServer,
) -> None:
    """One org may run one assembly at a time here. A token bound to orgs A, B and C runs
    one in A (its cold search hangs, so it holds its slot); naming B or C instead does not
    buy it another slot, while the unlisted proxy token's call for B is served at once."""
    memory.cold.then = deque([Endpoint(fault="hang")])
    async with scoped(
        memory,
        orgs=(ORG, ORG_B, ORG_C),
        max_concurrent_assemblies=4,
        max_org_assemblies=1,
        # A refused wait ends this long before the caller's deadline, so the refusal
        # reaches the caller before its own deadline does, however busy the machine.
        min_answer=0.5,
        timeout=3.0,
        deadline=3.0,
        cold_timeout=3.0,
    ) as daemon:
        held: dict[str, Any] = {}

        async def hold() -> None:
            held["answer"] = await answer(daemon, assemble(), deadline=20.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            with trio.fail_after(15):
                # The first call is in its slot once its search arrives (a server thread
                # counts it: no event to wait on).
                while memory.requests["cold"] < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            rotated: dict[str, tuple[grpc.StatusCode, str, Any]] = {}

            async def rotate(org: str, agent: str) -> None:
                rotated[org] = await answer(daemon, assemble(org, agent), deadline=1.5)

            async with trio.open_nursery() as calls:
                calls.start_soon(rotate, ORG_B, AGENT_B)
                calls.start_soon(rotate, ORG_C, AGENT)
                proxy = await answer(daemon, assemble(ORG_B, AGENT_B), token=PROXY)
            assert proxy[0] == grpc.StatusCode.OK
            for org in (ORG_B, ORG_C):
                code, details, _ = rotated[org]
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, org
                assert "limit of 1 concurrent assemblies" in details
        assert held["answer"][0] == grpc.StatusCode.OK  # degraded (cold timed out), served
        sample = daemon.daemon.metrics.registry.get_sample_value
        assert sample("ibex_shed_requests_total", {"reason": "org"}) == 2


async def test_the_python_client_sends_a_principal_on_search_and_feedback(
    memory: FakeMemoryServer,
) -> None:
    now = int(time.time())
    bound = wire.PrincipalContext(org_id=ORG, agent_id=AGENT, expires_at={"seconds": now + 300})
    async with scoped(memory, require_principal=True) as daemon, trio_asyncio.open_loop():
        client = ContextClient("127.0.0.1", daemon.port, token=PROXY, deadline=5.0)
        try:
            found = await client.search_trio(
                org_id=ORG, agent_id=AGENT, query="deploy", principal_context=bound
            )
            assert len(found.memories) == len(MEMORIES_A)
            fb = await client.record_feedback_trio(
                [MEMORIES_A[0]["id"]], "positive", org_id=ORG, principal_context=bound
            )
            assert fb.success is True
            with pytest.raises(GRPCError) as info:
                await client.record_feedback_trio([MEMORIES_A[0]["id"]], "positive", org_id=ORG)
            assert info.value.status == Status.PERMISSION_DENIED
        finally:
            client.close()
