"""The sample tenant every test and benchmark shares (the bundled data's org and agent)."""

from __future__ import annotations

from ibex.assembly.structs import ScoredMemory
from ibex.cli import SAMPLE_AGENT, SAMPLE_ORG

ORG = SAMPLE_ORG
AGENT = SAMPLE_AGENT

__all__ = ["AGENT", "ORG", "scored"]


def scored(
    memory_id: int | str,
    score: float,
    *,
    tokens: int = 0,
    content: str = "",
    category: str = "factual",
) -> ScoredMemory:
    """A scored candidate (an int id becomes `m007`); similarity and confidence = score."""
    return ScoredMemory(
        memory_id=memory_id if isinstance(memory_id, str) else f"m{memory_id:03d}",
        category=category,
        content=content,
        composite_score=score,
        similarity=score,
        confidence=score,
        rank=1,
        token_estimate=tokens,
    )
