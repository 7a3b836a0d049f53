"""Memory answers over OFF_LOOP_BYTES are decoded in a worker thread, smaller ones on the loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

import ibex.sources.memory_http as memory_http
import ibex.sources.memory_schema as memory_schema
from ibex.testing.memory_server import (
    FakeMemoryServer,
    make_memories,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.samples import AGENT, ORG
from tests.chaos.test_large_answers import escaped_answer


async def test_large_answers_are_decoded_off_the_loop_and_small_ones_on_it(
    memory_server: FakeMemoryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real = memory_http.decode_hits

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(memory_http, "decode_hits", recording)
    monkeypatch.setattr(memory_schema, "decode_hits", recording)  # small answers: DecodedAnswers
    memory_server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 3))
    big = escaped_answer(ORG, AGENT, results=3, chars=10_000)
    assert len(big) > memory_http.OFF_LOOP_BYTES
    loop_thread = threading.get_ident()
    async with memory_server.source() as source:
        with trio.fail_after(30):
            small = await source.hot(ORG, AGENT, limit=3, min_confidence=0.0)
            memory_server.hot.body = big
            large = await source.hot(ORG, AGENT, limit=3, min_confidence=0.0)
    assert threads[0] == loop_thread and threads[1] != loop_thread
    assert len(small) == 3
    # The same strict decoding either way: three valid memories, contents kept whole.
    assert [len(h.content) for h in large] == [10_000] * 3


async def test_a_large_decode_cut_by_its_timeout_ends_the_call_on_time(
    memory_server: FakeMemoryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch cut mid-decode ends at its timeout: the thread is abandoned, not awaited."""
    release = threading.Event()
    real = memory_http.decode_hits

    def slow(*args: Any, **kwargs: Any) -> Any:
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory_http, "decode_hits", slow)
    memory_server.hot.body = escaped_answer(ORG, AGENT, results=3, chars=10_000)
    async with memory_server.source() as source:
        with trio.fail_after(5):  # far below the 10 s the decode would hold on
            with trio.move_on_after(0.2) as scope:
                await source.hot(ORG, AGENT, limit=3, min_confidence=0.0)
        release.set()
    assert scope.cancelled_caught
