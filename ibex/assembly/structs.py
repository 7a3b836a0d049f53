"""Frozen value types that flow through retrieval and the pure pipeline.

Every stage takes and returns these structs; none of them carries I/O handles,
so the pipeline can be tested, property-tested and benchmarked in isolation.
"""

from __future__ import annotations

import enum
from typing import Final, Literal, get_args

import msgspec

BranchSource = Literal["directive", "hot", "cold"]
BranchStatus = Literal["success", "timeout", "error", "skipped"]
Exclusion = Literal["included", "budget", "filter", "truncated", "failed", "unknown"]
InjectionMode = Literal["system_first", "system_append", "user_prepend"]
PackPath = Literal["dp", "greedy"]
DegradationLevel = Literal["L0", "L1", "L2"]
# The values of the Literals above, for checks at run time and metric label sets.
INJECTION_MODES: Final[tuple[InjectionMode, ...]] = get_args(InjectionMode)


class Message(msgspec.Struct, frozen=True):
    """One history turn as sent by the caller."""

    role: str
    content: str


class AssemblyOptions(msgspec.Struct, frozen=True):
    """Per-request knobs (contract: AssemblyOptions). Weights of 0 mean unset."""

    skip_cold_memories: bool = False
    skip_hot_memories: bool = False
    recency_weight: float = 0.0
    relevance_weight: float = 0.0
    usefulness_weight: float = 0.0
    confidence_weight: float = 0.0
    max_memories: int = 0
    reject_history_overflow: bool = False


class AssemblyRequest(msgspec.Struct, frozen=True):
    """A validated AssembleContext request, independent of the wire format."""

    agent_id: str
    org_id: str
    query: str = ""
    model: str = ""
    session_id: str = ""
    directive_version_id: str = ""
    available_tokens: int = 0
    recent_messages: tuple[Message, ...] = ()
    options: AssemblyOptions = AssemblyOptions()
    request_id: str = ""
    trace_id: str = ""
    span_id: str = ""
    tool_schemas: tuple[str, ...] = ()


class SearchRequest(msgspec.Struct, frozen=True):
    """A SearchMemories request as received; `validate_search` makes it a SearchFilter."""

    org_id: str
    agent_id: str
    query: str = ""
    limit: int = 0  # 0: the default limit
    min_similarity: float = 0.0
    categories: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    session_id: str = ""  # correlation only; bounded like every id


class Directive(msgspec.Struct, frozen=True):
    """The agent's directive as read from the cache (contract section 3)."""

    content: str
    injection_mode: InjectionMode = "system_first"
    version_id: str | None = None


class MemoryHit(msgspec.Struct, frozen=True):
    """One validated memory-service result, tenant fields kept for the filter."""

    memory_id: str
    org_id: str
    agent_id: str
    content: str
    category: str
    confidence: float
    similarity: float
    rank: int
    source: str = ""
    branch: Literal["hot", "cold"] = "cold"
    created_at: str | None = None
    usefulness: float | None = None
    access_count: int | None = None
    tags: tuple[str, ...] = ()
    # Content was over the source's cap and dropped (content is ""): the
    # pipeline excludes the hit as `failed` and never counts its tokens.
    oversized: bool = False
    # The memory service's own composite (0..1) when it sent one; ranks only
    # when every candidate of the assembly has it (scoring.COMPOSITE).
    composite_score: float | None = None


class BranchOutcome(msgspec.Struct, frozen=True):
    """How one retrieval branch ended. Detail is short and never holds memory text."""

    source: BranchSource
    status: BranchStatus
    latency_ms: float = 0.0
    detail: str = ""


class ScoredMemory(msgspec.Struct, frozen=True):
    """A candidate after scoring; token_estimate is the cost of its formatted block.

    composite_score is the *packer* score named by score_schema, not the memory
    service's composite.
    """

    memory_id: str
    category: str
    content: str
    composite_score: float
    similarity: float
    confidence: float
    rank: int
    relevance_score: float = 0.0
    recency_score: float = 0.0
    usefulness_score: float = 0.0
    token_estimate: int = 0
    branch: str = ""


