"""What retrieval returns: the branches that ended, and every other one cut by the wall.

`collected` is the one place that turns a call's branch outcomes so far into a
`Retrieved`: `retrieve` after its nursery closes, and the wall's hand-over
(`ibex.sources.retrieval_wall`) when it fixes the answer before the cut branches
have unwound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import trio

from ibex.assembly.structs import (
    AssemblyRequest,
    BranchOutcome,
    BranchSource,
    Directive,
    MemoryHit,
)

__all__ = ["BRANCH_ORDER", "Retrieved", "collected"]

BRANCH_ORDER: tuple[BranchSource, ...] = ("directive", "hot", "cold")


class Retrieved(msgspec.Struct, frozen=True):
    directive: Directive | None
    hot: tuple[MemoryHit, ...]
    cold: tuple[MemoryHit, ...]
    branches: tuple[BranchOutcome, ...]
    elapsed_ms: float
    started: float = 0.0  # when retrieval began, on the Trio clock (for trace spans)


def collected(
    request: AssemblyRequest,
    outcomes: Mapping[BranchSource, BranchOutcome],
    values: Mapping[BranchSource, Any],
    started: float,
    time_left: float,
) -> Retrieved:
    """What retrieval returns now: the branches that ended, every other one cut by the wall."""
    elapsed = (trio.current_time() - started) * 1000.0
    ended = dict(outcomes)
    for source in BRANCH_ORDER:
        if source not in ended:
            # Cancelled at the call's time limit (the retrieval wall) rather than by
            # its own timeout.
            ended[source] = BranchOutcome(
                source, "timeout", elapsed, f"request wall of {time_left * 1000:.0f}ms reached"
            )
    kept = {s: v for s, v in values.items() if ended[s].status == "success"}
    directive = kept.get("directive")
    expected = request.directive_version_id
    if directive is not None and expected and (directive.version_id or "").lower() != expected:
        # The cache holds another version than the caller expects (a fill in flight,
        # or a stale proxy): serve what is cached, and say so where it is logged.
        found = directive.version_id or "none"
        ended["directive"] = msgspec.structs.replace(
            ended["directive"], detail=f"version {found} cached, {expected} expected"
        )
    return Retrieved(
        directive=directive,
        hot=tuple(kept.get("hot", ())),
        cold=tuple(kept.get("cold", ())),
        branches=tuple(ended[s] for s in BRANCH_ORDER),
        elapsed_ms=elapsed,
        started=started,
    )
