"""Where directives and memories come from, and the per-request retrieval over them.

What the package offers:

- the source protocols (`DirectiveSource`, `MemorySource`, `BatchRead`) and
  `Answer`, the value a source may return with a short detail;
- the sources: `RedisDirectiveSource` (one endpoint, Sentinel or Cluster, with
  `RedisOptions`), `DirectiveCache` (an in-process cache in front of a
  directive source), `MemoryHttpSource` (the memory service over HTTP/1.1),
  `LocalFileSource` (directives and memories from one local file);
- retrieval: `retrieve` runs a request's branches in one nursery
  (`RetrievalConfig`, `Retrieved`, `BranchListener`, `WallListener`);
  `cold_search` is the cold branch's call alone, for SearchMemories;
- feedback: `send_feedback`, with `FeedbackRejected` and `FeedbackRetryable`;
- errors: `SourceError` and its kinds (`TransportError`, `TransportTimeout`,
  `ResponseTooLarge`, `LocalFileError`).

The modules of the package import from the defining modules, not from here.
Apart from the protocols, the names load on first use, so a process that
needs one module (the ops CLI and the directive envelope codec) does not load
Redis, the HTTP client or Trio for the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ibex.sources.base import Answer, BatchRead, DirectiveSource, MemorySource, SourceError

if TYPE_CHECKING:
    from ibex.sources.directive_cache import DirectiveCache
    from ibex.sources.directive_cache_config import DirectiveCacheConfig
    from ibex.sources.feedback_sender import FeedbackRejected, FeedbackRetryable, send_feedback
    from ibex.sources.http_framing import ResponseTooLarge, TransportError, TransportTimeout
    from ibex.sources.local_file import LocalFileError, LocalFileSource
    from ibex.sources.memory_http import MemoryHttpSource
    from ibex.sources.redis_directive import RedisDirectiveSource
    from ibex.sources.redis_topologies import RedisOptions
    from ibex.sources.retrieval import BranchListener, cold_search, retrieve
    from ibex.sources.retrieval_config import RetrievalConfig
    from ibex.sources.retrieval_wall import WallListener
    from ibex.sources.retrieved import Retrieved

__all__ = [
    "Answer",
    "BatchRead",
    "BranchListener",
    "DirectiveCache",
    "DirectiveCacheConfig",
    "DirectiveSource",
    "FeedbackRejected",
    "FeedbackRetryable",
    "LocalFileError",
    "LocalFileSource",
    "MemoryHttpSource",
    "MemorySource",
    "RedisDirectiveSource",
    "RedisOptions",
    "ResponseTooLarge",
    "RetrievalConfig",
    "Retrieved",
    "SourceError",
    "TransportError",
    "TransportTimeout",
    "WallListener",
    "cold_search",
    "retrieve",
    "send_feedback",
]

# Each name loaded on first use, from the module that defines it.
_DEFINED_IN = {
    "BranchListener": "retrieval",
    "DirectiveCache": "directive_cache",
    "DirectiveCacheConfig": "directive_cache_config",
    "FeedbackRejected": "feedback_sender",
    "FeedbackRetryable": "feedback_sender",
    "LocalFileError": "local_file",
    "LocalFileSource": "local_file",
    "MemoryHttpSource": "memory_http",
    "RedisDirectiveSource": "redis_directive",
    "RedisOptions": "redis_topologies",
    "ResponseTooLarge": "http_framing",
    "RetrievalConfig": "retrieval_config",
    "Retrieved": "retrieved",
    "TransportError": "http_framing",
    "TransportTimeout": "http_framing",
    "WallListener": "retrieval_wall",
    "cold_search": "retrieval",
    "retrieve": "retrieval",
    "send_feedback": "feedback_sender",
}


def __getattr__(name: str) -> Any:
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
