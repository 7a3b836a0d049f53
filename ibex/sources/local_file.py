"""Embedded development backend: directives and memories from one local file.

Lets the daemon run end to end with no Redis and no memory service. The file
is validated completely at load (a bad item stops start-up with the file and
item named) and then served from memory; hits go through the same wire
validation as the HTTP source, so the pipeline cannot tell them apart.

Format, JSON (`*.json`):

    {"version": 1, "agents": [AGENT, ...]}

or JSONL (`*.jsonl`): one AGENT object per line (blank lines and lines
starting with `#` are skipped). An AGENT is

    {"org_id": "<uuid>", "agent_id": "<uuid>",
     "directive": {"content": "...", "injection_mode": "system_first",
                   "version_id": "<uuid>" | null} | null,
     "memories": [MEMORY, ...]}

and a MEMORY is the contract's memory object (`id` a UUID, `content`, `category`,
`confidence`, optional `created_at`, `usefulness`, `access_count`). Its
`org_id`/`agent_id` default to the AGENT's; giving other ones serves another
tenant's memory to this agent, which is how the sample demonstrates the
pipeline's tenant filter.

Hot: memories with confidence >= min_confidence, most confident first (ties by
id), similarity 0 (there is no query). Cold: TF-IDF cosine between the query
and each memory, in [0, 1], positive scores only, best first (ties by
confidence, then id). Ranks count from 1.

Feedback (`feedback`) moves a memory's usefulness in memory, for the life of
the process, so `ibex assemble` shows its effect: positive +0.1, negative
-0.1, neutral unchanged, within [0, 1], from the file's value (0.5 when it has
none). Like the memory service: ids of another org or unknown ids are left out
of the updates, and a repeated idempotency key changes nothing and gets the
first answer again (the last `SEEN_KEYS` keys are remembered).
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec
import trio

from ibex.assembly.feedback_rules import Feedback, ScoreUpdate
from ibex.assembly.structs import Directive, InjectionMode, MemoryHit
from ibex.assembly.validation import uuid_text
from ibex.errors import ConfigFileError
from ibex.sources.memory_schema import (
    DEFAULT_MAX_CONTENT_BYTES,
    MemoryFields,
    NonEmptyStr,
    WireMemory,
    WireResult,
    to_hit,
)

SAMPLE_ORG_ID = "00000000-0000-4000-8000-000000000001"
SAMPLE_AGENT_ID = "00000000-0000-4000-8000-0000000000a1"
SOURCE_LABEL = "local"
FEEDBACK_STEP = {"positive": 0.1, "negative": -0.1, "neutral": 0.0}
DEFAULT_USEFULNESS = 0.5
SEEN_KEYS = 4096

# Latin-ish words, or single CJK / kana / hangul characters (no spaces to split on).
_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|[^\W_]+", re.UNICODE)
_STOPWORD_TEXT = """
a an and are as at be by can could did do does for from has have how i in is it its me my of
on or should that the their this to was what when where which who why will with would you your
"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())

_T = TypeVar("_T")


class LocalFileError(ConfigFileError):
    """The local source file is missing or invalid; the message names file and item."""


