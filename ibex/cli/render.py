"""What `ibex assemble` and `ibex search` print: plain-text tables for an operator.

Memory text comes from other systems: it is shown through `printable`, so no
control sequence in it reaches the operator's terminal.
"""

from __future__ import annotations

from typing import Any

from ibex.cli.common import printable

__all__ = ["render_report", "render_search"]


def render_report(result: Any) -> str:
    """The context, then the budget table and every excluded candidate."""
    out = [result.context.rstrip("\n"), ""]
    r = result.response
    if r is None:
        out.append(f"daemon unavailable ({result.status}): history-only fallback, degraded")
        if result.messages_dropped:
            out.append(f"{result.messages_dropped} oldest messages left out to fit the window")
        return "\n".join(out)
    b = r.budget
    used_markup = r.tokens_used - r.directive_tokens - r.history_tokens - r.memory_tokens
    rows = [
        ("window", b.context_window),
        ("response reserve", b.response_reserve),
        ("safety buffer", b.safety_buffer),
        ("directive", r.directive_tokens),
        ("history", r.history_tokens),
        ("tools + markup", used_markup),
        ("memories", r.memory_tokens),
        ("free", b.context_window - b.response_reserve - b.safety_buffer - r.tokens_used),
    ]
    out.append(f"budget ({b.tokenizer_family}, {b.estimate_kind})")
    out += [f"  {name:<18}{value:>10,}" for name, value in rows]
    out.append(f"  {'tokens used':<18}{r.tokens_used:>10,}")
    # Not part of the context: the oldest messages left out so the rest fits.
    dropped = f"  ({b.messages_dropped} oldest messages, not in the context)"
    out.append(f"  {'history dropped':<18}{b.messages_dropped_tokens:>10,}{dropped}")
    filtered = r.pack.tenant_filtered
    out.append(
        f"degradation {r.degradation_level}; score {r.score_schema}; pack {r.pack.path}; "
        f"{r.memories_included} memories included"
        + (f"; {filtered} hits of other tenants filtered" if filtered else "")
    )
    # A branch's detail is why it did not succeed (e.g. the directive value's error).
    out.append(
        "branches: "
        + ", ".join(
            f"{x.source}={x.status} ({x.latency_ms:.1f}ms{'; ' + x.detail if x.detail else ''})"
            for x in r.branches
        )
    )
    if r.memories_used:  # usefulness shows what feedback (`ibex feedback`) changed
        out.append("included:")
        out += [
            f"  {m.memory_id:<40} score={m.composite_score:.3f} usefulness={m.usefulness_score:.3f}"
            for m in r.memories_used
        ]
    if r.excluded:
        out.append("excluded:")
        out += [
            f"  {m.memory_id:<40} {m.exclusion:<10} score={m.composite_score:.3f}"
            for m in r.excluded
        ]
    return "\n".join(out)


def render_search(response: Any, width: int = 60) -> str:
    """One line per memory: id, composite score, confidence, category, start of the text."""
    out = [
        f"{len(response.memories)} memories of {response.total_candidates} candidates "
        f"({response.search_time_ms} ms)"
    ]
    if response.memories:
        out.append(f"  {'id':<38} {'score':>6} {'conf':>5} {'category':<14} content")
    for m in response.memories:
        text = printable(" ".join(m.content.split()))
        if len(text) > width:
            text = text[: width - 1] + "…"
        out.append(
            f"  {printable(m.id):<38} {m.composite_score:>6.3f} {m.confidence:>5.2f} "
            f"{printable(m.category[:14]):<14} {text}"
        )
    return "\n".join(out)
