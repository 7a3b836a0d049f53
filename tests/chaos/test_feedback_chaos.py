"""Feedback while the memory service misbehaves: the write must count once, whatever is lost.

The real HTTP source and pool against the loopback stand-in, real clocks. The
stand-in's faults on the feedback endpoint record the write and then lose the
answer (a reset mid-body, a hang, an answer slower than the deadline), or fail
before recording (a 5xx): the cases where a retry without the same
idempotency key would count twice. Each case ends with the pool holding no
slot, waiter or busy connection, and with a plain call answering again.
Timings are generous (deadlines of a second or so against 5 s hangs); they
tell "cut at its deadline" from "waited for the hang", nothing finer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import trio

from ibex.assembly.feedback_rules import Feedback, ScoreUpdate, idempotency_key, validate_feedback
from ibex.errors import SourceError
from ibex.sources.feedback_sender import Sent, send_feedback
from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.grpc_harness import in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import (
    Endpoint,
    FakeMemoryServer,
    make_memories,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.samples import AGENT, ORG

MEMORIES = make_memories(ORG, AGENT, 3, seed=3)
IDS = sorted(m["id"] for m in MEMORIES)
HANG_MS = 5000.0


def feedback(**kw: Any) -> Feedback:
    fields: dict[str, Any] = dict(
        org_id=ORG, memory_ids=IDS, feedback="positive", session_id="s", trace_id="chaos"
    )
    return validate_feedback(**{**fields, **kw})


def expected() -> list[ScoreUpdate]:
    by_id = {m["id"]: m["usefulness"] for m in MEMORIES}
    return [ScoreUpdate(i, by_id[i], round(min(1.0, by_id[i] + 0.1), 6)) for i in IDS]


@pytest.fixture
async def source(memory_server: FakeMemoryServer) -> AsyncIterator[MemoryHttpSource]:
    memory_server.add_memories(ORG, AGENT, MEMORIES)
    async with memory_server.source() as src:
        yield src


async def send(source: MemoryHttpSource, within: float = 1.0) -> Sent:
    return await send_feedback(
        source,
        feedback(),
        deadline=trio.current_time() + within,
        default_timeout=within,
        headroom=0.002,
    )


async def assert_clean(source: MemoryHttpSource, server: FakeMemoryServer) -> None:
    """No slot, waiter or busy connection left; the next call answers at once."""
    stats = source.feedback_pool_stats()
    assert (stats.leases, stats.waiters, stats.in_use) == (0, 0, 0)
    assert await server.settle_open_connections(stats.idle) <= stats.idle
    server.feedback.latency_ms = 0.0
    server.feedback.fault = "none"
    again = await send(source)
    assert [u.memory_id for u in again.updates] == IDS and again.attempts == 1


def keys(server: FakeMemoryServer) -> list[str]:
    return [s.headers["idempotency-key"] for s in server.seen if s.path.endswith("/feedback")]


async def test_reset_mid_answer_is_retried_and_counted_once(
    source: MemoryHttpSource, memory_server: FakeMemoryServer
) -> None:
    memory_server.feedback.then.append(Endpoint(fault="reset"))
    sent = await send(source)
    assert sent.attempts == 2
    assert sent.updates == expected()
    assert keys(memory_server) == [idempotency_key(feedback())] * 2
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
    await assert_clean(source, memory_server)
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)


async def test_5xx_then_success_with_the_same_key_counts_once(
    source: MemoryHttpSource, memory_server: FakeMemoryServer
) -> None:
    memory_server.feedback.then.append(Endpoint(status=503))
    sent = await send(source)
    assert sent.attempts == 2
    assert sent.updates == expected()
    assert len(set(keys(memory_server))) == 1 and len(keys(memory_server)) == 2
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
    await assert_clean(source, memory_server)


async def test_hang_then_success_within_the_deadline(
    source: MemoryHttpSource, memory_server: FakeMemoryServer
) -> None:
    memory_server.feedback.then.append(Endpoint(fault="hang"))
    sent = await send(source, within=1.0)
    assert sent.attempts == 2  # the first attempt was cut at half the time
    assert sent.updates == expected()  # the recorded first answer, replayed for the key
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
    await assert_clean(source, memory_server)


async def test_answer_slower_than_the_deadline_is_unavailable_in_time_and_counted_once(
    source: MemoryHttpSource, memory_server: FakeMemoryServer
) -> None:
    memory_server.feedback.latency_ms = HANG_MS
    start = trio.current_time()
    with pytest.raises(SourceError, match="no answer within") as info:
        await send(source, within=0.6)
    assert info.value.status == "UNAVAILABLE"
    assert trio.current_time() - start < HANG_MS / 1000 / 2  # cut, not waited out
    assert len(keys(memory_server)) == 2
    # Both slow attempts were recorded by the service, under one key: counted once.
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
    # The proxy retries later: the service's first answer, still counted once.
    await assert_clean(source, memory_server)
    assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)


async def test_cancelled_calls_leak_no_pool_slot(
    source: MemoryHttpSource, memory_server: FakeMemoryServer
) -> None:
    """Many calls cut at random points (connecting, writing, waiting): nothing leaks."""
    memory_server.feedback.latency_ms = 20.0
    memory_server.feedback.jitter_ms = 20.0
    async with trio.open_nursery() as nursery:
        for i in range(40):

            async def one(i: int = i) -> None:
                with trio.move_on_after(0.001 * (i % 40)):
                    fb = feedback(trace_id=f"storm-{i}")
                    await source.feedback(fb, idempotency_key(fb))

            nursery.start_soon(one)
    memory_server.feedback.jitter_ms = 0.0
    await assert_clean(source, memory_server)


async def test_grpc_call_past_a_slow_memory_service_ends_by_its_deadline(
    memory_server: FakeMemoryServer,
) -> None:
    """Through the daemon: the caller's deadline bounds both attempts; never a hang."""
    memory_server.add_memories(ORG, AGENT, MEMORIES)
    memory_server.feedback.latency_ms = HANG_MS
    request = context_pb2.RecordMemoryFeedbackRequest(
        memory_ids=IDS, org_id=ORG, feedback="positive", trace_id="grpc-chaos"
    )

    def call() -> Any:
        with grpc.insecure_channel(daemon.target) as channel:
            stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
            return stub.RecordMemoryFeedback(request, timeout=1.0)

    async with running_daemon(
        memory_base_url=memory_server.url, memory_api_token=memory_server.token
    ) as daemon:
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(call)
        # UNAVAILABLE leaves before the deadline; a stalled test process may see the
        # caller's own DEADLINE_EXCEEDED first. Either way: no success, no hang.
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
        memory_server.feedback.latency_ms = 0.0
        response = await in_thread(call)  # the proxy's retry: the first answer
        assert response.success is True
        assert [u.memory_id for u in response.updates] == IDS
        assert memory_server.feedback_applied == dict.fromkeys(IDS, 1)
