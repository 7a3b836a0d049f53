"""Counts before objects, through the real daemon: an over-count request is refused
INVALID_ARGUMENT, naming the field and its limit, without being decoded.

Requests are written as raw protobuf bytes and sent by grpcio with an identity
serializer (building two million elements as objects in the test would be the
cost the daemon must not pay). The daemon's decoder is watched: a refused
request never reaches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import grpc
import pytest
from grpclib.encoding.proto import ProtoCodec

from ibex.assembly.feedback_rules import MAX_FEEDBACK_IDS
from ibex.assembly.validation import MAX_SEARCH_CATEGORIES, MAX_SEARCH_TAGS
from ibex.testing.grpc_harness import AGENT, ORG, SERVICE, RunningDaemon, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2

MANY = 2_090_000  # empty elements of two bytes each: a request just under 4 MiB


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field (numbers below 16, payloads below 128 bytes)."""
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


IDS = ld(1, AGENT.encode()) + ld(2, ORG.encode())


@contextlib.contextmanager
def decoded_sizes() -> Iterator[list[int]]:
    """The size of every request message the daemon's codec decodes meanwhile."""
    sizes: list[int] = []
    original = ProtoCodec.decode

    def decode(self: ProtoCodec, data: bytes, message_type: Any) -> Any:
        sizes.append(len(data))
        return original(self, data, message_type)

    with mock.patch.object(ProtoCodec, "decode", decode):
        yield sizes


def call_raw(daemon: RunningDaemon, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    with daemon.channel() as channel:
        rpc = channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            rpc(body, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("method", "body", "details"),
    [
        ("AssembleContext", IDS + ld(8, b"") * MANY, "recent_messages: more than 512 messages"),
        ("AssembleContext", IDS + ld(14, b"") * MANY, "tool_schemas: more than 128 entries"),
        (
            "SearchMemories",
            IDS + ld(3, b"deploy") + ld(6, b"") * MANY,
            f"categories: more than {MAX_SEARCH_CATEGORIES} entries",
        ),
        (
            "SearchMemories",
            IDS + ld(3, b"deploy") + ld(7, b"") * MANY,
            f"tags: more than {MAX_SEARCH_TAGS} entries",
        ),
        (
            "RecordMemoryFeedback",
            ld(4, ORG.encode()) + ld(5, b"positive") + ld(1, b"") * MANY,
            f"memory_ids: more than {MAX_FEEDBACK_IDS} ids",
        ),
        # Millions of fields that are no repeated field's elements: one message's content.
        (
            "AssembleContext",
            IDS + bytes([8 << 3 | 2]) + varint(2 * MANY) + ld(2, b"") * MANY,
            "request: more than ",
        ),
    ],
    ids=["recent_messages", "tool_schemas", "categories", "tags", "memory_ids", "nested fields"],
)
async def test_an_over_count_request_is_refused_before_it_is_decoded(
    method: str, body: bytes, details: str
) -> None:
    assert len(body) < 4 * 1024 * 1024
    async with running_daemon() as d:
        with decoded_sizes() as sizes:
            code, got = await in_thread(call_raw, d, method, body)
            assert (code, got[: len(details)]) == (grpc.StatusCode.INVALID_ARGUMENT, details)
            assert sizes == []  # never decoded
            # The daemon serves the next call as usual.
            ok = context_pb2.AssembleContextRequest(
                org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
            )
            assert await in_thread(call_raw, d, "AssembleContext", ok.SerializeToString()) == (
                grpc.StatusCode.OK,
                "",
            )
            assert sizes == [len(ok.SerializeToString())]


@pytest.mark.parametrize("field", ["categories", "tags"])
async def test_search_filters_have_a_bound(field: str) -> None:
    """One past the bound, in a small request: refused, naming the field and the limit."""
    request = context_pb2.SearchMemoriesRequest(
        org_id=ORG, agent_id=AGENT, query="deploy", **{field: ["x"] * 65}
    )
    async with running_daemon() as d:
        code, details = await in_thread(call_raw, d, "SearchMemories", request.SerializeToString())
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, f"{field}: more than 64 entries")
