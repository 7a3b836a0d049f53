"""The small interface retrieval needs from a backend.

Methods are Trio-async and are cancelled from outside by the branch's cancel
scope; they must leave no task, socket or pool lease behind when cancelled.
Anything wrong with the dependency or its answer is raised as SourceError with
a short detail that holds no secret and no memory text.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from ibex.assembly.structs import Directive, MemoryHit
from ibex.errors import SourceError

__all__ = ["Answer", "DirectiveSource", "MemorySource", "SourceError"]


class Answer(msgspec.Struct, frozen=True):
    """A branch's value with a short detail for its BranchOutcome (e.g. `cache`)."""

    value: Any
    detail: str = ""


class DirectiveSource(Protocol):
    async def get_directive(self, org_id: str, agent_id: str) -> Directive | None:
        """The agent's directive, or None when there is none (a success)."""
        ...

    async def aclose(self) -> None: ...


class MemorySource(Protocol):
    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """Hot-cache memories. Hits are returned as the service sent them (validated
        shape, branch="hot"); the tenant filter runs in the pipeline so it is counted."""
        ...

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """Semantic search; the service embeds the query itself (branch="cold")."""
        ...

    async def aclose(self) -> None: ...
