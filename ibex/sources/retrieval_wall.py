"""The retrieval wall's hand-over: an answer made before the wall, or fixed at it.

`retrieve` (ibex.sources.retrieval) runs a call's branches under the wall; with a
`WallListener` it builds a `Wall`, which lets the listener make the answer just
before the wall and hands it the answer the moment the wall cuts a branch, while
the cut branches still unwind.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from ibex.assembly.structs import AssemblyRequest, BranchOutcome, BranchSource
from ibex.sources.retrieved import BRANCH_ORDER, Retrieved, collected

__all__ = ["Wall", "WallListener"]


class WallListener(Protocol):
    """Told when a call's answer can be made before its wall and when the wall cuts it.

    Once every branch but the one in the request's own task (the last, usually cold)
    has ended and that one still runs `ahead` seconds before the wall, `before_wall`
    gets what retrieval would return if the wall cut it then. When the wall cuts any
    branch, `wall_reached` gets what retrieval returns, once, in the first task the
    wall's cancellation reaches (before the cut branches have unwound). Both run
    synchronously in the loop, inside retrieval, and must not raise. `ahead` is read
    once per call; None: nothing is made before the wall, and no branch task waits
    for it (a task that waits is woken once more when the last branch lands in time).
    """

    ahead: float | None

    def before_wall(self, got: Retrieved) -> None:
        """The last branch is still running `ahead` before the wall."""

    def wall_reached(self, got: Retrieved) -> None:
        """The wall has cut a branch: `got` is what `retrieve` returns."""


class Wall:
    """One call's view of its wall for a `WallListener`.

    The branch that ends last among the others' tasks waits in its task for the
    wall (or for the request's own branch to end, which cancels `scope`), so no
    task is started for it. At the wall, the first task its cancellation reaches
    (that waiting task, or a cut branch's as it unwinds) fixes what retrieval
    returns and tells the listener (`reached`): the answer need not wait for the
    other cut branches to unwind, nor for the nursery to close.
    """

    __slots__ = (
        "children",
        "cut",
        "last",
        "listener",
        "outcomes",
        "request",
        "scope",
        "started",
        "values",
        "wall",
        "wall_scope",
    )

    def __init__(
        self,
        listener: WallListener,
        request: AssemblyRequest,
        outcomes: dict[BranchSource, BranchOutcome],
        values: dict[BranchSource, Any],
        last: BranchSource,
        children: int,
        started: float,
        wall_scope: trio.CancelScope,
        time_left: float,
    ) -> None:
        self.listener, self.request = listener, request
        self.outcomes, self.values = outcomes, values
        self.last, self.children = last, children
        self.started, self.wall_scope, self.wall = started, wall_scope, time_left
        # The waiting task's scope, cancelled when the request's own branch ends; none
        # when nothing is made before the wall (no task waits).
        self.scope = trio.CancelScope() if listener.ahead is not None else None
        self.cut: Retrieved | None = None  # what was handed over at the wall

    async def reached(self, own: BranchSource | None) -> None:
        """In a task the wall's cancellation reached (`own`: its branch, None for the
        waiting task): the first such call, with a branch still running, fixes what
        `retrieve` returns and tells the listener. Not for a cancellation of the
        caller's (the wall's scope was not cancelled).

        When a branch of the others' tasks is still out, its task may be runnable in
        this very pass with its answer in hand (the loop read its reply as the wall
        fell due): one shielded pass lets it record that answer before the answer is
        fixed. The request's own branch (`last`) is not waited for: it is the one the
        wall usually cuts, and the hand-over at once is what the waiting task is for.
        """
        if self.cut is not None or not self.wall_scope.cancel_called:
            return
        if any(s not in self.outcomes and s != own and s != self.last for s in BRANCH_ORDER):
            with trio.CancelScope(shield=True):
                await trio.lowlevel.checkpoint()
            if self.cut is not None:
                return
        if len(self.outcomes) < len(BRANCH_ORDER):
            self.cut = collected(self.request, self.outcomes, self.values, self.started, self.wall)
            self.listener.wall_reached(self.cut)

    async def wait(self) -> None:
        """In the task of a branch that has ended: when it is the last of the others'
        tasks and the request's branch still runs, wait there for the wall."""
        self.children -= 1
        ahead, scope = self.listener.ahead, self.scope
        if self.children or self.last in self.outcomes or ahead is None or scope is None:
            return
        listener = self.listener
        with scope:
            try:
                await trio.sleep_until(self.wall_scope.deadline - ahead)
                listener.before_wall(
                    collected(self.request, self.outcomes, self.values, self.started, self.wall)
                )
                await trio.sleep_forever()
            except trio.Cancelled:
                # The wall (not the request's own branch ending, nor the caller going):
                # the answer can leave now, while the cut branch unwinds.
                await self.reached(None)
                raise
