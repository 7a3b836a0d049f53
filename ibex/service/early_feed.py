"""What a call's branches hand to its early assembly as they land, and the wall's answer.

The assembler gives each call one `EarlyAssemblyFeed`: retrieval tells it of every
branch that ends and of the wall, in the loop; it passes the results to the pure
core's `EarlyAssembly` within a character budget, and makes the whole answer before
or at the wall when that lets the call be answered without waiting for a cut branch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ibex.assembly.pipeline import AssemblyInputs
from ibex.assembly.prepare import EarlyAssembly, Speculation
from ibex.assembly.structs import (
    AssemblyRequest,
    AssemblyResult,
    BranchSource,
    Directive,
    MemoryHit,
)
from ibex.errors import IbexError
from ibex.sources.retrieved import Retrieved

log = logging.getLogger(__name__)

# Text (characters) above which an assembly's counting runs in a worker thread, so
# no one call holds the loop for more than a few milliseconds: uncached tiktoken
# counts of CJK text run at thousands of characters per millisecond
# (`python -m benchmarks.code_costs`, docs/performance.md).
OFFLOAD_CHARS = 16 * 1024

# Seconds before the wall at which a call whose last branch still runs has its answer
# made as if the wall will cut that branch: more than the pipeline takes on a loaded
# loop (`python -m benchmarks.load.after_wall`, docs/performance.md), so the answer is
# ready when the wall passes; the branch still has until the wall to land.
SPECULATE_AHEAD = 0.003
# Seconds after a call of this process was cut at its wall (one whose answer was handed
# over there: `Assembler.last_cut`, so not a traced or thread-held call's) during which
# calls make their answer before the wall. Waiting for that instant keeps a branch task
# parked, woken once more to end when the last branch lands in time; while no call is
# cut, the few that are get their answer made at the wall instead
# (`EarlyAssemblyFeed.wall_reached`).
SPECULATE_AFTER_CUT = 2.0

Handoff = Callable[[AssemblyResult], None]


def request_chars(request: AssemblyRequest) -> int:
    """Characters of the request's own text (known before retrieval)."""
    n = len(request.query) + sum(len(m.content) for m in request.recent_messages)
    return n + sum(len(t) for t in request.tool_schemas)


def text_chars(inputs: AssemblyInputs) -> int:
    """Characters the pipeline may have to count for these inputs."""
    n = request_chars(inputs.request)
    if inputs.directive is not None:
        n += len(inputs.directive.content)
    return n + sum(len(h.content) for h in inputs.hot) + sum(len(h.content) for h in inputs.cold)


