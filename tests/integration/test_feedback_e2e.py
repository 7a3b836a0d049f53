"""RecordMemoryFeedback end to end: a stock grpcio client, the real daemon, the memory stand-in.

The stand-in (ibex/testing/memory_server.py) counts feedback once per Idempotency-Key
and leaves other orgs' ids out of its updates, as the contract says the
memory service does; its faults on the endpoint record the write first and
then lose the answer, the case the daemon's same-key retry exists for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio_asyncio

from ibex.assembly.feedback_rules import idempotency_key, validate_feedback
from ibex.client import ContextClient
from ibex.errors import SourceError
from ibex.sources.feedback_sender import FeedbackRejected, send_feedback
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    RunningDaemon,
    daemon_process,
    free_port,
    in_thread,
    run_cli,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import (
    Endpoint,
    FakeMemoryServer,
    make_memories,
    running_memory_server,
)

OTHER_ORG = "00000000-0000-4000-8000-0000000000ff"
OTHER_AGENT = "00000000-0000-4000-8000-0000000000fe"
MEMORIES = make_memories(ORG, AGENT, 4, seed=7)
IDS = sorted(m["id"] for m in MEMORIES)
OTHER_MEMORY = make_memories(OTHER_ORG, OTHER_AGENT, 1, seed=8)[0]


@pytest.fixture
def memory() -> Iterator[FakeMemoryServer]:
    with running_memory_server() as server:
        server.add_memories(ORG, AGENT, MEMORIES)
        server.add_memories(OTHER_ORG, OTHER_AGENT, [OTHER_MEMORY])
        yield server


def feedback_request(**fields: Any) -> Any:
    base: dict[str, Any] = dict(
        memory_ids=IDS[:2],
        org_id=ORG,
        feedback="positive",
        session_id="sess-1",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )
    return context_pb2.RecordMemoryFeedbackRequest(**{**base, **fields})


def call(target: str, request: Any, timeout: float = 5.0) -> Any:
    with grpc.insecure_channel(target) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        return stub.RecordMemoryFeedback(request, timeout=timeout)


def expected_update(memory_id: str, step: float = 0.1) -> tuple[str, float, float]:
    before = next(m["usefulness"] for m in MEMORIES if m["id"] == memory_id)
    return memory_id, before, round(min(1.0, before + step), 6)


def updates(response: Any) -> list[tuple[str, float, float]]:
    """As (id, previous, new), floats rounded to float32 precision (the wire's)."""
    return [
        (u.memory_id, round(u.previous_score, 5), round(u.new_score, 5)) for u in response.updates
    ]


def rounded(rows: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    return [(i, round(p, 5), round(n, 5)) for i, p, n in rows]


def keys_seen(memory: FakeMemoryServer) -> list[str]:
    return [s.headers["idempotency-key"] for s in memory.seen if s.path == "/v1/memories/feedback"]


def expected_key(ids: list[str], **fields: Any) -> str:
    base: dict[str, Any] = dict(
        org_id=ORG,
        memory_ids=ids,
        feedback="positive",
        session_id="sess-1",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )
    return idempotency_key(validate_feedback(**{**base, **fields}))


# -- the real process ----------------------------------------------------------------------------


def test_ibex_serve_records_once_when_the_first_attempt_meets_a_reset(
    memory: FakeMemoryServer, tmp_path: Path
) -> None:
    """Done-when: `ibex serve` + stand-in; the first attempt's answer is cut by a reset."""
    memory.feedback.then.append(Endpoint(fault="reset"))
    env = {
        "IBEX_CONTEXT_MEMORY_BASE_URL": memory.url,
        "IBEX_CONTEXT_MEMORY_API_TOKEN": memory.token,
    }
    with daemon_process(env, tmp_path / "daemon.log") as proc:
        response = call(proc.target, feedback_request())
        assert response.success is True
        assert updates(response) == rounded([expected_update(i) for i in IDS[:2]])
        assert memory.requests["feedback"] == 2  # the reset attempt and its retry
        assert keys_seen(memory) == [expected_key(IDS[:2])] * 2
        assert memory.feedback_applied == {IDS[0]: 1, IDS[1]: 1}  # counted once

        # The proxy retries the whole call (e.g. it never saw the answer): still once.
        again = call(proc.target, feedback_request(memory_ids=[IDS[1], IDS[0]]))
        assert again.success is True and updates(again) == updates(response)
        assert memory.feedback_applied == {IDS[0]: 1, IDS[1]: 1}

        with pytest.raises(grpc.RpcError) as info:
            call(proc.target, feedback_request(feedback="great"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("feedback:")


def test_ibex_serve_says_unavailable_when_the_memory_service_is_down(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"IBEX_CONTEXT_MEMORY_BASE_URL": down, "IBEX_CONTEXT_MEMORY_API_TOKEN": "t" * 24}
    with daemon_process(env, tmp_path / "daemon.log") as proc:
        with pytest.raises(grpc.RpcError) as info:
            call(proc.target, feedback_request())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "feedback" in info.value.details()


# -- in process ----------------------------------------------------------------------------------


@pytest.fixture
async def daemon(memory: FakeMemoryServer) -> Any:
    async with running_daemon(memory_base_url=memory.url, memory_api_token=memory.token) as d:
        yield d


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"org_id": "acme"}, "org_id"),
        ({"org_id": ""}, "org_id"),
        ({"memory_ids": []}, "memory_ids"),
        ({"memory_ids": [IDS[0], "x"]}, "memory_ids[1]"),
        ({"memory_ids": [IDS[0]] * 101}, "memory_ids"),
        ({"feedback": "Positive"}, "feedback"),
        ({"trace_id": "t" * 300}, "trace_id"),
        ({"session_id": "s" * 300}, "session_id"),
    ],
)
async def test_wrong_input_is_invalid_argument_and_never_sent(
    daemon: RunningDaemon, memory: FakeMemoryServer, fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(call, daemon.target, feedback_request(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")
    assert memory.requests["feedback"] == 0


async def test_other_orgs_ids_are_left_out_of_updates(
    daemon: RunningDaemon, memory: FakeMemoryServer
) -> None:
    unknown = "10000000-0000-4000-8000-0000000000ff"
    request = feedback_request(memory_ids=[IDS[2], OTHER_MEMORY["id"], unknown])
    response = await in_thread(call, daemon.target, request)
    assert response.success is True
    assert updates(response) == rounded([expected_update(IDS[2])])
    assert memory.usefulness(OTHER_ORG, OTHER_MEMORY["id"]) == OTHER_MEMORY["usefulness"]


async def test_a_4xx_is_invalid_argument_naming_no_tenant(
    daemon: RunningDaemon, memory: FakeMemoryServer
) -> None:
    memory.feedback.status = 404
    memory.feedback.body = json.dumps(
        {"error": f"memory {OTHER_MEMORY['id']} of {OTHER_ORG}"}
    ).encode()
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(call, daemon.target, feedback_request())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details == "feedback: refused by the memory service (HTTP 404)"
    assert memory.requests["feedback"] == 1  # a 4xx is not retried


async def test_5xx_twice_is_unavailable(daemon: RunningDaemon, memory: FakeMemoryServer) -> None:
    memory.feedback.status = 503
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(call, daemon.target, feedback_request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "feedback: HTTP 503"
    assert memory.requests["feedback"] == 2
    assert memory.feedback_applied == {}


async def test_a_broken_answer_is_unavailable(
    daemon: RunningDaemon, memory: FakeMemoryServer
) -> None:
    memory.feedback.body = json.dumps(
        {
            "data": {
                "updates": [{"memory_id": OTHER_MEMORY["id"], "previous_score": 0, "new_score": 1}]
            }
        }
    ).encode()
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(call, daemon.target, feedback_request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert OTHER_MEMORY["id"] not in info.value.details()


async def test_feedback_metric_counts_outcomes(
    daemon: RunningDaemon, memory: FakeMemoryServer
) -> None:
    memory.feedback.then.append(Endpoint(status=500))
    await in_thread(call, daemon.target, feedback_request())
    with pytest.raises(grpc.RpcError):
        await in_thread(call, daemon.target, feedback_request(org_id="acme"))
    memory.feedback.then.extend([Endpoint(status=502), Endpoint(status=503)])
    with pytest.raises(grpc.RpcError):
        await in_thread(call, daemon.target, feedback_request(trace_id="other"))
    memory.feedback.then.append(Endpoint(status=400))
    with pytest.raises(grpc.RpcError):
        await in_thread(call, daemon.target, feedback_request(trace_id="third"))
    sample = daemon.daemon.metrics.registry.get_sample_value
    outcomes = {
        o: sample("ibex_feedback_total", {"outcome": o})
        for o in ("recorded", "invalid", "rejected", "unavailable", "deadline", "shed", "error")
    }
    assert outcomes == {
        "recorded": 1,
        "invalid": 1,
        "rejected": 1,
        "unavailable": 1,
        "deadline": 0,
        "shed": 0,
        "error": 0,
    }
    assert sample("ibex_feedback_retries_total") == 2


async def test_python_client_record_feedback(
    daemon: RunningDaemon, memory: FakeMemoryServer
) -> None:
    async with trio_asyncio.open_loop():
        client = ContextClient("127.0.0.1", daemon.port)
        try:
            response = await client.record_feedback_trio(
                [IDS[3]], "negative", org_id=ORG, trace_id="trace-py"
            )
        finally:
            client.close()
    assert response.success is True
    assert updates(response) == rounded([expected_update(IDS[3], -0.1)])
    assert keys_seen(memory) == [
        expected_key([IDS[3]], feedback="negative", session_id="", trace_id="trace-py")
    ]


# -- the source's status mapping -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error", "attempts"),
    [
        (400, FeedbackRejected, 1),
        (422, FeedbackRejected, 1),
        (401, SourceError, 1),  # our credential: UNAVAILABLE, the caller cannot fix it
        (403, SourceError, 1),
        (429, SourceError, 2),  # "later": retried like a 5xx
        (408, SourceError, 2),
        (500, SourceError, 2),
        (503, SourceError, 2),
    ],
)
async def test_status_mapping(
    memory: FakeMemoryServer, status: int, error: type[Exception], attempts: int
) -> None:
    memory.feedback.status = status
    fb = validate_feedback(org_id=ORG, memory_ids=IDS[:1], feedback="neutral")
    async with memory.source() as source:
        with pytest.raises(error) as info:
            await send_feedback(
                source, fb, deadline=trio.current_time() + 2.0, default_timeout=2.0, headroom=0.0
            )
    assert type(info.value) is error  # not a FeedbackRetryable left over
    assert str(info.value).startswith("feedback: ")
    assert memory.requests["feedback"] == attempts
    assert memory.feedback_applied == {}


async def test_a_wrong_memory_token_is_unavailable(memory: FakeMemoryServer) -> None:
    async with running_daemon(memory_base_url=memory.url, memory_api_token="wrong" * 6) as d:
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(call, d.target, feedback_request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "feedback: HTTP 401"
    assert memory.feedback_applied == {}


# -- the embedded sample and the CLI ---------------------------------------------------------------

SAMPLE_MEMORY = "10000000-0000-4000-8000-000000000001"  # the billing deploy memory


def test_cli_feedback_moves_the_samples_usefulness_seen_by_assemble(tmp_path: Path) -> None:
    """The embedded sample applies feedback in memory; `ibex assemble` then shows it."""
    with daemon_process({}, tmp_path / "daemon.log") as proc:
        addr = ["--addr", proc.target]
        out = run_cli("feedback", *addr, "--memory", SAMPLE_MEMORY, "--feedback", "positive")
        assert out.returncode == 0, out.stderr
        assert f"{SAMPLE_MEMORY}" in out.stdout and "0.500 -> 0.600" in out.stdout
        # The same feedback again (same key, here from a stock client): counted once.
        request = feedback_request(memory_ids=[SAMPLE_MEMORY], session_id="", trace_id="")
        again = call(proc.target, request)
        assert updates(again) == [(SAMPLE_MEMORY, 0.5, 0.6)]
        shown = run_cli("assemble", *addr, "--query", "deploy the billing service")
        assert shown.returncode == 0, shown.stderr
        line = next(x for x in shown.stdout.splitlines() if x.strip().startswith(SAMPLE_MEMORY))
        assert line.endswith("usefulness=0.600")  # the sample file says 0.5
        bad = run_cli("feedback", *addr, "--memory", "nope", "--feedback", "positive")
        assert bad.returncode == 1
        assert "INVALID_ARGUMENT: memory_ids[0]:" in bad.stderr
