"""Large assemblies count in a worker thread, so one call cannot hold the loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
import trio.lowlevel

import ibex.service.assembler as assembler_module
from ibex.assembly.structs import AssemblyRequest, Message
from ibex.config import Settings
from ibex.service.root import open_assembler
from ibex.testing.samples import AGENT, ORG


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = assembler_module.assemble_pure

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(assembler_module, "assemble_pure", recording)
    return seen


def request(history_chars: int) -> AssemblyRequest:
    text = "長い履歴のテキスト" * (history_chars // 9 + 1)
    return AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="deploy on Friday?",
        model="gpt-4o",
        recent_messages=(Message("user", text[:history_chars]),),
    )


async def test_small_assemblies_stay_on_the_loop_and_large_ones_do_not(
    threads: list[int],
) -> None:
    loop_thread = threading.get_ident()
    async with open_assembler(Settings()) as assembler:
        with trio.fail_after(30):
            small = await assembler.assemble(request(100))
            large = await assembler.assemble(request(4 * assembler.offload_chars))
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread
    # Same pipeline either way: the large one is a full, exact answer too.
    assert small.tokens_used <= small.budget.ceiling
    assert large.tokens_used <= large.budget.ceiling
    assert large.history_tokens > small.history_tokens


async def test_the_loop_keeps_running_while_a_large_assembly_counts(threads: list[int]) -> None:
    """While the worker thread counts, loop tasks keep being scheduled (no wall-clock bound:
    the loop makes progress at all, which it cannot while the count runs on it)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with open_assembler(Settings()) as assembler, trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        before = ticks
        with trio.fail_after(60):
            await assembler.assemble(request(6 * assembler.offload_chars))
        during = ticks - before
        nursery.cancel_scope.cancel()
    assert during > 10
