"""Where directives and memories come from: Redis, the memory service, a local file."""

from ibex.sources.base import DirectiveSource, MemorySource, SourceError

__all__ = ["DirectiveSource", "MemorySource", "SourceError"]
