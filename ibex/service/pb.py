"""The server's name for the wire messages: `ibex.wire`, which the client shares."""

from __future__ import annotations

from ibex.wire import (
    PACKAGE,
    POOL,
    AssembleContextRequest,
    AssembleContextResponse,
    AssemblyMetrics,
    AssemblyOptions,
    BranchOutcome,
    Memory,
    MemoryScoreUpdate,
    MemoryUsed,
    Message,
    PackSummary,
    PrincipalContext,
    RecordMemoryFeedbackRequest,
    RecordMemoryFeedbackResponse,
    SearchMemoriesRequest,
    SearchMemoriesResponse,
    TokenBudget,
    message_class,
)

__all__ = [
    "PACKAGE",
    "POOL",
    "AssembleContextRequest",
    "AssembleContextResponse",
    "AssemblyMetrics",
    "AssemblyOptions",
    "BranchOutcome",
    "Memory",
    "MemoryScoreUpdate",
    "MemoryUsed",
    "Message",
    "PackSummary",
    "PrincipalContext",
    "RecordMemoryFeedbackRequest",
    "RecordMemoryFeedbackResponse",
    "SearchMemoriesRequest",
    "SearchMemoriesResponse",
    "TokenBudget",
    "message_class",
]
