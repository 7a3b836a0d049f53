"""The synthetic assembly run before serving (`ibex.service.warmup`).

It must go through the real assembler and pipeline (so first-call costs are
paid) for every tokenizer family, and touch none of the process's sources:
nothing read from Redis or the memory service, no feedback written.
"""

from __future__ import annotations

import logging

import pytest

from ibex.assembly.structs import Directive, MemoryHit
from ibex.config import Settings
from ibex.service.assembler import Assembler
from ibex.service.root import load_static
from ibex.service.warmup import warm_pipeline
from ibex.sources.retrieval import RetrievalConfig


class Untouchable:
    """A directive and memory source (and feedback sink) that fails the test if used."""

    calls: list[str]

    def __init__(self) -> None:
        self.calls = []

    async def get_directive(self, org_id: str, agent_id: str, version: str = "") -> Directive:
        self.calls.append("directive")
        raise AssertionError("the warm-up read a directive")

    async def hot(self, *args: object, **kwargs: object) -> list[MemoryHit]:
        self.calls.append("hot")
        raise AssertionError("the warm-up called the memory service")

    async def cold(self, *args: object, **kwargs: object) -> list[MemoryHit]:
        self.calls.append("cold")
        raise AssertionError("the warm-up called the memory service")

    async def feedback(self, *args: object, **kwargs: object) -> list[object]:
        self.calls.append("feedback")
        raise AssertionError("the warm-up wrote feedback")

    async def aclose(self) -> None:
        return None


def untouchable_assembler(source: Untouchable, **kw: object) -> Assembler:
    """The real assembler, with the bundled catalog and tokenizers, over `source`."""
    catalog, tokenizers = load_static(Settings())
    return Assembler(
        catalog=catalog,
        tokenizers=tokenizers,
        directive_source=source,
        memory_source=source,
        feedback_sink=source,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


async def test_the_warm_up_assembles_every_family_and_touches_no_source(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Untouchable()
    assembler = untouchable_assembler(source)
    catalog = assembler.catalog
    assembled: list[tuple[str, str, int, tuple[str, ...]]] = []
    real = Assembler.assemble_checked

    async def spy(self: Assembler, request, **kw):  # type: ignore[no-untyped-def]
        result = await real(self, request, **kw)
        statuses = tuple(b.status for b in result.branches)
        assembled.append(
            (request.model, result.degradation_level, len(result.memories_used), statuses)
        )
        return result

    monkeypatch.setattr(Assembler, "assemble_checked", spy)
    caplog.set_level(logging.INFO)
    await warm_pipeline(assembler)

    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert source.calls == []
    assert assembler.directive_source is source and assembler.memory_source is source
    families = {catalog.models[model].tokenizer_family for model, *_ in assembled}
    assert families == {cap.tokenizer_family for cap in catalog.models.values()}
    for _model, level, memories, statuses in assembled:
        assert (level, statuses) == ("L0", ("success", "success", "success"))
        assert memories > 0


async def test_the_warm_up_runs_every_branch_to_success_whatever_the_configured_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Budgets far below any first-use cost: the warm-up still exercises every branch's
    success path (a timed-out branch would leave its decoding unwarmed), and the
    serving assembler keeps its own budgets."""
    tiny = RetrievalConfig(
        timeout=1e-6, deadline=1e-6, directive_timeout=1e-6, hot_timeout=1e-6, cold_timeout=1e-6
    )
    assembler = untouchable_assembler(Untouchable(), retrieval=tiny)
    statuses: list[tuple[str, ...]] = []
    real = Assembler.assemble_checked

    async def spy(self: Assembler, request, **kw):  # type: ignore[no-untyped-def]
        result = await real(self, request, **kw)
        statuses.append(tuple(b.status for b in result.branches))
        return result

    monkeypatch.setattr(Assembler, "assemble_checked", spy)
    await warm_pipeline(assembler)

    assert statuses and all(s == ("success", "success", "success") for s in statuses)
    assert assembler.retrieval == tiny
