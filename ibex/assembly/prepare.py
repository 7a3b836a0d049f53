"""The pipeline's work that can be done while retrieval is still waiting.

A call whose cold branch hangs waits at the wall with its directive and hot
memories long in hand. `EarlyAssembly` lets the service do their share of
`assemble_pure` as each branch lands: the fixed sections (directive, history,
tools, markup: the budget) once the directive branch has ended, and for each
memory branch the tenant filter, both scores a hit may be ranked by, and the
price of each variant. At the wall only the merge (schema, dedupe, caps), the
pack and the render remain.

`assemble_pure` uses a prepared part only when it was made from exactly the
inputs it is given, and does whatever is missing itself, so its answer is the
same with or without this work (the stages are the same functions). What the
timing changes:

- `now` (recency) and the nonce are fixed once per request before retrieval,
  so every branch is scored against the same instant whenever it lands;
- a refused request (TooLargeError counting the fixed sections) is refused
  where the pipeline would have refused it: the error is kept and raised there;
- memory prices are counted into a `DeferredCache` and cached only once the fixed
  sections are known to fit, as `price` would have cached them.

A `Speculation` goes one step further for a call whose last branch still runs
shortly before the wall: the whole answer made as if the wall will cut that
branch, so at the wall only the timing facts (each branch's latency, the total)
are filled in. It is used only when what retrieval returns at the wall is what
it was made from (same directive and hits, same branch statuses and details);
otherwise the pipeline runs as usual.

Pure and synchronous: the service decides when to call it and bounds how much
text it hands over in the loop (see ibex.service.assembler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from ibex.assembly.candidates import BranchCandidates, branch_candidates
from ibex.assembly.catalog import Catalog, resolve_model
from ibex.assembly.fixed_sections import FixedSections, count_fixed_sections
from ibex.assembly.history import Counter, DeferredCache
from ibex.assembly.output_format import Format, SectionOrder
from ibex.assembly.pipeline import DEFAULT_CONFIG, AssemblyInputs, CounterSource, PipelineConfig
from ibex.assembly.pricing import PriceKey, commit_prices, pricer
from ibex.assembly.result import degradation_level, timing_metrics
from ibex.assembly.structs import AssemblyRequest, AssemblyResult, Directive, MemoryHit
from ibex.errors import TooLargeError

__all__ = ["EarlyAssembly", "Speculation"]

MemoryBranch = Literal["hot", "cold"]


class EarlyAssembly:
    """One request's pipeline work done early; filled by the service, read by `assemble_pure`.

    Not thread-safe while it is being filled: the service fills it from the
    loop during retrieval and hands it to the pipeline only after retrieval.
    """

    __slots__ = (
        "_fixed",
        "candidates",
        "cap",
        "counter",
        "deferred",
        "family",
        "fmt",
        "nonce",
        "now",
        "order",
        "prices",
        "request",
    )

    def __init__(
        self,
        request: AssemblyRequest,
        nonce: str,
        now: float,
        *,
        catalog: Catalog,
        tokenizers: CounterSource,
        config: PipelineConfig = DEFAULT_CONFIG,
    ) -> None:
        self.request = request
        self.nonce = nonce
        self.now = now
        self.cap = resolve_model(catalog, request.model, request.available_tokens)
        self.family = catalog.family(self.cap.tokenizer_family)
        self.counter: Counter = tokenizers.counter(self.family.name, self.family.encoding)
        self.fmt = config.format
        self.order = config.section_order
        self._fixed: tuple[Directive | None, FixedSections | TooLargeError] | None = None
        self.candidates: dict[MemoryBranch, BranchCandidates] = {}
        self.deferred = DeferredCache(self.counter, self.fmt)
        self.prices: list[tuple[PriceKey, int]] = []  # sums for the price table, at commit

    # --- filled as branches land ------------------------------------------------

    def directive(self, directive: Directive | None) -> None:
        """The directive branch has ended (None: no directive): count the fixed sections."""
        try:
            fixed: FixedSections | TooLargeError = count_fixed_sections(
                self.request,
                directive,
                self.nonce,
                self.cap,
                self.family,
                self.counter,
                self.fmt,
                self.order,
            )
        except TooLargeError as exc:
            fixed = exc  # raised where the pipeline counts, as it would have been
        self._fixed = (directive, fixed)

    @property
    def refused(self) -> bool:
        """The fixed sections do not fit: the request will be refused, memories are moot."""
        return self._fixed is not None and isinstance(self._fixed[1], TooLargeError)

    def hits(self, branch: MemoryBranch, hits: Sequence[MemoryHit]) -> None:
        """A memory branch has landed: its share of select and price."""
        opts = self.request.options
        skip = opts.skip_hot_memories if branch == "hot" else opts.skip_cold_memories
        self.candidates[branch] = branch_candidates(
            self.request,
            hits,
            self.now,
            skip,
            pricer(self.counter, self.fmt, self.deferred, self.prices),
        )

    # --- read by the pipeline -----------------------------------------------------

    def made_for(
        self,
        request: AssemblyRequest,
        nonce: str,
        counter: Counter,
        fmt: Format,
        order: SectionOrder = "seed",
    ) -> bool:
        """Whether this was made for the same request, nonce, counter, format and order."""
        return (
            request is self.request
            and nonce == self.nonce
            and counter is self.counter
            and fmt is self.fmt
            and order == self.order
        )

    def fixed_for(self, directive: Directive | None) -> FixedSections | None:
        """The fixed sections counted for this directive, or None; raises a kept refusal."""
        if self._fixed is None or self._fixed[0] != directive:
            return None
        fixed = self._fixed[1]
        if isinstance(fixed, TooLargeError):
            raise fixed
        return fixed

    def candidates_for(
        self, branch: MemoryBranch, hits: Sequence[MemoryHit], now: float
    ) -> BranchCandidates | None:
        """The branch's prepared candidates when made from these very hits at `now`, else None."""
        found = self.candidates.get(branch)
        if found is None or found.now != now or found.hits != tuple(hits):
            return None
        return found

    def commit(self) -> None:
        """The fixed sections fit: cache the memory prices' new counts, bodies and sums."""
        deferred = self.deferred
        if deferred.counts or deferred.bodies:
            deferred.commit()
            self.deferred = DeferredCache(self.counter, self.fmt)
        commit_prices(self.counter, self.fmt, self.prices)


