"""Operations over a real socket: drain, caller deadlines, shedding, health, reflection,
and the client's fail-open behaviour.

Slow branches come from the fake memory service (ibex/testing/memory_server.py) with
injected latency; the daemon's retrieval timeouts are raised to about a second
for these tests so a request is reliably still in flight when the test acts.
Clocks are real; bounds are generous.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio_asyncio
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from ibex.assembly.structs import Message
from ibex.client import ContextClient, history_only
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    SERVICE,
    RunningDaemon,
    daemon_process,
    free_port,
    grpcio_probe,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import FakeMemoryServer, make_memories, running_memory_server

SLOW_MS = 400.0
SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING
HISTORY = [Message("user", "Is the billing deploy safe today?")]


def request(**fields: Any) -> Any:
    base: dict[str, Any] = dict(
        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing", request_id="ops"
    )
    return context_pb2.AssembleContextRequest(**{**base, **fields})


@pytest.fixture
def memory() -> Iterator[FakeMemoryServer]:
    """The fake memory service with the demo agent's memories; cold search is slow."""
    with running_memory_server() as server:
        server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 12))
        server.cold.latency_ms = SLOW_MS
        yield server


def slow_settings(memory: FakeMemoryServer, **overrides: Any) -> dict[str, Any]:
    """Timeouts long enough that the slow branch answers instead of timing out."""
    return dict(
        memory_base_url=memory.url,
        memory_api_token=memory.token,
        timeout=1.5,
        deadline=1.5,
        hot_timeout=1.5,
        cold_timeout=1.5,
        **overrides,
    )


def stub(channel: grpc.Channel) -> Any:
    return context_pb2_grpc.ContextAssemblyServiceStub(channel)


def health(channel: grpc.Channel, service: str = "") -> int:
    """grpc.health.v1 Check over a grpcio channel, on an existing connection.

    The message classes are grpclib's copies (same wire): grpcio-health-checking's
    cannot be loaded next to them; `grpcio_probe` uses the real one in a child.
    """
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    return int(check(HealthCheckRequest(service=service), timeout=2).status)


# -- health and reflection ---------------------------------------------------------------------


@pytest.fixture
async def daemon() -> AsyncIterator[RunningDaemon]:
    async with running_daemon() as d:
        yield d


async def test_health_and_reflection_from_grpcio_clients(daemon: RunningDaemon) -> None:
    """grpcio-health-checking and grpcio-reflection, the stock clients, in a child process."""
    method = f"{SERVICE}.AssembleContext"
    seen = await in_thread(grpcio_probe, daemon.target, SERVICE, method, "", SERVICE, "no.Such")
    assert seen["health"] == {"": "SERVING", SERVICE: "SERVING", "no.Such": "NOT_FOUND"}
    assert SERVICE in seen["services"] and "grpc.health.v1.Health" in seen["services"]
    file = seen["file"]
    assert file["name"] == "ibex/context/v1/context.proto"
    assert file["package"] == "ibex.context.v1"
    assert file["dependency"] == ["ibex/auth/v1/principal_context.proto"] or (
        "ibex/auth/v1/principal_context.proto" in file["dependency"]
    )
    assert file["services"] == {
        "ContextAssemblyService": ["AssembleContext", "SearchMemories", "RecordMemoryFeedback"]
    }
    # A descriptor pool fed only by reflection resolves the method and its imports.
    m = seen["method"]
    assert (m["input"], m["output"]) == (
        "ibex.context.v1.AssembleContextRequest", "ibex.context.v1.AssembleContextResponse"
    )  # fmt: skip
    assert m["principal_type"] == "ibex.auth.v1.PrincipalContext"
    assert m["input_fields"]["principal_context"] == 13 and m["input_fields"]["tool_schemas"] == 14
    new_fields = {"degradation_level": 13, "branches": 14, "budget": 15, "pack": 16, "excluded": 17}
    assert new_fields.items() <= m["output_fields"].items()


# -- drain -------------------------------------------------------------------------------------