class LocalMemory(MemoryFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A memory as the service sends it, but strict about keys; org and agent default to
    the agent entry's."""

    org_id: NonEmptyStr | None = None
    agent_id: NonEmptyStr | None = None


class LocalDirective(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    content: Annotated[str, msgspec.Meta(min_length=1)]
    injection_mode: InjectionMode = "system_first"
    version_id: NonEmptyStr | None = None


class LocalAgent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    org_id: NonEmptyStr
    agent_id: NonEmptyStr
    directive: LocalDirective | None = None
    memories: list[LocalMemory] = []


class LocalFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: Literal[1]
    agents: list[LocalAgent]


class _Indexed(msgspec.Struct, frozen=True):
    """One agent's memories with the precomputed TF-IDF vectors for cold search."""

    memories: tuple[WireMemory, ...]
    vectors: tuple[dict[str, float], ...]
    idf: dict[str, float]


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens, plural -s folded; CJK characters count one each."""
    out: list[str] = []
    for t in _TOKEN.findall(text.lower()):
        if t in _STOPWORDS:
            continue
        if len(t) > 3 and t.endswith("s") and not t.endswith("ss"):
            t = t[:-1]
        out.append(t)
    return out


def _unit_vector(counts: Counter[str], idf: dict[str, float]) -> dict[str, float]:
    weights = {t: (1.0 + math.log(c)) * idf.get(t, 0.0) for t, c in counts.items()}
    norm = math.sqrt(sum(w * w for w in weights.values()))
    return {t: w / norm for t, w in weights.items() if w > 0} if norm > 0 else {}


def _index(memories: Iterable[WireMemory]) -> _Indexed:
    mems = tuple(memories)
    counts = [Counter(tokenize(m.content)) for m in mems]
    df: Counter[str] = Counter()
    for c in counts:
        df.update(c.keys())
    n = len(mems)
    idf = {t: math.log((1 + n) / (1 + d)) + 1.0 for t, d in df.items()}
    return _Indexed(mems, tuple(_unit_vector(c, idf) for c in counts), idf)


class LocalFileSource:
    """`DirectiveSource` and `MemorySource` over a validated local file."""

    def __init__(
        self,
        directives: dict[tuple[str, str], Directive],
        memories: dict[tuple[str, str], list[WireMemory]],
        *,
        origin: str = "<memory>",
        max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES,
    ) -> None:
        """Memories whose content is over `max_content_bytes` are served as the HTTP
        source serves them: content dropped, flagged, excluded as `failed`."""
        self.origin = origin
        self._max_content_bytes = max_content_bytes
        self._directives = dict(directives)
        self._index = {key: _index(ms) for key, ms in memories.items()}
        # (org, canonical id) -> usefulness from the file; feedback's changes in _usefulness.
        self._initial: dict[tuple[str, str], float | None] = {}
        for ms in memories.values():
            for m in ms:
                self._initial.setdefault((m.org_id.lower(), _canonical(m.id)), m.usefulness)
        self._usefulness: dict[tuple[str, str], float] = {}
        self._seen: OrderedDict[str, list[ScoreUpdate]] = OrderedDict()

    @classmethod
    def load(
        cls, path: str | Path | None = None, *, max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES
    ) -> LocalFileSource:
        """Load and validate `path` (None: the bundled sample). Raises LocalFileError."""
        cap = max_content_bytes
        if path is None:
            ref = resources.files("ibex") / "data" / "sample_memories.json"
            name, data = "ibex/data/sample_memories.json", ref.read_bytes()
            return cls._from_agents(_parse_json(name, data), origin=name, max_content_bytes=cap)
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise LocalFileError(
                f"{p}: cannot read ({exc.strerror or type(exc).__name__})"
            ) from None
        agents = _parse_jsonl(str(p), data) if p.suffix == ".jsonl" else _parse_json(str(p), data)
        return cls._from_agents(agents, origin=str(p), max_content_bytes=cap)

    @classmethod
    def _from_agents(
        cls, agents: list[LocalAgent], *, origin: str, max_content_bytes: int
    ) -> LocalFileSource:
        directives: dict[tuple[str, str], Directive] = {}
        memories: dict[tuple[str, str], list[WireMemory]] = {}
        for n, agent in enumerate(agents):
            key = (agent.org_id.lower(), agent.agent_id.lower())
            where = f"{origin}: agents[{n}]"
            if key in memories:
                raise LocalFileError(f"{where}: duplicate org_id/agent_id pair")
            seen: set[str] = set()
            items: list[WireMemory] = []
            for i, m in enumerate(agent.memories):
                if m.id in seen:
                    raise LocalFileError(f"{where}.memories[{i}]: duplicate id {m.id!r}")
                seen.add(m.id)
                # The same fields as the service's memory, the tenant filled in from the agent.
                tenant = {
                    "org_id": m.org_id or agent.org_id,
                    "agent_id": m.agent_id or agent.agent_id,
                }
                items.append(WireMemory(**(msgspec.structs.asdict(m) | tenant)))
            memories[key] = items
            if agent.directive is not None:
                d = agent.directive
                directives[key] = Directive(d.content, d.injection_mode, d.version_id)
        return cls(directives, memories, origin=origin, max_content_bytes=max_content_bytes)

    def __repr__(self) -> str:
        return f"<LocalFileSource {self.origin} agents={len(self._index)}>"

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        """The sample's directive; the file holds one version, so `version` is not used."""
        await trio.lowlevel.checkpoint()
        return self._directives.get((org_id.lower(), agent_id.lower()))

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.lowlevel.checkpoint()
        idx = self._index.get((org_id.lower(), agent_id.lower()))
        if idx is None or limit <= 0:
            return []
        chosen = sorted(
            (m for m in idx.memories if m.confidence >= min_confidence),
            key=lambda m: (-m.confidence, m.id),
        )[:limit]
        cap = self._max_content_bytes
        return [
            _hit(self._current(m), 0.0, rank, "hot", cap) for rank, m in enumerate(chosen, start=1)
        ]

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.lowlevel.checkpoint()
        idx = self._index.get((org_id.lower(), agent_id.lower()))
        if idx is None or limit <= 0:
            return []
        qvec = _unit_vector(Counter(tokenize(query)), idx.idf)
        if not qvec:
            return []
        scored: list[tuple[float, WireMemory]] = []
        for m, vec in zip(idx.memories, idx.vectors, strict=True):
            if m.confidence < min_confidence:
                continue
            sim = sum(w * vec.get(t, 0.0) for t, w in qvec.items())
            if sim > 0.0:
                scored.append((min(1.0, round(sim, 6)), m))
        scored.sort(key=lambda sm: (-sm[0], -sm[1].confidence, sm[1].id))
        cap = self._max_content_bytes
        return [
            _hit(self._current(m), s, rank, "cold", cap)
            for rank, (s, m) in enumerate(scored[:limit], start=1)
        ]

    async def feedback(self, fb: Feedback, key: str) -> list[ScoreUpdate]:
        """Apply feedback to the in-memory usefulness, once per idempotency key."""
        await trio.lowlevel.checkpoint()
        seen = self._seen.get(key)
        if seen is not None:
            self._seen.move_to_end(key)
            return list(seen)
        updates: list[ScoreUpdate] = []
        for memory_id in fb.memory_ids:
            at = (fb.org_id, memory_id)
            if at not in self._initial:  # unknown, or another org's: left out
                continue
            previous = self._usefulness.get(at)
            if previous is None:
                initial = self._initial[at]
                previous = DEFAULT_USEFULNESS if initial is None else initial
            new = round(min(1.0, max(0.0, previous + FEEDBACK_STEP[fb.feedback])), 6)
            self._usefulness[at] = new
            updates.append(ScoreUpdate(memory_id, previous, new))
        self._seen[key] = updates
        if len(self._seen) > SEEN_KEYS:
            self._seen.popitem(last=False)
        return list(updates)

    def _current(self, m: WireMemory) -> WireMemory:
        """The memory with the usefulness feedback gave it, if any."""
        if not self._usefulness:
            return m
        value = self._usefulness.get((m.org_id.lower(), _canonical(m.id)))
        return m if value is None else msgspec.structs.replace(m, usefulness=value)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def _canonical(memory_id: str) -> str:
    """A UUID id in the canonical form requests use; any other id as it is (never matched)."""
    return uuid_text(memory_id) or memory_id


def _hit(
    m: WireMemory, similarity: float, rank: int, branch: Literal["hot", "cold"], cap: int
) -> MemoryHit:
    # Built through WireResult so the local path runs the same validation as HTTP.
    return to_hit(
        WireResult(memory=m, similarity=similarity, rank=rank, source=SOURCE_LABEL), branch, cap
    )


def _parse_json(name: str, data: bytes) -> list[LocalAgent]:
    return _decode(msgspec.json.Decoder(LocalFile), data, name).agents


def _parse_jsonl(name: str, data: bytes) -> list[LocalAgent]:
    decoder = msgspec.json.Decoder(LocalAgent)
    agents: list[LocalAgent] = []
    for lineno, line in enumerate(data.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(b"#"):
            continue
        agents.append(_decode(decoder, stripped, f"{name}:{lineno}"))
    return agents


def _decode(decoder: msgspec.json.Decoder[_T], data: bytes, where: str) -> _T:
    """Decode, or LocalFileError naming `where` (the file, and the line of a JSONL file)."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise LocalFileError(f"{where}: {_where(exc)}") from None
    except msgspec.DecodeError as exc:
        raise LocalFileError(f"{where}: not valid JSON: {exc}") from None
    except RecursionError:
        raise LocalFileError(f"{where}: not valid JSON: nested too deeply") from None


def _where(exc: msgspec.ValidationError) -> str:
    """msgspec says `msg - at `$.agents[0]...``; put the item first, as editors expect."""
    text = str(exc)
    msg, sep, path = text.rpartition(" - at ")
    return f"{path.strip('`')}: {msg}" if sep else text
