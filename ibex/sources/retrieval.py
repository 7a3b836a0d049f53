"""Concurrent retrieval: one Trio nursery per request, one branch per source.

Each branch runs under its own `move_on_after`, created when the branch
starts so its clock starts when the branch does (the last branch runs in the
request's own task, the others in tasks of their own); the nursery itself
runs under the call's retrieval time limit, the contract's retrieval wall
(`retrieval_time_left`). A branch never raises: it ends as success, timeout,
error or skipped, and whatever finished within the limit is kept. When
`retrieve` returns, every task it started has ended and every socket lease is
returned.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import trio

from ibex.assembly.structs import (
    AssemblyRequest,
    BranchOutcome,
    BranchSource,
    BranchStatus,
    MemoryHit,
)
from ibex.errors import SourceError
from ibex.sources.base import (
    Answer,
    DirectiveAnswer,
    DirectiveSource,
    MemorySource,
    cached_directive,
)
from ibex.sources.retrieval_config import RetrievalConfig as RetrievalConfig
from ibex.sources.retrieval_wall import Wall, WallListener
from ibex.sources.retrieved import Retrieved, collected

log = logging.getLogger(__name__)

_DETAIL_MAX = 200


class BranchListener(Protocol):
    """Told each branch's answer as soon as it is known, so the pipeline's work can
    start before the last branch ends.

    Both methods run synchronously in the loop, inside retrieval, and must not
    raise. `value` is the branch's answer when it succeeded, else None.
    """

    def answered_at_start(self, source: BranchSource, value: Any) -> None:
        """Known before any branch started (an in-memory answer, a skipped branch):
        nothing has been sent yet, so record it and do no work now."""

    def branch_ended(self, source: BranchSource, value: Any) -> None:
        """A running branch has ended; the others may still be in flight."""


class _Branch(msgspec.Struct, frozen=True):
    """One row of the branch table: a call to run, or the reason it is skipped."""

    source: BranchSource
    timeout: float
    call: Callable[[], Awaitable[Any]] | None
    skipped: str = ""
    ready: DirectiveAnswer | None = None  # answered already (a source's `cached`): no task to run


def retrieval_time_left(
    config: RetrievalConfig, deadline: float | None, arrived: float | None = None
) -> float:
    """Seconds of retrieval left now, >= 0.

    The time limit (min(TIMEOUT, DEADLINE_MS)) counted from the call's arrival, not
    from when its retrieval started: time it waited before (reading, admission, a
    slot) is time the caller waited too, so the answer still leaves on time. A call
    that waited that long still gets the hot branch's own timeout, so a congested
    moment does not turn answers memory-less. Never past the caller's deadline
    less the pipeline headroom. `deadline` and `arrived` are on the Trio clock.
    """
    now = trio.current_time()
    left = config.time_limit
    if arrived is not None and arrived < now:
        left = max(left - (now - arrived), min(left, config.hot_timeout))
    return max(0.0, min(left, before_deadline(config, deadline, now)))


def before_deadline(config: RetrievalConfig, deadline: float | None, now: float) -> float:
    """Seconds from `now` to the caller's deadline less the pipeline headroom (the time
    kept back to build and send the answer); inf without a deadline. May be negative."""
    if deadline is None or not math.isfinite(deadline):
        return math.inf
    return deadline - now - config.pipeline_headroom


async def cold_search(
    memory_source: MemorySource,
    org_id: str,
    agent_id: str,
    query: str,
    *,
    limit: int,
    config: RetrievalConfig,
    deadline: float | None = None,
) -> list[MemoryHit]:
    """The cold branch's call alone, for SearchMemories: one semantic search of the
    memory source within the cold timeout and the deadline, the hits as the source
    gave them (`Assembler.search` filters and ranks them).

    Unlike a branch, a failure is the call's failure: SourceError names why.
    `deadline` is on the Trio clock.
    """
    timeout = max(
        0.0, min(config.cold_timeout, before_deadline(config, deadline, trio.current_time()))
    )
    with trio.move_on_after(timeout):
        try:
            return await memory_source.cold(
                org_id, agent_id, query, limit=limit, min_confidence=config.min_confidence
            )
        except SourceError as exc:
            raise SourceError(f"memory search failed: {exc}") from None
    raise SourceError(f"memory search failed: no answer within {timeout * 1000:.0f}ms")


def _branches(
    request: AssemblyRequest,
    directive_source: DirectiveSource | None,
    memory_source: MemorySource | None,
    config: RetrievalConfig,
) -> list[_Branch]:
    org, agent, opts = request.org_id, request.agent_id, request.options
    rows: list[_Branch] = []
    if directive_source is None:
        rows.append(_Branch("directive", 0.0, None, "no directive source configured"))
    else:
        src, version = directive_source, request.directive_version_id
        hit = cached_directive(src, org, agent, version)
        call: Callable[[], Awaitable[Any]] | None = (
            None if hit is not None else (lambda: _directive(src, org, agent, version))
        )
        rows.append(_Branch("directive", config.directive_timeout, call, ready=hit))
    mem, floor = memory_source, config.min_confidence
    if mem is None:
        rows.append(_Branch("hot", 0.0, None, "no memory source configured"))
        rows.append(_Branch("cold", 0.0, None, "no memory source configured"))
        return rows
    if opts.skip_hot_memories:
        rows.append(_Branch("hot", 0.0, None, "skip_hot_memories"))
    else:
        rows.append(
            _Branch(
                "hot",
                config.hot_timeout,
                lambda: mem.hot(org, agent, limit=config.hot_limit, min_confidence=floor),
            )
        )
    if opts.skip_cold_memories or not request.query.strip():
        why = "skip_cold_memories" if opts.skip_cold_memories else "empty query"
        rows.append(_Branch("cold", 0.0, None, why))
    else:
        rows.append(
            _Branch(
                "cold",
                config.cold_timeout,
                lambda: mem.cold(
                    org, agent, request.query, limit=config.cold_limit, min_confidence=floor
                ),
            )
        )
    return rows


async def _directive(src: DirectiveSource, org: str, agent: str, version: str) -> DirectiveAnswer:
    """The directive branch's call. The source's in-memory answer is asked for again
    when the branch starts: another request may have filled it meanwhile."""
    hit = cached_directive(src, org, agent, version)
    return hit if hit is not None else Answer(await src.get_directive(org, agent, version))


async def _run_branch(
    row: _Branch,
    outcomes: dict[BranchSource, BranchOutcome],
    values: dict[BranchSource, Any],
    starts: dict[BranchSource, float] | None = None,
    listener: BranchListener | None = None,
    wall: Wall | None = None,
) -> None:
    assert row.call is not None
    t0 = trio.current_time()
    if starts is not None:
        starts[row.source] = t0
    status: BranchStatus = "success"
    detail = ""
    with trio.move_on_after(row.timeout) as scope:
        try:
            value = await row.call()
            if isinstance(value, Answer):
                value, detail = value.value, value.detail
            values[row.source] = value
        except trio.Cancelled:
            if wall is not None:
                # Cut by the wall: the answer need not wait for the unwinding.
                await wall.reached(row.source)
            raise
        except SourceError as exc:
            status, detail = "error", str(exc)[:_DETAIL_MAX]
        except (Exception, asyncio.CancelledError) as exc:
            # A bug or an unexpected library error: contain it. An asyncio.CancelledError
            # reaching Trio code is never this task's cancellation (trio-asyncio turns
            # that into trio.Cancelled): it is an asyncio library's own, raised through.
            status, detail = "error", f"unexpected {type(exc).__name__}"
            log.exception("branch_unexpected_error", extra={"branch": row.source})
    if scope.cancelled_caught:
        status, detail = "timeout", f"no answer within {row.timeout * 1000:.0f}ms"
    latency = (trio.current_time() - t0) * 1000.0
    outcomes[row.source] = BranchOutcome(row.source, status, latency, detail)
    if listener is not None and (wall is None or wall.cut is None):
        # (Once the answer was fixed at the wall, a branch that ends is not part of it.)
        listener.branch_ended(row.source, values.get(row.source) if status == "success" else None)


async def retrieve(
    request: AssemblyRequest,
    *,
    directive_source: DirectiveSource | None,
    memory_source: MemorySource | None,
    config: RetrievalConfig,
    deadline: float | None = None,
    arrived: float | None = None,
    branch_starts: dict[BranchSource, float] | None = None,
    listener: BranchListener | None = None,
    wall_listener: WallListener | None = None,
) -> Retrieved:
    """Run the branch table concurrently within the call's retrieval time
    (`retrieval_time_left`).

    `branch_starts`, when given (a traced call), receives each started branch's start
    time on the Trio clock. `listener`, when given, is told each branch's answer as
    soon as it is known (a branch cut by the time limit, or one that ends after the
    answer was fixed at the wall, is never reported). `wall_listener`, when given,
    is told when the answer can be made before the wall and when the wall cuts a
    branch (`WallListener`); a call it was told was cut returns exactly what it was
    told.
    """
    outcomes: dict[BranchSource, BranchOutcome] = {}
    values: dict[BranchSource, Any] = {}
    started = trio.current_time()
    time_left = retrieval_time_left(config, deadline, arrived)
    rows = _branches(request, directive_source, memory_source, config)
    calls = []
    for row in rows:
        if row.ready is not None:
            values[row.source] = row.ready.value
            outcomes[row.source] = BranchOutcome(row.source, "success", 0.0, row.ready.detail)
            if listener is not None:
                listener.answered_at_start(row.source, row.ready.value)
        elif row.call is None:
            outcomes[row.source] = BranchOutcome(row.source, "skipped", 0.0, row.skipped)
            if listener is not None:
                listener.answered_at_start(row.source, None)
        else:
            calls.append(row)
    wall_scope = trio.CancelScope(deadline=trio.current_time() + time_left)
    wall = None
    if wall_listener is not None and calls:
        last = calls[-1].source
        wall = Wall(
            wall_listener,
            request,
            outcomes,
            values,
            last,
            len(calls) - 1,
            started,
            wall_scope,
            time_left,
        )
    with wall_scope:
        async with trio.open_nursery() as nursery:
            for row in calls[:-1]:
                nursery.start_soon(_run_child, row, outcomes, values, branch_starts, listener, wall)
            if calls:
                # The last branch (cold, usually the slowest) runs in this task: its answer
                # then wakes the request directly instead of a branch task that wakes the
                # request, one task and one task step less per answer.
                await _run_branch(calls[-1], outcomes, values, branch_starts, listener, wall)
                if wall is not None and wall.scope is not None:
                    wall.scope.cancel()  # it ended before the wall: nothing to wait for
    if wall is not None and wall.cut is not None:
        return wall.cut  # what was handed over at the wall is what the call returns
    return collected(request, outcomes, values, started, time_left)


async def _run_child(
    row: _Branch,
    outcomes: dict[BranchSource, BranchOutcome],
    values: dict[BranchSource, Any],
    starts: dict[BranchSource, float] | None,
    listener: BranchListener | None,
    wall: Wall | None,
) -> None:
    """A branch in a task of its own; with a `Wall`, the last of them waits for the wall."""
    await _run_branch(row, outcomes, values, starts, listener, wall)
    if wall is not None and wall.scope is not None:
        await wall.wait()
