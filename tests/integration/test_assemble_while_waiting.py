"""While the cold branch hangs, the pipeline's work is done before the wall, not after it.

Real redis-server, real loopback memory fake with the cold endpoint hanging, the
daemon's assembler. The pipeline that runs after the wall is watched: it must
count no token, score no hit and price no memory (the fixed sections and the
hot memories were done as their branches landed), leaving only the merge, the
pack and the render. Its answer must equal the pipeline's own on the same
inputs without the early work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import trio

import ibex.service.assembler as assembler_module
from ibex.assembly import pipeline
from ibex.assembly.structs import AssemblyMetrics, AssemblyResult
from ibex.assembly.tokens import TokenCounter
from ibex.testing.memory_server import (
    FakeMemoryServer,
    memory_server_fixture,  # noqa: F401
)
from ibex.testing.redis_server import RedisServer
from tests.integration.test_assemble_real import (
    included_ids,
    make_request,
    open_stack,
    seed_directive,
    seed_tenant,
    statuses,
)

WALL = {
    "DIRECTIVE_TIMEOUT_MS": "2s",
    "HOT_TIMEOUT_MS": "2s",
    "COLD_TIMEOUT_MS": "2s",
    "TIMEOUT": "300ms",
    "DEADLINE_MS": "300",
}


class AfterWall:
    """What the pipeline run after retrieval did: token counts, stage calls, its answer
    compared with the pipeline's own on the same inputs without the early work."""

    def __init__(self) -> None:
        self.inside = False
        self.counts = 0
        self.stages: list[str] = []
        self.plain: list[AssemblyResult] = []


@pytest.fixture
def after_wall(monkeypatch: pytest.MonkeyPatch) -> Iterator[AfterWall]:
    watch = AfterWall()
    real_pure = assembler_module.assemble_pure

    def pure(*args: Any, **kwargs: Any) -> AssemblyResult:
        watch.inside = True
        try:
            result = real_pure(*args, **kwargs)
        finally:
            watch.inside = False
        watch.plain.append(real_pure(*args, **{**kwargs, "early": None, "timer": None}))
        return result

    def counting(name: str) -> Any:
        real = getattr(TokenCounter, name)

        def wrapper(self: TokenCounter, text: str) -> Any:
            watch.counts += watch.inside
            return real(self, text)

        return wrapper

    def stage(name: str, real: Any, *, when_non_empty: int | None = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if watch.inside and (when_non_empty is None or args[when_non_empty]):
                watch.stages.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(assembler_module, "assemble_pure", pure)
    for name in ("count", "peek"):
        monkeypatch.setattr(TokenCounter, name, counting(name))
    monkeypatch.setattr(
        pipeline, "count_fixed_sections", stage("count", pipeline.count_fixed_sections)
    )
    monkeypatch.setattr(pipeline, "price", stage("price", pipeline.price))
    monkeypatch.setattr(
        pipeline,
        "branch_candidates",
        stage("score", pipeline.branch_candidates, when_non_empty=1),
    )
    monkeypatch.setattr(pipeline, "select", stage("select", pipeline.select))
    yield watch


def timeless(result: AssemblyResult) -> AssemblyResult:
    """Without the timings: the answer may be made shortly before the wall (its
    branches' latencies then filled in at the wall)."""
    metrics = AssemblyMetrics(candidates_evaluated=result.metrics.candidates_evaluated)
    branches = tuple(msgspec.structs.replace(b, latency_ms=0.0) for b in result.branches)
    return msgspec.structs.replace(result, metrics=metrics, branches=branches)


@pytest.mark.parametrize("directive_cache", ["0", "64"], ids=["directive-fetched", "cached"])
async def test_after_the_wall_only_the_merge_pack_and_render_remain(
    redis_server: RedisServer,
    memory_server: FakeMemoryServer,
    after_wall: AfterWall,
    directive_cache: str,
) -> None:
    data = seed_tenant(memory_server, "a", seed=7)
    seed_directive(redis_server, "a")
    memory_server.cold.fault = "hang"
    timeouts = {**WALL, "DIRECTIVE_CACHE_ENTRIES": directive_cache}
    async with open_stack(redis_server, memory_server, timeouts) as assembler:
        with trio.fail_after(20):
            # The second call meets a warm directive cache when there is one (its
            # directive is known before any branch starts) and warm count caches.
            for _ in range(2):
                after_wall.counts, after_wall.stages = 0, []
                result = await assembler.assemble(make_request("a"))
                assert statuses(result) == {
                    "directive": "success",
                    "hot": "success",
                    "cold": "timeout",
                }
                assert result.degradation_level == "L1"
                assert included_ids(result) == set(data.hot_ids)
                assert after_wall.stages == []
                assert after_wall.counts == 0
                assert timeless(result) == timeless(after_wall.plain[-1])
