"""A call whose cold branch hangs is answered at the wall, while the cut branch unwinds.

Real daemon on a real gRPC socket (grpcio client), the real memory stand-in with
its cold endpoint hanging. A first call is cut at the wall, so the next calls have
their answer made before it. The second call's cold branch has its unwinding held
(shielded) until the caller has its answer: the answer must arrive anyway, complete
and correct, and the call must still end after its branch has (the unwinding is
released and finishes before the daemon stops). No timing is asserted: `WAIT` only
bounds a step that never comes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.grpc_harness import AGENT, ORG, RunningDaemon, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import FakeMemoryServer, make_memories, running_memory_server

WAIT = 10.0  # seconds a step may take on a loaded machine
MEMORIES = make_memories(ORG, AGENT, 3, seed=5)


@pytest.fixture
def memory() -> Iterator[FakeMemoryServer]:
    with running_memory_server() as server:
        server.add_memories(ORG, AGENT, MEMORIES)
        server.cold.fault = "hang"
        yield server


def call(daemon: RunningDaemon) -> Any:
    with daemon.channel() as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        request = context_pb2.AssembleContextRequest(
            org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
        )
        return stub.AssembleContext(request, timeout=WAIT)


async def test_the_answer_leaves_at_the_wall_while_the_cut_branch_unwinds(
    memory: FakeMemoryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    answered = threading.Event()
    unwinding: list[str] = []
    real_cold = MemoryHttpSource.cold

    calls: list[str] = []

    async def held_cold(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("cold")
        held = len(calls) > 1  # the first call is cut as usual
        try:
            return await real_cold(self, *args, **kwargs)
        except trio.Cancelled:
            if not held:
                raise
            with trio.CancelScope(shield=True):
                unwinding.append("held")
                got = await trio.to_thread.run_sync(answered.wait, WAIT)
                unwinding.append("released" if got else "never answered")
            raise

    monkeypatch.setattr(MemoryHttpSource, "cold", held_cold)

    def call_then_release(daemon: RunningDaemon) -> Any:
        call(daemon)  # cut at the wall: calls are being cut now
        try:
            return call(daemon)
        finally:
            answered.set()

    async with running_daemon(
        memory_base_url=memory.url,
        memory_api_token=memory.token,
        timeout=0.3,
        deadline=0.3,
        hot_timeout=2.0,
        cold_timeout=2.0,
    ) as daemon:
        with trio.fail_after(3 * WAIT):
            response = await in_thread(call_then_release, daemon)
    assert calls == ["cold", "cold"]
    assert unwinding == ["held", "released"]
    statuses = {b.source: b.status for b in response.branches}
    assert statuses == {"directive": "skipped", "hot": "success", "cold": "timeout"}
    assert response.degradation_level == "L1"
    assert {m.memory_id for m in response.memories_used} == {m["id"] for m in MEMORIES}
    assert "request wall of 300ms reached" in [b.detail for b in response.branches]
