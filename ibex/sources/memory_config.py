"""`MemoryServiceConfig`: the memory-service client"s bounds, each setting declared on its
field.

Apart from `ibex.sources.memory_http` so the settings table (`ibex.config`) reads the
declarations without loading the HTTP client and Trio.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env
from ibex.sources.memory_schema import DEFAULT_MAX_CONTENT_BYTES

__all__ = ["MemoryServiceConfig"]


class MemoryServiceConfig(msgspec.Struct, frozen=True):
    """Bounds of the memory-service client: its pools, a whole answer, one memory."""

    #: Keep-alive connections per branch (hot and cold have a pool each).
    pool_size: Annotated[int, env("IBEX_CONTEXT_MEMORY_POOL_SIZE", bounds=(1, 4096))] = 32
    #: A whole answer of the contract's largest page (100 memories at the 32 KiB content
    #: cap) is about 3.3 MiB; anything longer is not an answer to our request.
    max_response_bytes: Annotated[
        int, env("IBEX_CONTEXT_MEMORY_MAX_RESPONSE_BYTES", bounds=(1024, 1024**3))
    ] = 4 * 1024 * 1024
    #: One memory's content (the local source reads it too).
    max_content_bytes: Annotated[
        int, env("IBEX_CONTEXT_MEMORY_MAX_CONTENT_BYTES", bounds=(1, 64 * 1024 * 1024))
    ] = DEFAULT_MAX_CONTENT_BYTES
