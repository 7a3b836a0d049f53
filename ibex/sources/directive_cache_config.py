"""`DirectiveCacheConfig`: the directive cache"s bounds, each setting declared on its field.

Apart from `ibex.sources.directive_cache` so the settings table (`ibex.config`)
reads the declarations without loading Trio.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env

__all__ = ["DirectiveCacheConfig"]


class DirectiveCacheConfig(msgspec.Struct, frozen=True):
    """Bounds of the directive cache; `max_entries` = 0 turns it off."""

    max_entries: Annotated[
        int, env("IBEX_CONTEXT_DIRECTIVE_CACHE_ENTRIES", bounds=(0, 10_000_000))
    ] = 10_000
    max_bytes: Annotated[
        int, env("IBEX_CONTEXT_DIRECTIVE_CACHE_BYTES", bounds=(0, 4 * 1024**3))
    ] = 16 * 1024 * 1024
    ttl: Annotated[float, env("IBEX_CONTEXT_DIRECTIVE_CACHE_TTL", unit="s")] = (
        1.0  # seconds an entry answers a call that names no version
    )
    max_age: Annotated[float, env("IBEX_CONTEXT_DIRECTIVE_CACHE_MAX_AGE", unit="s")] = (
        2.0  # seconds an entry answers a call naming its version
    )
    # Seconds a refresh (one per key, in the cache's own task) may take; it outlives the
    # branch that asked for it, so a read cut at the branch's 5 ms still refreshes the entry.
    refresh_timeout: float = 0.25
