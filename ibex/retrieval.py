"""Concurrent retrieval: one Trio nursery per request, one branch per source.

Each branch runs under its own `move_on_after`, created inside the branch's
task so its clock starts when the branch does; the nursery itself runs under
the request's wall. A branch never raises: it ends as success, timeout, error
or skipped, and whatever finished before the wall is kept. When this function
returns, every task it started has ended and every socket lease is returned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from ibex.config import Settings
from ibex.sources.base import DirectiveSource, MemorySource, SourceError
from ibex.structs import AssemblyRequest, BranchOutcome, BranchSource, Directive, MemoryHit

log = logging.getLogger("ibex.retrieval")

BRANCH_ORDER: tuple[BranchSource, ...] = ("directive", "hot", "cold")


class Retrieved(msgspec.Struct, frozen=True):
    directive: Directive | None
    hot: tuple[MemoryHit, ...]
    cold: tuple[MemoryHit, ...]
    branches: tuple[BranchOutcome, ...]
    elapsed_ms: float
    wall_s: float


def request_wall(settings: Settings, deadline: float | None) -> float:
    """min(TIMEOUT, DEADLINE_MS, caller's remaining time - pipeline headroom), >= 0.

    `deadline` is absolute on the Trio clock (trio.current_time()).
    """
    wall = settings.wall
    if deadline is not None and math.isfinite(deadline):
        wall = min(wall, deadline - trio.current_time() - settings.pipeline_headroom)
    return max(0.0, wall)


async def retrieve(
    request: AssemblyRequest,
    *,
    directive_source: DirectiveSource | None,
    memory_source: MemorySource | None,
    settings: Settings,
    deadline: float | None = None,
) -> Retrieved:
    """Run the three branches concurrently within the request's wall."""
    opts = request.options
    outcomes: dict[BranchSource, BranchOutcome] = {}
    values: dict[BranchSource, Any] = {}
    started = trio.current_time()
    wall = request_wall(settings, deadline)

    async def branch(
        source: BranchSource, limit_s: float, call: Callable[[], Awaitable[Any]]
    ) -> None:
        t0 = trio.current_time()
        status: str = "success"
        detail = ""
        with trio.move_on_after(limit_s) as scope:
            try:
                values[source] = await call()
            except SourceError as exc:
                status, detail = "error", str(exc)[:200]
            except Exception as exc:  # a bug or an unexpected library error: contain it
                status, detail = "error", f"unexpected {type(exc).__name__}"
                log.exception("branch_unexpected_error", extra={"branch": source})
        if scope.cancelled_caught:
            status, detail = "timeout", f"no answer within {limit_s * 1000:.0f}ms"
        latency = (trio.current_time() - t0) * 1000.0
        outcomes[source] = BranchOutcome(source, status, latency, detail)  # type: ignore[arg-type]

    def skipped(source: BranchSource, why: str) -> None:
        outcomes[source] = BranchOutcome(source, "skipped", 0.0, why)

    with trio.move_on_after(wall):
        async with trio.open_nursery() as nursery:
            if directive_source is None:
                skipped("directive", "no directive source configured")
            else:
                src = directive_source
                nursery.start_soon(
                    branch,
                    "directive",
                    settings.directive_timeout,
                    lambda: src.get_directive(request.org_id, request.agent_id),
                )
            if memory_source is None:
                skipped("hot", "no memory source configured")
                skipped("cold", "no memory source configured")
            else:
                mem = memory_source
                if opts.skip_hot_memories:
                    skipped("hot", "skip_hot_memories")
                else:
                    nursery.start_soon(
                        branch,
                        "hot",
                        settings.hot_timeout,
                        lambda: mem.hot(
                            request.org_id,
                            request.agent_id,
                            limit=settings.hot_limit,
                            min_confidence=settings.min_confidence,
                        ),
                    )
                if opts.skip_cold_memories:
                    skipped("cold", "skip_cold_memories")
                elif not request.query.strip():
                    skipped("cold", "empty query")
                else:
                    nursery.start_soon(
                        branch,
                        "cold",
                        settings.cold_timeout,
                        lambda: mem.cold(
                            request.org_id,
                            request.agent_id,
                            request.query,
                            limit=settings.cold_limit,
                            min_confidence=settings.min_confidence,
                        ),
                    )

    now = trio.current_time()
    elapsed = (now - started) * 1000.0
    source: BranchSource
    for source in BRANCH_ORDER:
        if source not in outcomes:
            # Cancelled by the request wall rather than by its own timeout.
            outcomes[source] = BranchOutcome(
                source, "timeout", elapsed, f"request wall of {wall * 1000:.0f}ms reached"
            )
            values.pop(source, None)
    for mem_source in ("hot", "cold"):
        if outcomes[mem_source].status != "success":
            values.pop(mem_source, None)
    directive = values.get("directive") if outcomes["directive"].status == "success" else None
    expected = request.directive_version_id
    if directive is not None and expected and (directive.version_id or "").lower() != expected:
        # The cache holds another version than the caller expects (a fill in flight,
        # or a stale proxy): serve what is cached, and say so where it is logged.
        found = directive.version_id or "none"
        outcomes["directive"] = msgspec.structs.replace(
            outcomes["directive"], detail=f"version {found} cached, {expected} expected"
        )
    return Retrieved(
        directive=directive,
        hot=tuple(values.get("hot", ())),
        cold=tuple(values.get("cold", ())),
        branches=tuple(outcomes[s] for s in BRANCH_ORDER),
        elapsed_ms=elapsed,
        wall_s=wall,
    )