class PackResult(msgspec.Struct, frozen=True):
    """What the packer chose, in emit order, and why the rest was left."""

    packed: tuple[ScoredMemory, ...]
    excluded: tuple[ScoredMemory, ...]
    path: PackPath
    candidates_evaluated: int
    excluded_for_budget: int
    budget_reached: bool
    total_tokens: int
    total_score: float


class TokenBudget(msgspec.Struct, frozen=True):
    """Every term of the budget, as reported on the wire (TokenBudget)."""

    context_window: int
    response_reserve: int
    safety_buffer: int
    directive_tokens: int
    messages_tokens: int
    tool_schema_tokens: int
    formatter_overhead_tokens: int
    usable_budget: int
    constrained: bool
    tokenizer_family: str
    estimate_kind: str
    messages_dropped: int = 0
    messages_dropped_tokens: int = 0

    @property
    def ceiling(self) -> int:
        """The most the assembled context may ever take."""
        return max(0, self.context_window - self.response_reserve - self.safety_buffer)


class MemoryUsed(msgspec.Struct, frozen=True):
    """A candidate in the response: included or excluded with its reason."""

    memory_id: str
    composite_score: float = 0.0
    relevance_score: float = 0.0
    recency_score: float = 0.0
    usefulness_score: float = 0.0
    rank: int = 0
    category: str = ""
    exclusion: Exclusion = "included"
    similarity: float = 0.0
    confidence: float = 0.0
    token_estimate: int = 0


# The pipeline's timed steps in order: StageTimer laps and the trace spans `stage.<lap>`.
Lap = Literal["count", "select", "price", "pack", "render"]


class Stage(enum.Enum):
    """A reported pipeline stage, with every name it goes by.

    `value` is the `stage` label of ibex_stage_duration_seconds, `field` the
    AssemblyMetrics `*_ms` field, and `laps` the StageTimer laps whose sum it is.
    The metric's `total` label is not a stage: it is total_ms, retrieval included.
    """

    BUDGET = "budget"
    RANKING = "ranking"
    PACKING = "packing"
    FORMATTING = "formatting"

    @property
    def field(self) -> str:
        return _STAGE_NAMES[self][0]

    @property
    def laps(self) -> tuple[Lap, ...]:
        return _STAGE_NAMES[self][1]


_STAGE_NAMES: Final[dict[Stage, tuple[str, tuple[Lap, ...]]]] = {
    Stage.BUDGET: ("budget_calculation_ms", ("count",)),
    Stage.RANKING: ("ranking_ms", ("select", "price")),
    Stage.PACKING: ("packing_ms", ("pack",)),
    Stage.FORMATTING: ("formatting_ms", ("render",)),
}


class AssemblyMetrics(msgspec.Struct, frozen=True):
    budget_calculation_ms: int = 0
    directive_load_ms: int = 0
    hot_memory_retrieval_ms: int = 0
    cold_memory_retrieval_ms: int = 0
    ranking_ms: int = 0
    packing_ms: int = 0
    formatting_ms: int = 0
    total_ms: int = 0
    candidates_evaluated: int = 0


class PackSummary(msgspec.Struct, frozen=True):
    path: PackPath = "dp"
    candidates_evaluated: int = 0
    excluded_for_budget: int = 0
    budget_reached: bool = False
    total_score: float = 0.0
    tenant_filtered: int = 0


class AssemblyResult(msgspec.Struct, frozen=True):
    """The assembled context and every fact the response reports about it."""

    assembled_context: str
    tokens_used: int
    memories_used: tuple[MemoryUsed, ...]
    excluded: tuple[MemoryUsed, ...]
    directive_tokens: int
    history_tokens: int
    memory_tokens: int
    tool_tokens: int
    formatter_tokens: int
    score_schema: str
    degradation_level: DegradationLevel
    branches: tuple[BranchOutcome, ...]
    budget: TokenBudget
    pack: PackSummary
    metrics: AssemblyMetrics
    request_id: str = ""
    trace_id: str = ""
    span_id: str = ""
    directive_version_id: str = ""

    @property
    def memories_included(self) -> int:
        return len(self.memories_used)
