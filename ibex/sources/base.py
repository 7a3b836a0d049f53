"""The small interface retrieval needs from a backend.

Methods are Trio-async and are cancelled from outside by the branch's cancel
scope; they must leave no task, socket or pool lease behind when cancelled.
Anything wrong with the dependency or its answer is raised as SourceError with
a short detail that holds no secret and no memory text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import msgspec

from ibex.assembly.structs import Directive, MemoryHit
from ibex.errors import SourceError

__all__ = [
    "Answer",
    "BatchRead",
    "DirectiveAnswer",
    "DirectiveOrError",
    "DirectiveSource",
    "MemorySource",
    "SourceError",
    "batch_reader",
    "cached_directive",
    "prefetch_directive",
]

T = TypeVar("T")


class Answer(msgspec.Struct, Generic[T], frozen=True):
    """A branch's value with a short detail for its BranchOutcome (e.g. `cache`)."""

    value: T
    detail: str = ""


# The directive branch's answer: the directive, or None when the agent has none.
DirectiveAnswer = Answer[Directive | None]


class DirectiveSource(Protocol):
    """Where directives come from. A decorator (the in-process cache) is one too.

    A source may also define `cached(org_id, agent_id, version) -> DirectiveAnswer | None`:
    an answer it holds in memory, given without I/O, or None. Retrieval asks it
    first (see `cached_directive`), so an answer in hand costs no task. It may
    define `prefetch(org_id, agent_id, version) -> None` (start the read a call
    will need, see `prefetch_directive`) and `get_directives(wanted)` (several
    agents' directives in one round trip, see `batch_reader`).
    """

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        """The agent's directive, or None when there is none (a success).

        `version` is the canonical version id the caller expects ("" for none); a
        source that always reads the current value may ignore it.
        """
        ...

    async def aclose(self) -> None: ...


def cached_directive(
    source: DirectiveSource, org_id: str, agent_id: str, version: str
) -> DirectiveAnswer | None:
    """The source's in-memory answer when it has an optional `cached` method and a
    usable entry, else None. Duck-typed, so any source (or decorator) may offer one."""
    lookup: Callable[[str, str, str], DirectiveAnswer | None] | None = getattr(
        source, "cached", None
    )
    return None if lookup is None else lookup(org_id, agent_id, version)


def prefetch_directive(source: DirectiveSource, org_id: str, agent_id: str, version: str) -> None:
    """Let the source start the read a call will need, when it offers `prefetch`; no I/O
    here, and nothing happens for a source without one."""
    start: Callable[[str, str, str], None] | None = getattr(source, "prefetch", None)
    if start is not None:
        start(org_id, agent_id, version)


# One agent's answer among several: its directive (None: it has none) or its error.
DirectiveOrError = Directive | SourceError | None
# (org_id, agent_id, version): one agent's directive asked for, with the version expected.
Wanted = tuple[str, str, str]
# A source's `get_directives(wanted, on_answers=None)`: several agents' answers in one
# round trip, in order; `on_answers`, when given, is called with them as soon as they are
# known (it may run on the I/O side of the loop, before the call returns).
Answers = Callable[[list[DirectiveOrError]], None]


class BatchRead(Protocol):
    def __call__(
        self, wanted: Sequence[Wanted], *, on_answers: Answers | None = None
    ) -> Awaitable[list[DirectiveOrError]]: ...


def batch_reader(source: DirectiveSource) -> BatchRead | None:
    """The source's `get_directives` when it reads several agents in one round trip, else
    None. A source may offer the method and say `batch_reads = False` (a Redis Cluster: keys
    live on any master, and one hung master would hold every key read with its own)."""
    many: BatchRead | None = getattr(source, "get_directives", None)
    return many if getattr(source, "batch_reads", True) else None


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
