"""One synthetic assembly per tokenizer family before serving, so no caller pays first-call costs.

The first assembly of a process pays for what later ones find ready: lazily
imported modules, msgspec decoders and upb message classes used for the first
time, numpy's first call, tiktoken's first encode of each encoding, the
regexes of the formatter. Inside a 5 ms directive or 15 ms hot branch budget,
or the 40 ms wall, that cost is a degraded answer for whoever calls first.

`warm_pipeline` runs the wire conversion, validation, retrieval (its nursery,
cancel scopes and branch tasks), the early work as branches land, the pure
pipeline, and the response conversion, through the real `Assembler`, once per
tokenizer family of the catalog. The sources are in-memory stand-ins whose
answers go through the real decoders (the directive envelope, the memory
service's JSON), so the assembly touches no dependency: nothing is read from
Redis or the memory service, no feedback is written, and since it does not go
through the gRPC handler it is counted in no metric (the token-cache counters
are read relative to the count after warming, see the daemon).
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from typing import Any, Final, Literal

import msgspec
import trio

from ibex.assembly.structs import Directive, MemoryHit
from ibex.service import convert, pb
from ibex.service.assembler import Assembler
from ibex.sources.directive_envelope import decode_directive
from ibex.sources.memory_schema import decode_hits

__all__ = ["warm_pipeline"]

# The retrieval times the warm-up raises to `_WARM_UP_TIME` seconds (see `warm_pipeline`).
_BRANCH_TIMES: Final = ("timeout", "deadline", "directive_timeout", "hot_timeout", "cold_timeout")
_WARM_UP_TIME: Final = 5.0

log = logging.getLogger(__name__)

# Ids no tenant has: the stand-in sources below answer them, nothing else sees them.
ORG: Final = str(uuid.UUID(int=0x1BE7_0000_0000_4000_8000_0000_0000_0001, version=4))
AGENT: Final = str(uuid.UUID(int=0x1BE7_0000_0000_4000_8000_0000_0000_0002, version=4))
_VERSION: Final = "00000000-0000-4000-8000-00000000beef"
_TEXTS: Final = (
    "The checkout service returns 502 after a pool change; roll back first, then compare "
    "the pool's max_size with the database's connection limit.",
    "接続プールの設定変更後にエラー率が上昇した場合は、まずロールバックしてください。",
    "```python\ndef retry(op, attempts=3):\n    for i in range(attempts):\n        op()\n```",
    "Escalate refunds above 500 EUR to the payments on-call ✅ and log the ticket 🎫.",
)
_CATEGORIES: Final = ("procedural", "factual", "preference", "episodic")


def _answer(branch: Literal["hot", "cold"], n: int) -> bytes:
    """A memory-service answer (contract section 2) with `n` results."""
    results = [
        {
            "memory": {
                "id": str(
                    uuid.UUID(
                        int=(0xBEEF << 64) + (2 if branch == "cold" else 1) * 100 + i, version=4
                    )
                ),
                "org_id": ORG,
                "agent_id": AGENT,
                "content": _TEXTS[i % len(_TEXTS)],
                "category": _CATEGORIES[i % len(_CATEGORIES)],
                "confidence": 0.9 - i * 0.05,
                "created_at": "2025-06-01T08:30:00Z",
                "usefulness": 0.5,
                "access_count": i,
                "tags": ["warm"],
            },
            "similarity": 0.95 - i * 0.05,
            "rank": i + 1,
            "source": "vector" if branch == "cold" else "hot",
        }
        for i in range(n)
    ]
    return json.dumps({"data": {"results": results}}, ensure_ascii=False).encode()


class _SyntheticSources:
    """Directive and memory source answering the synthetic tenant from memory, via the
    real decoders; each answer yields once, as a network answer would."""

    def __init__(self) -> None:
        envelope = {
            "v": 1,
            "content": "You are the warm-up agent. Answer briefly. 簡潔に答えてください。",
            "injection_mode": "system_first",
            "version_id": _VERSION,
        }
        self._directive = json.dumps(envelope, ensure_ascii=False).encode()
        self._hot = _answer("hot", 4)
        self._cold = _answer("cold", 4)

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        await trio.lowlevel.checkpoint()
        return decode_directive(self._directive)

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.lowlevel.checkpoint()
        return decode_hits(self._hot, "hot", limit=limit)

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        await trio.lowlevel.checkpoint()
        return decode_hits(self._cold, "cold", limit=limit)

    async def aclose(self) -> None:
        return None


def _models(assembler: Assembler) -> list[str]:
    """One model per tokenizer family (exact encodings and the estimate alike)."""
    seen: dict[str, str] = {}
    for model_id, cap in assembler.catalog.models.items():
        seen.setdefault(cap.tokenizer_family, model_id)
    return sorted(seen.values())


def _request(model: str, n: int) -> Any:
    """The wire request, serialized and parsed again as the handler receives one."""
    msg = pb.AssembleContextRequest(
        agent_id=AGENT,
        org_id=ORG,
        session_id=f"warm-up-{n}",
        query="why did checkout return 502 after the pool change",
        model=model,
        directive_version_id=_VERSION,
        recent_messages=[
            {"role": "user", "content": _TEXTS[0]},
            {"role": "assistant", "content": _TEXTS[1]},
            {"role": "user", "content": _TEXTS[3]},
        ],
        request_id=str(uuid.UUID(int=(0xBEEF << 32) + n, version=4)),
    )
    return pb.AssembleContextRequest.FromString(msg.SerializeToString())


async def warm_pipeline(assembler: Assembler) -> float:
    """Run one synthetic assembly per tokenizer family; seconds taken. Never raises
    (a failure is logged and the daemon serves anyway: it costs the first call's speed,
    never an answer)."""
    t0 = time.perf_counter()
    sources = _SyntheticSources()
    offline = copy.copy(assembler)
    offline.directive_source = offline.memory_source = sources
    offline.feedback_sink = None
    # The stand-ins answer at once, but the first assembly pays every first-use cost
    # inside its branches: on a busy host that can pass a 5 ms budget, and a branch
    # that times out leaves its decoding and the pipeline's use of it unwarmed.
    offline.retrieval = msgspec.structs.replace(
        assembler.retrieval, **dict.fromkeys(_BRANCH_TIMES, _WARM_UP_TIME)
    )
    try:
        for n, model in enumerate(_models(assembler)):
            request = assembler.check_request(convert.request_from_proto(_request(model, n)))
            result = await offline.assemble_checked(request)
            convert.branches_header(result)
            convert.response_to_proto(result).SerializeToString()
    except Exception:
        log.exception("warm_up_assembly_failed")
    return time.perf_counter() - t0