async def test_sigterm_says_goodbye_and_finishes_in_flight_calls(
    memory: FakeMemoryServer, tmp_path: Path
) -> None:
    """SIGTERM: GOAWAY first (the client leaves the connection), the in-flight call finishes.

    Until issue 12 the drain answered new calls on open connections with
    UNAVAILABLE "server is draining", which grpc-go does not retry; now the
    connection says goodbye and the client takes new calls elsewhere (here:
    nowhere, so they fail to connect, never with the server's refusal).
    """
    env = {
        "IBEX_CONTEXT_MEMORY_BASE_URL": memory.url,
        "IBEX_CONTEXT_MEMORY_API_TOKEN": memory.token,
        "IBEX_CONTEXT_TIMEOUT": "1.5s",
        "IBEX_CONTEXT_DEADLINE_MS": "1500",
        "IBEX_CONTEXT_HOT_TIMEOUT_MS": "1500",
        "IBEX_CONTEXT_COLD_TIMEOUT_MS": "1500",
        "IBEX_CONTEXT_DRAIN_GRACE": "5s",
    }
    memory.cold.latency_ms = 700.0

    with daemon_process(env, tmp_path / "serve.log") as proc:

        def scenario() -> dict[str, Any]:
            seen: dict[str, Any] = {}
            with grpc.insecure_channel(proc.target) as channel:
                assert health(channel) == SERVING  # also opens the connection
                states: list[grpc.ChannelConnectivity] = []
                left = threading.Event()

                def on_state(state: grpc.ChannelConnectivity) -> None:
                    states.append(state)
                    if state is not grpc.ChannelConnectivity.READY and states.count(
                        grpc.ChannelConnectivity.READY
                    ):
                        left.set()

                channel.subscribe(on_state)
                in_flight = stub(channel).AssembleContext.future(request(), timeout=5)
                deadline = time.monotonic() + 3
                while memory.requests["cold"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
                proc.terminate()
                # The GOAWAY makes the channel leave READY while the call still runs.
                seen["left_ready"] = left.wait(3)
                try:
                    stub(channel).AssembleContext(request(), timeout=2)
                except grpc.RpcError as exc:
                    seen["after_goaway"] = (exc.code(), exc.details())
                seen["in_flight_done_early"] = in_flight.done()
                seen["in_flight"] = in_flight.result()
                channel.unsubscribe(on_state)
            seen["exit"] = proc.wait()
            return seen

        seen = await in_thread(scenario)

    assert seen["left_ready"]
    assert not seen["in_flight_done_early"]  # the new call was tried during the drain
    resp = seen["in_flight"]
    assert resp.degradation_level == "L0"
    assert [(b.source, b.status) for b in resp.branches][1:] == [
        ("hot", "success"), ("cold", "success")
    ]  # fmt: skip
    code, details = seen["after_goaway"]
    assert code == grpc.StatusCode.UNAVAILABLE
    assert (
        "draining" not in details
    )  # not sent to the closing connection: the client went elsewhere
    assert seen["exit"] == 0
    events = [json.loads(line)["event"] for line in proc.stderr.splitlines()]
    assert events.index("draining") < events.index("stopped") == len(events) - 1


async def test_shutdown_event_drains_in_process(memory: FakeMemoryServer) -> None:
    """The same drain through `Daemon.serve(shutdown=...)`: the call finishes, state is clean."""
    async with running_daemon(**slow_settings(memory)) as d:
        with d.channel() as channel:
            future = stub(channel).AssembleContext.future(request(), timeout=5)
            with trio.fail_after(3):
                while d.daemon.admission.in_flight == 0:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            d.shutdown.set()
            resp = await in_thread(future.result)
    assert resp.degradation_level == "L0"
    assert d.daemon.admission.draining and d.daemon.admission.in_flight == 0


async def test_calls_parked_on_a_slow_branch_do_not_read_as_cpu_work_at_the_gate(
    memory: FakeMemoryServer,
) -> None:
    """Calls waiting on a slow cold endpoint are counted as retrieving, and the CPU gate
    counts each for half an answer: on a loop it reads as saturated at 30 ms of CPU per
    call, a new 100 ms call behind 3 parked ones needs (3 x 0.5 + 1) x 30 = 75 ms, within
    100 - 15 ms, and is served; counted as working calls it would need 120 ms, refused."""
    async with running_daemon(**slow_settings(memory)) as d:
        state = d.daemon.admission
        with d.channel() as channel:
            parked = [stub(channel).AssembleContext.future(request(), timeout=5) for _ in range(3)]
            with trio.fail_after(3):
                while memory.requests["cold"] < 3:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            assert state.retrieving == 3 and state.in_flight == 3
            saved = state.cpu.utilisation, state.cpu.per_call, state.cpu.sample
            state.cpu.utilisation, state.cpu.per_call = 1.0, 0.030
            state.cpu.sample = lambda now: None  # type: ignore[method-assign]
            try:
                future = stub(channel).AssembleContext.future(request(), timeout=0.1)
                try:
                    status = (await in_thread(future.result)).degradation_level
                except grpc.RpcError as exc:
                    status = exc.code().name
            finally:
                state.cpu.utilisation, state.cpu.per_call, state.cpu.sample = saved
            # Served: its own cold branch was cut by its wall (L1), or it ran out of time.
            assert status in {"L1", "DEADLINE_EXCEEDED"}
            assert state.metrics.shed_requests.labels("cpu")._value.get() == 0
            for f in parked:
                assert (await in_thread(f.result)).degradation_level == "L0"
    assert state.retrieving == 0 and state.in_flight == 0


# -- caller deadline ---------------------------------------------------------------------------


async def test_short_caller_deadline_answers_degraded_or_deadline_exceeded(
    memory: FakeMemoryServer,
) -> None:
    memory.hot.latency_ms = SLOW_MS
    async with running_daemon(**slow_settings(memory)) as d:

        def timed_call() -> tuple[float, Any]:
            with d.channel() as channel:
                assert health(channel) == SERVING  # connect first: time only the call
                t0 = time.perf_counter()
                try:
                    resp = stub(channel).AssembleContext(request(), timeout=0.020)
                except grpc.RpcError as exc:
                    return time.perf_counter() - t0, exc.code()
                return time.perf_counter() - t0, resp

        elapsed, outcome = await in_thread(timed_call)
        assert elapsed < 0.2
        if isinstance(outcome, grpc.StatusCode):
            assert outcome == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert outcome.degradation_level == "L2"
            assert [b.status for b in outcome.branches][1:] == ["timeout", "timeout"]
            assert "<memories" not in outcome.assembled_context

        # Our client: the same deadline never raises and never takes long.
        async with trio_asyncio.open_loop():
            client = ContextClient("127.0.0.1", d.port, deadline=0.020)
            try:
                await client.assemble_trio(org_id=ORG, agent_id=AGENT, model="gpt-4o")  # warm
                t0 = time.perf_counter()
                result = await client.assemble_trio(
                    org_id=ORG,
                    agent_id=AGENT,
                    model="gpt-4o",
                    query="deploy billing",
                    recent_messages=[{"role": m.role, "content": m.content} for m in HISTORY],
                )
                elapsed = time.perf_counter() - t0
            finally:
                client.close()
        assert elapsed < 0.2
        assert result.degraded
        assert result.status in ("OK", "DEADLINE_EXCEEDED")
        assert HISTORY[0].content in result.context


# -- load shedding -----------------------------------------------------------------------------


async def test_burst_beyond_max_in_flight_is_shed_at_once(memory: FakeMemoryServer) -> None:
    async with running_daemon(**slow_settings(memory, max_in_flight=2)) as d:

        def burst() -> list[tuple[float, Any]]:
            with d.channel() as channel:
                assert health(channel) == SERVING
                t0 = time.perf_counter()
                done: dict[int, float] = {}
                futures: list[Any] = []
                for i in range(10):
                    fut = stub(channel).AssembleContext.future(request(), timeout=5)
                    fut.add_done_callback(lambda _, i=i: done.setdefault(i, time.perf_counter()))
                    futures.append(fut)
                out: list[tuple[float, Any]] = []
                for i, fut in enumerate(futures):
                    try:
                        outcome = fut.result(timeout=10)
                    except grpc.RpcError as exc:
                        outcome = (exc.code(), exc.details())
                    out.append((done[i] - t0, outcome))
                return out

        results = await in_thread(burst)
        shed = [(t, o) for t, o in results if isinstance(o, tuple)]
        served = [(t, o) for t, o in results if not isinstance(o, tuple)]
        assert len(shed) + len(served) == 10
        assert 1 <= len(shed) <= 8 and len(served) >= 2
        assert {code for _, (code, _) in shed} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all(details.startswith("overloaded") for _, (_, details) in shed)
        assert all(o.degradation_level == "L0" for _, o in served)
        # Shed calls are answered at once, not queued behind the slow ones.
        assert max(t for t, _ in shed) < min(t for t, _ in served)

        # Load gone: full quality again, nothing left in flight.
        resp = await in_thread(lambda: _call(d, request()))
        assert resp.degradation_level == "L0" and resp.memories_included > 0
        assert d.daemon.admission.in_flight == 0


def _call(d: RunningDaemon, req: Any) -> Any:
    with d.channel() as channel:
        return stub(channel).AssembleContext(req, timeout=5)


# -- client fail-open --------------------------------------------------------------------------


async def test_client_fails_open_when_daemon_is_down() -> None:
    async with trio_asyncio.open_loop():
        client = ContextClient("127.0.0.1", free_port(), deadline=1.0)
        try:
            result = await client.assemble_trio(
                org_id=ORG,
                agent_id=AGENT,
                recent_messages=[{"role": m.role, "content": m.content} for m in HISTORY],
            )
        finally:
            client.close()
    assert (result.degraded, result.status, result.degradation_level) == (
        True, "UNAVAILABLE", "L2"
    )  # fmt: skip
    assert result.response is None
    assert result.context == history_only(HISTORY)


async def test_client_fails_open_when_daemon_sheds(memory: FakeMemoryServer) -> None:
    async with (
        running_daemon(**slow_settings(memory, max_in_flight=1)) as d,
        trio_asyncio.open_loop(),
    ):
        client = ContextClient("127.0.0.1", d.port, deadline=5.0)
        try:
            async with trio.open_nursery() as nursery:
                slow: list[Any] = []

                async def occupy() -> None:
                    slow.append(await client.assemble_trio(request()))

                nursery.start_soon(occupy)
                with trio.fail_after(3):
                    while d.daemon.admission.in_flight == 0:  # noqa: ASYNC110
                        await trio.sleep(0.005)
                shed = await client.assemble_trio(
                    org_id=ORG,
                    agent_id=AGENT,
                    recent_messages=[{"role": m.role, "content": m.content} for m in HISTORY],
                )
        finally:
            client.close()
    assert (shed.degraded, shed.status) == (True, "RESOURCE_EXHAUSTED")
    assert shed.context == history_only(HISTORY)
    assert slow[0].status == "OK" and not slow[0].degraded


async def test_client_fails_open_on_its_deadline() -> None:
    """A peer that accepts but never speaks HTTP/2: the client's own deadline fires."""
    listener = trio.socket.socket()
    with listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # connections complete in the backlog; nobody answers
        port = listener.getsockname()[1]
        async with trio_asyncio.open_loop():
            client = ContextClient("127.0.0.1", port, deadline=0.05)
            try:
                result = await client.assemble_trio(
                    org_id=ORG,
                    agent_id=AGENT,
                    recent_messages=[{"role": m.role, "content": m.content} for m in HISTORY],
                )
            finally:
                client.close()
    assert (result.degraded, result.status) == (True, "DEADLINE_EXCEEDED")
    assert result.context == history_only(HISTORY)


async def test_a_short_deadline_gets_an_answer_or_deadline_exceeded_never_overload(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """Contract: DEADLINE_EXCEEDED when even a degraded answer cannot be made in time;
    RESOURCE_EXHAUSTED means overload only, and an idle daemon is not overloaded."""

    def calls() -> tuple[list[Any], Any]:
        with daemon.channel() as channel:
            assert health(channel) == SERVING  # connect first: time only the calls
            short: list[Any] = []
            for timeout in (0.0005, 0.002, 0.004, 0.005, 0.008):
                try:
                    stub(channel).AssembleContext(request(), timeout=timeout)
                    short.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    short.append(exc.code())
            return short, stub(channel).AssembleContext(request(), timeout=2.0)

    with caplog.at_level(logging.INFO):
        short, normal = await in_thread(calls)
    assert set(short) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert normal.degradation_level == "L0" and normal.memories_included > 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_burst_and_the_calls_after_it_are_all_served() -> None:
    """30 concurrent calls with room in their deadlines, then more: nothing is refused
    (a burst is not a standing queue). The branches get budgets a busy host cannot
    miss, so every answer is whole and a refusal is the only way to fail."""
    budgets = {"directive_timeout": 1.5, "hot_timeout": 1.5, "cold_timeout": 1.5}
    async with running_daemon(timeout=1.5, deadline=1.5, **budgets) as daemon:
        await _burst_then_more(daemon)


async def _burst_then_more(daemon: RunningDaemon) -> None:

    def burst() -> list[Any]:
        with daemon.channel() as channel:
            assert health(channel) == SERVING
            futures = [
                stub(channel).AssembleContext.future(request(), timeout=5.0) for _ in range(30)
            ]
            answers = [f.result() for f in futures]
            answers += [stub(channel).AssembleContext(request(), timeout=1.0) for _ in range(5)]
            return answers

    answers = await in_thread(burst)
    assert len(answers) == 35
    assert all(a.degradation_level == "L0" and a.memories_included > 0 for a in answers)
    assert daemon.daemon.admission.in_flight == 0 and daemon.daemon.admission.pending == 0
