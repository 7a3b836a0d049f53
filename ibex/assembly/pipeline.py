"""The pure assembly: retrieval results in, a verified context block out.

No I/O and no clock other than stage timings: everything the pipeline needs
(directive, hits, branch outcomes, nonce, "now") comes in an `AssemblyInputs`.
Every candidate ends either included or excluded with a reason. Every piece is
priced and rendered by the one `Format` in the `PipelineConfig`.

`assemble_pure` runs named stages, as in the README's diagram, each in its own
module: count the fixed sections (directive, tools, the history that fits,
markup: the budget; ibex.assembly.fixed_sections), select (tenant filter,
score, dedupe, caps; ibex.assembly.candidates), price (each candidate's exact
cost; ibex.assembly.pricing), pack (ibex.assembly.packer), render within the
ceiling (ibex.assembly.render), build the result (ibex.assembly.result). A
`StageTimer` records each.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

import msgspec

from ibex.assembly.candidates import branch_candidates, merge, select, select_candidates
from ibex.assembly.catalog import Catalog, resolve_model
from ibex.assembly.fixed_sections import FixedSections, count_fixed_sections
from ibex.assembly.history import Counter
from ibex.assembly.packer import pack
from ibex.assembly.pipeline_config import DEFAULT_CONFIG, PipelineConfig
from ibex.assembly.pricing import price, pricer
from ibex.assembly.render import render_within_ceiling
from ibex.assembly.result import build_result, degradation_level
from ibex.assembly.stage_timer import StageTimer
from ibex.assembly.structs import (
    AssemblyRequest,
    AssemblyResult,
    BranchOutcome,
    Directive,
    MemoryHit,
)

if TYPE_CHECKING:
    from ibex.assembly.prepare import EarlyAssembly

# The stages are named here too, so a caller (and a test) finds every one on the pipeline.
__all__ = [
    "DEFAULT_CONFIG",
    "AssemblyInputs",
    "Counter",
    "CounterSource",
    "FixedSections",
    "PipelineConfig",
    "StageTimer",
    "assemble_pure",
    "build_result",
    "count_fixed_sections",
    "degradation_level",
    "price",
    "pricer",
    "render_within_ceiling",
    "resolve_model",
    "select",
    "select_candidates",
]

# Hex, or new_nonce's fixed-width decimal: 64 random bytes are 155 decimal digits.
_NONCE = re.compile(r"[0-9a-f]{2,160}")


class CounterSource(Protocol):
    """Where the pipeline gets a family's token counter (ibex.assembly.tokens.Tokenizers)."""

    def counter(self, family: str, encoding: str | None) -> Counter: ...


class AssemblyInputs(msgspec.Struct, frozen=True):
    """Everything one assembly depends on; identical inputs give identical output."""

    request: AssemblyRequest
    directive: Directive | None
    hot: tuple[MemoryHit, ...]
    cold: tuple[MemoryHit, ...]
    branches: tuple[BranchOutcome, ...]
    nonce: str
    now: float
    retrieval_ms: float = 0.0


def assemble_pure(
    inputs: AssemblyInputs,
    *,
    catalog: Catalog,
    tokenizers: CounterSource,
    config: PipelineConfig = DEFAULT_CONFIG,
    timer: StageTimer | None = None,
    early: EarlyAssembly | None = None,
) -> AssemblyResult:
    """Count the fixed sections, select, price, pack, render within the ceiling, build.

    A `timer` handed in keeps the stage laps for the caller (a traced call's stage spans).
    `early` holds stages done while retrieval waited (ibex.assembly.prepare); a part
    is used only when it was made from these very inputs, so the answer is the same
    without it. The laps then time only the work left.
    """
    timer = StageTimer() if timer is None else timer.restart()
    request = inputs.request
    nonce = inputs.nonce
    if not _NONCE.fullmatch(nonce):
        raise ValueError("nonce must be 2 to 160 lower-case hex or decimal digits")
    cap = resolve_model(catalog, request.model, request.available_tokens)
    family = catalog.family(cap.tokenizer_family)
    counter = tokenizers.counter(family.name, family.encoding)
    fmt = config.format
    order = config.section_order
    if early is not None and not early.made_for(request, nonce, counter, fmt, order):
        early = None
    fixed = early.fixed_for(inputs.directive) if early is not None else None
    if fixed is None:
        fixed = count_fixed_sections(
            request, inputs.directive, nonce, cap, family, counter, fmt, order
        )
    timer.lap("count")
    if early is None:
        selection = select(request, inputs.hot, inputs.cold, inputs.now)
    else:
        early.commit()  # the request fits: its memory prices may be cached
        opts, now = request.options, inputs.now
        selection = merge(
            request,
            early.candidates_for("hot", inputs.hot, now)
            or branch_candidates(request, inputs.hot, now, opts.skip_hot_memories),
            early.candidates_for("cold", inputs.cold, now)
            or branch_candidates(request, inputs.cold, now, opts.skip_cold_memories),
        )
    timer.lap("select")
    candidates = (
        selection.candidates if selection.priced else price(selection.candidates, counter, fmt)
    )
    timer.lap("price")
    packed = pack(
        candidates,
        fixed.budget.usable_budget,
        dp_cell_ceiling=config.dp_cell_ceiling,
        max_consecutive_skips=config.max_consecutive_skips,
    )
    timer.lap("pack")
    rendered = render_within_ceiling(
        request,
        inputs.directive,
        nonce,
        fixed,
        packed.packed,
        counter,
        cap.model_id or request.model,
        fmt,
        order,
    )
    timer.lap("render")
    return build_result(inputs, fixed, packed, rendered, selection, timer)
