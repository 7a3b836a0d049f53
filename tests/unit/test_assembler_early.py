"""The assembler's early work: what it does as branches land, and what it leaves alone.

In-process sources on Trio's mock clock: the directive is answered from memory,
hot lands after 1 ms, cold hangs past the wall. The pipeline is watched for the
`EarlyAssembly` it is handed.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

import ibex.service.assembler as assembler_module
from ibex.assembly.catalog import load_catalog
from ibex.assembly.prepare import EarlyAssembly
from ibex.assembly.structs import AssemblyRequest, Directive, MemoryHit, Message
from ibex.assembly.tokens import Tokenizers
from ibex.service.assembler import Assembler
from ibex.sources.base import Answer, DirectiveAnswer
from ibex.sources.retrieval import RetrievalConfig
from ibex.testing.samples import AGENT, ORG

DIRECTIVE = Directive("Answer briefly and cite the runbook step.")
OFFLOAD = 4000
WALL_50MS = RetrievalConfig(timeout=0.05, deadline=0.05, cold_timeout=1.0)


class CachedDirective:
    def cached(self, org_id: str, agent_id: str, version: str) -> DirectiveAnswer:
        return Answer(DIRECTIVE, "cache")

    async def get_directive(self, org_id: str, agent_id: str, version: str = "") -> Directive:
        return DIRECTIVE

    async def aclose(self) -> None:
        pass


class HotThenHang:
    def __init__(self, content: str, n: int = 3) -> None:
        self.hits = [
            MemoryHit(
                memory_id=f"00000000-0000-4000-8000-00000000000{i}",
                org_id=ORG,
                agent_id=AGENT,
                content=content,
                category="factual",
                confidence=0.9,
                similarity=0.5,
                rank=i + 1,
                branch="hot",
            )
            for i in range(n)
        ]

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.sleep(0.001)
        return list(self.hits)

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.sleep(10)
        return []

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    tk = Tokenizers(None, 4096)
    tk.preload(["o200k_base"])
    return tk


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[EarlyAssembly | None]:
    seen: list[EarlyAssembly | None] = []
    real = assembler_module.assemble_pure

    def watching(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("early"))
        return real(*args, **kwargs)

    monkeypatch.setattr(assembler_module, "assemble_pure", watching)
    return seen


def assembler(
    tokenizers: Tokenizers,
    memory: HotThenHang,
    retrieval: RetrievalConfig = WALL_50MS,
    **options: Any,
) -> Assembler:
    return Assembler(
        catalog=load_catalog(),
        tokenizers=tokenizers,
        directive_source=CachedDirective(),
        memory_source=memory,
        retrieval=retrieval,
        offload_chars=OFFLOAD,
        **options,
    )


def request(history: str = "Which environment failed?") -> AssemblyRequest:
    return AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="deploy?",
        model="gpt-4o",
        recent_messages=(Message("user", history),),
    )


async def test_the_directive_and_hot_are_prepared_while_cold_hangs(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    handed: list[EarlyAssembly | None],
) -> None:
    result = await assembler(tokenizers, HotThenHang("Deploys go out on Tuesdays.")).assemble(
        request()
    )
    assert result.degradation_level == "L1" and len(result.memories_used) == 3
    prepared = handed[-1]
    assert prepared is not None
    assert prepared.fixed_for(DIRECTIVE) is not None
    assert set(prepared.candidates) == {"hot"}


async def test_memories_past_the_loop_budget_are_left_to_the_pipeline(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    handed: list[EarlyAssembly | None],
) -> None:
    """Hot answers more text than the loop may count for one call: the loop prepares
    the fixed sections only, the pipeline (in a worker thread) does the memories."""
    big = HotThenHang("Rotate the signing key only after publishing the JWKS. " * 40)
    result = await assembler(tokenizers, big).assemble(request())
    assert result.degradation_level == "L1" and result.memories_used
    prepared = handed[-1]
    assert prepared is not None
    assert prepared.fixed_for(DIRECTIVE) is not None
    assert prepared.candidates == {}


async def test_a_request_that_goes_to_a_thread_gets_no_early_work(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    handed: list[EarlyAssembly | None],
) -> None:
    result = await assembler(tokenizers, HotThenHang("short")).assemble(
        request("A long history turn. " * (OFFLOAD // 10))
    )
    assert result.memories_used
    assert handed == [None]


async def test_a_failing_early_step_is_dropped_and_the_pipeline_does_it_all(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    handed: list[EarlyAssembly | None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: EarlyAssembly, *args: Any) -> None:
        raise RuntimeError("a bug in the early work")

    monkeypatch.setattr(EarlyAssembly, "hits", broken)
    result = await assembler(tokenizers, HotThenHang("Deploys go out on Tuesdays.")).assemble(
        request()
    )
    assert result.degradation_level == "L1" and len(result.memories_used) == 3
    assert handed == [None]


def untimed(result: Any) -> bytes:
    """The answer on the wire without the stage timings, its branch latencies to the
    microsecond (each run has its own clock: the mock clock's float offsets differ)."""
    import msgspec

    from ibex.assembly.structs import AssemblyMetrics
    from ibex.service import convert

    m = result.metrics
    metrics = AssemblyMetrics(
        directive_load_ms=m.directive_load_ms,
        hot_memory_retrieval_ms=m.hot_memory_retrieval_ms,
        cold_memory_retrieval_ms=m.cold_memory_retrieval_ms,
        candidates_evaluated=m.candidates_evaluated,
    )
    branches = tuple(
        msgspec.structs.replace(b, latency_ms=round(b.latency_ms, 6)) for b in result.branches
    )
    encoded: bytes = convert.response_to_proto(
        msgspec.structs.replace(result, metrics=metrics, branches=branches)
    ).SerializeToString()
    return encoded


async def made_both_ways(
    tokenizers: Tokenizers, memory: HotThenHang, retrieval: RetrievalConfig
) -> dict[float | None, tuple[Any, list[Any]]]:
    """One session call's answer and what was handed over, by `speculate_ahead`: the
    default, with calls being cut (answers made before the wall), and None (the
    pipeline's after retrieval). The same nonce and clock for both."""
    from ibex.assembly.nonce import NonceKey
    from ibex.service.early_feed import SPECULATE_AHEAD

    made: dict[float | None, tuple[Any, list[Any]]] = {}
    for ahead in (SPECULATE_AHEAD, None):
        a = assembler(
            tokenizers,
            memory,
            retrieval,
            nonce_key=NonceKey("k" * 40),
            wall_clock=lambda: 1_800_000_000.0,
            speculate_ahead=ahead,
        )
        req = a.check_request(
            AssemblyRequest(
                agent_id=AGENT, org_id=ORG, query="deploy?", model="gpt-4o", session_id="s-1"
            )
        )
        handed: list[Any] = []
        a.last_cut = trio.current_time()  # calls are being cut
        with trio.fail_after(5):
            made[ahead] = (await a.assemble_checked(req, handoff=handed.append), handed)
    return made


def handed_over_and_identical(
    made: dict[float | None, tuple[Any, list[Any]]], statuses: list[str]
) -> Any:
    """The answer with calls being cut was handed over, the pipeline's was not, both
    encode to the same bytes (timings aside), the branches end as `statuses` and the
    last one was cut at the wall (50 ms on the mock clock). Returns the first answer."""
    from ibex.service.early_feed import SPECULATE_AHEAD

    (cut, cut_handed), (plain, plain_handed) = made[SPECULATE_AHEAD], made[None]
    assert cut_handed == [cut] and cut_handed[0] is cut
    assert plain_handed == []
    assert [b.status for b in cut.branches] == statuses
    assert cut.branches[2].latency_ms == pytest.approx(50.0)
    assert plain.branches[2].latency_ms == pytest.approx(50.0)
    assert untimed(cut) == untimed(plain)
    return cut


async def test_the_answer_made_before_the_wall_is_byte_identical_to_the_one_made_at_it(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cold hangs past the wall, and calls are being cut: the answer made
    `SPECULATE_AHEAD` before it (handed over at the wall) encodes to the same bytes as
    the pipeline's at the wall, timings aside; the branches' latencies are those at the
    wall."""

    monkeypatch.setattr(assembler_module.time, "time", lambda: 1_800_000_000.0)
    memory = HotThenHang("Deploys go through the staging gate first.")
    made = await made_both_ways(tokenizers, memory, WALL_50MS)
    early = handed_over_and_identical(made, ["success", "success", "timeout"])
    assert len(early.memories_used) == 3


async def test_an_answer_not_made_before_the_wall_is_made_and_handed_over_at_it(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hot and cold both hang past the wall, so nothing is made before it: the answer
    is made at the wall and handed over, and encodes to the same bytes as the one the
    pipeline makes after retrieval (no answer made early, nothing handed over)."""

    class BothHang(HotThenHang):
        async def hot(
            self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
        ) -> list[MemoryHit]:
            await trio.sleep(10)
            return []

    monkeypatch.setattr(assembler_module.time, "time", lambda: 1_800_000_000.0)
    hang = RetrievalConfig(timeout=0.05, deadline=0.05, hot_timeout=1.0, cold_timeout=1.0)
    made = await made_both_ways(tokenizers, BothHang("unused"), hang)
    at_wall = handed_over_and_identical(made, ["success", "timeout", "timeout"])
    assert at_wall.branches[1].latency_ms == pytest.approx(50.0)


async def test_an_answer_made_before_the_wall_is_dropped_when_the_last_branch_lands(
    autojump_clock: trio.testing.MockClock, tokenizers: Tokenizers
) -> None:
    """Calls are being cut, and cold lands after the answer was made (between it and
    the wall): nothing is handed over, and the answer has cold's memories."""

    class LateCold(HotThenHang):
        async def cold(
            self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
        ) -> list[MemoryHit]:
            await trio.sleep(0.049)  # after the answer is made (47 ms), before the wall (50)
            return [
                msgspec_replace(h, memory_id=h.memory_id[:-1] + "9", branch="cold")
                for h in self.hits[:1]
            ]

    a = assembler(tokenizers, LateCold("Deploys go through the staging gate first."))
    a.last_cut = trio.current_time()  # calls are being cut: the answer is made before the wall
    handed: list[Any] = []
    with trio.fail_after(5):
        result = await a.assemble_checked(a.check_request(request()), handoff=handed.append)
    assert handed == []
    assert [b.status for b in result.branches] == ["success", "success", "success"]
    assert result.degradation_level == "L0"


def msgspec_replace(hit: MemoryHit, **changes: Any) -> MemoryHit:
    import msgspec

    return msgspec.structs.replace(hit, **changes)


async def test_answers_are_made_before_the_wall_only_while_calls_are_being_cut(
    autojump_clock: trio.testing.MockClock,
    tokenizers: Tokenizers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No call was cut yet: the first cut call's answer is made at its wall (50 ms), and
    handed over; the next call, within `SPECULATE_AFTER_CUT`, has its answer made
    `SPECULATE_AHEAD` before it. Once no call was cut for that long, again at the wall."""
    from ibex.service.early_feed import SPECULATE_AFTER_CUT, SPECULATE_AHEAD

    made_at: list[float] = []
    real = Assembler._speculate

    def timed(self: Assembler, *args: Any) -> Any:
        made_at.append(trio.current_time())
        return real(self, *args)

    monkeypatch.setattr(Assembler, "_speculate", timed)
    a = assembler(tokenizers, HotThenHang("Deploys go through the staging gate first."))
    walls = []
    for pause in (0.0, 0.0, SPECULATE_AFTER_CUT + 0.001):
        await trio.sleep(pause)
        handed: list[Any] = []
        start = trio.current_time()
        walls.append(start + 0.05)
        with trio.fail_after(5):
            result = await a.assemble_checked(a.check_request(request()), handoff=handed.append)
        assert handed == [result]
        assert [b.status for b in result.branches] == ["success", "success", "timeout"]
    assert made_at == pytest.approx([walls[0], walls[1] - SPECULATE_AHEAD, walls[2]])