class EarlyAssemblyFeed:
    """Hands each branch that ends to the call's `EarlyAssembly` (a `BranchListener`).

    In the loop, synchronously, and bounded: the text handed to the early work
    stays within `budget` characters in all (what the loop may count for one
    call, `offload_chars`, less the request's own text), so it never holds the
    loop longer than a call whose whole pipeline runs on it. Past the budget,
    the rest is left to the pipeline (which then runs in a worker thread).
    An answer known before the branches started (a cached directive) is worked
    on when the first branch ends, so no branch starts later for it. Any failure but
    a kept refusal drops the early work: the pipeline then does it all itself.

    It is also the call's `WallListener` when `speculate` is given: while calls are
    being cut (`SPECULATE_AFTER_CUT`), `ahead` (`SPECULATE_AHEAD`) before the wall,
    with only the request's own branch still running, it makes the whole answer as
    if the wall will cut that branch (within the same budget); when the wall does,
    that answer (its timing facts filled in) is the call's, handed to `handoff` at
    once, while the cut branch unwinds. When the wall cuts a call that has no such
    answer (no call was cut shortly before, or another branch was still running
    before the wall), the first task the wall reaches makes it then, if the
    pipeline would run in the loop anyway, and hands it over the same way.
    """

    __slots__ = (
        "ahead",
        "answer",
        "assembly",
        "budget",
        "cut",
        "directive",
        "directive_known",
        "handoff",
        "inputs",
        "loop_chars",
        "speculate",
        "speculation",
    )

    ahead: float | None

    def __init__(
        self,
        assembly: EarlyAssembly,
        budget: int,
        inputs: Callable[[Retrieved], AssemblyInputs],
        speculate: Callable[[AssemblyInputs], Speculation] | None = None,
        handoff: Handoff | None = None,
        loop_chars: int = OFFLOAD_CHARS,
        ahead: float | None = SPECULATE_AHEAD,
    ) -> None:
        self.assembly: EarlyAssembly | None = assembly
        self.budget = budget
        self.loop_chars = loop_chars  # text above which the pipeline runs in a worker thread
        self.directive: Directive | None = None
        # The directive branch has answered and its fixed sections are not counted yet.
        self.directive_known = False
        self.ahead = ahead  # None: nothing is made before the wall
        self.inputs = inputs
        self.speculate = speculate
        self.speculation: Speculation | None = None
        self.handoff = handoff
        # The answer made before the wall, and the retrieval it answers.
        self.answer: tuple[Retrieved, AssemblyResult] | None = None
        self.cut = False  # the wall cut a branch of this call

    def before_wall(self, got: Retrieved) -> None:
        if self.assembly is None or self.budget < 0 or self.speculate is None:
            return
        try:
            self.speculation = self.speculate(self.inputs(got))
        except IbexError:
            pass  # a refusal: the pipeline raises it at the wall, where it always has
        except Exception:
            log.exception("early_assembly_failed")

    def wall_reached(self, got: Retrieved) -> None:
        self.cut = True
        try:
            inputs = self.inputs(got)
            speculation = self.speculation
            if speculation is not None and speculation.matches(inputs):
                result = speculation.answer(inputs)
            elif self._may_make(inputs):
                # Not made before the wall (a branch other than the last one was still
                # running then): the pipeline runs here, in the first task the wall
                # reached, as it would once the cut branches had unwound.
                assert self.speculate is not None
                result = self.speculate(inputs).result
            else:
                return
            self.answer = (got, result)
            if self.handoff is not None:
                self.handoff(result)
        except IbexError:
            pass  # a refusal: the pipeline raises it after retrieval, where it always has
        except Exception:
            log.exception("early_assembly_failed")

    def _may_make(self, inputs: AssemblyInputs) -> bool:
        """The whole answer may be made at the wall, in the loop: the pipeline would run
        there too (its text within the loop's budget, no worker thread)."""
        return (
            self.assembly is not None
            and self.speculate is not None
            and self.budget >= 0
            and text_chars(inputs) <= self.loop_chars
        )

    def answered_at_start(self, source: BranchSource, value: Any) -> None:
        if source == "directive":
            self.directive, self.directive_known = value, True

    def branch_ended(self, source: BranchSource, value: Any) -> None:
        if self.assembly is None:
            return
        try:
            if source == "directive":
                self.directive, self.directive_known = value, True
            self._fixed()
            if source != "directive" and value:
                self._hits(source, value)
        except Exception:
            log.exception("early_assembly_failed")
            self.assembly = None

    def _spend(self, chars: int) -> bool:
        if chars > self.budget:
            self.budget = -1  # over: the pipeline goes to a thread, and does the rest there
            return False
        self.budget -= chars
        return True

    def _fixed(self) -> None:
        assembly = self.assembly
        if assembly is None or not self.directive_known:
            return
        self.directive_known = False  # once
        chars = len(self.directive.content) if self.directive is not None else 0
        if self._spend(chars):
            assembly.directive(self.directive)

    def _hits(self, source: BranchSource, hits: list[MemoryHit]) -> None:
        assembly = self.assembly
        if assembly is None or assembly.refused or source == "directive":
            return
        if self._spend(sum(len(h.content) for h in hits)):
            assembly.hits(source, hits)
