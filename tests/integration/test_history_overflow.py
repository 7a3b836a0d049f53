"""A history that does not fit, end to end over a real socket.

The daemon leaves out the oldest whole messages (reported in
TokenBudget.messages_dropped / messages_dropped_tokens), refuses with
RESOURCE_EXHAUSTED only when the newest message alone cannot fit or the caller
sets AssemblyOptions.reject_history_overflow, and the client library raises
for such an input instead of passing it off as load shedding; its own
fallback never returns more than the window.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from ibex.assembly.structs import Message
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.xml_format import escape_body
from ibex.client import ContextClient, fallback_history, history_only, is_input_error
from ibex.service import pb
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    RunningDaemon,
    free_port,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc

_O200K = Tokenizers(None, 0).encoding("o200k_base")
WINDOW = 2000
CEILING = WINDOW - 500 - WINDOW // 100  # reserve floor, o200k_base's 1 % buffer
LINE = "the deploy waits for green CI before it goes out. "


def turns(n: int, words: int = 20) -> list[tuple[str, str]]:
    roles = ("user", "assistant")
    return [(roles[i % 2], f"turn {i:03d} " + LINE * words) for i in range(n)]


def grpcio_request(messages: list[tuple[str, str]], **options: Any) -> Any:
    return context_pb2.AssembleContextRequest(
        org_id=ORG,
        agent_id=AGENT,
        model="gpt-4o",
        query="how do I deploy billing?",
        available_tokens=WINDOW,
        recent_messages=[context_pb2.Message(role=r, content=c) for r, c in messages],
        options=context_pb2.AssemblyOptions(**options),
    )


@pytest.fixture
async def daemon() -> AsyncIterator[RunningDaemon]:
    async with running_daemon() as d:
        yield d


def _assemble(daemon: RunningDaemon, request: Any) -> Any:
    with daemon.channel() as channel:
        return context_pb2_grpc.ContextAssemblyServiceStub(channel).AssembleContext(
            request, timeout=10
        )


async def test_oldest_messages_are_left_out_over_grpc(daemon: RunningDaemon) -> None:
    messages = turns(40)
    resp = await in_thread(_assemble, daemon, grpcio_request(messages))
    b = resp.budget
    text = resp.assembled_context
    assert 0 < b.messages_dropped < len(messages)
    assert b.messages_dropped_tokens > 0
    assert escape_body(messages[-1][1]) in text  # the newest is always kept
    assert all(escape_body(c) not in text for _, c in messages[: b.messages_dropped])
    assert all(escape_body(c) in text for _, c in messages[b.messages_dropped :])
    assert resp.tokens_used == len(_O200K.encode_ordinary(text)) <= CEILING
    assert b.messages_tokens == resp.history_tokens


async def test_newest_message_alone_too_large_is_resource_exhausted(
    daemon: RunningDaemon,
) -> None:
    messages = [*turns(2), ("user", LINE * 400)]
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(_assemble, daemon, grpcio_request(messages))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert details.startswith("recent_messages: the newest message alone")
    assert f"{CEILING}-token" in details
    assert LINE not in details  # sizes, never text


async def test_reject_history_overflow_is_resource_exhausted(daemon: RunningDaemon) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(_assemble, daemon, grpcio_request(turns(40), reject_history_overflow=True))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reject_history_overflow" in info.value.details()
    fits = await in_thread(
        _assemble, daemon, grpcio_request(turns(2), reject_history_overflow=True)
    )
    assert fits.budget.messages_dropped == 0


def _wire_request(messages: list[tuple[str, str]]) -> Any:
    return pb.AssembleContextRequest(
        org_id=ORG,
        agent_id=AGENT,
        model="gpt-4o",
        available_tokens=WINDOW,
        recent_messages=[{"role": r, "content": c} for r, c in messages],
    )


async def test_client_raises_for_an_input_that_cannot_fit(daemon: RunningDaemon) -> None:
    async with trio_asyncio.open_loop():
        client = ContextClient("127.0.0.1", daemon.port, deadline=10.0)
        try:
            with pytest.raises(GRPCError) as info:
                await client.assemble_trio(_wire_request([("user", LINE * 400)]))
            dropped = await client.assemble_trio(_wire_request(turns(40)))
        finally:
            client.close()
    assert info.value.status is Status.RESOURCE_EXHAUSTED
    assert (dropped.status, dropped.degraded) == ("OK", False)
    assert dropped.response.budget.messages_dropped > 0


async def test_client_fallback_never_exceeds_the_window() -> None:
    messages = turns(200)
    async with trio_asyncio.open_loop():
        client = ContextClient("127.0.0.1", free_port(), deadline=2.0)
        try:
            result = await client.assemble_trio(_wire_request(messages))
        finally:
            client.close()
    assert (result.status, result.degraded) == ("UNAVAILABLE", True)
    assert 0 < result.messages_dropped < len(messages)
    # UTF-8 bytes bound every byte-level BPE count: the fallback fits the ceiling.
    assert len(result.context.encode()) <= CEILING
    assert len(_O200K.encode_ordinary(result.context)) <= CEILING
    assert escape_body(messages[-1][1]) in result.context


def test_history_only_keeps_the_newest_and_reports_the_rest() -> None:
    msgs = [Message("user", LINE * 10) for _ in range(30)] + [Message("user", "newest")]
    context, dropped = fallback_history(msgs, model="gpt-4o", available_tokens=1000)
    assert context.startswith("<history>\n")  # no nonce: the daemon did not write it
    assert context.endswith('<message role="user">\nnewest\n</message>\n</history>\n')
    assert 0 < dropped < len(msgs)
    assert len(context.encode()) <= 1000 - 500 - 10
    assert history_only(msgs, model="gpt-4o", available_tokens=1000) == context
    huge, dropped_all = fallback_history([Message("user", "x" * 5000)], available_tokens=1000)
    assert (huge, dropped_all) == ("", 1)
    # An unknown model without a window gets the catalog's smallest (16385 tokens).
    long = [Message("user", "x" * 4000) for _ in range(10)]
    capped, some = fallback_history(long, model="")
    assert 0 < some < 10 and len(capped.encode()) <= 16385


@pytest.mark.parametrize(
    ("status", "message", "raises"),
    [
        (Status.RESOURCE_EXHAUSTED, "recent_messages: the newest message alone takes ...", True),
        (Status.RESOURCE_EXHAUSTED, "request: message of 9000 bytes exceeds the limit", True),
        (Status.RESOURCE_EXHAUSTED, "overloaded: 64 requests in flight", False),
        (Status.RESOURCE_EXHAUSTED, "overloaded: event loop 5.0ms behind", False),
        (Status.RESOURCE_EXHAUSTED, None, False),  # no message: treat as load
        (Status.INVALID_ARGUMENT, "org_id: is not a valid UUID", True),
        (Status.UNAVAILABLE, "server is draining; retry elsewhere", False),
        (Status.DEADLINE_EXCEEDED, None, False),
    ],
)
def test_which_errors_the_client_raises(status: Status, message: str | None, raises: bool) -> None:
    assert is_input_error(GRPCError(status, message)) is raises