class Speculation:
    """A whole answer made before the wall from `inputs`, as if the wall cut the last branch.

    `work` is the seconds the pipeline took (reported in `total_ms` with the
    retrieval time, as the pipeline reports its own).
    """

    __slots__ = ("inputs", "result", "work")

    def __init__(self, inputs: AssemblyInputs, result: AssemblyResult, work: float) -> None:
        self.inputs = inputs
        self.result = result
        self.work = work

    def matches(self, inputs: AssemblyInputs) -> bool:
        """Whether `inputs` differ from those it was made from only in timing facts."""
        made = self.inputs
        return (
            inputs.request is made.request
            and inputs.nonce == made.nonce
            and inputs.now == made.now
            and inputs.directive == made.directive
            and inputs.hot == made.hot
            and inputs.cold == made.cold
            and [(b.source, b.status, b.detail) for b in inputs.branches]
            == [(b.source, b.status, b.detail) for b in made.branches]
        )

    def answer(self, inputs: AssemblyInputs) -> AssemblyResult:
        """The answer for `inputs` (which `matches`): the branches' latencies and the
        totals as `build_result` reports them, the rest as made."""
        metrics = msgspec.structs.replace(self.result.metrics, **timing_metrics(inputs, self.work))
        return msgspec.structs.replace(
            self.result,
            branches=inputs.branches,
            degradation_level=degradation_level(inputs.branches),
            metrics=metrics,
        )
