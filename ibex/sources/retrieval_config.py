"""`RetrievalConfig`: the retrieval layer"s time and size limits, each setting declared on
its field.

Apart from `ibex.sources.retrieval` so the settings table (`ibex.config`) reads the
declarations without loading Trio.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env

__all__ = ["RetrievalConfig"]


class RetrievalConfig(msgspec.Struct, frozen=True):
    """Time and size limits of the retrieval layer (seconds). Each field declares the
    variable that sets it (`ibex.envvar.env`); its default here is the only one."""

    timeout: Annotated[float, env("IBEX_CONTEXT_TIMEOUT", unit="ms")] = 0.045
    deadline: Annotated[float, env("IBEX_CONTEXT_DEADLINE_MS", unit="ms")] = 0.040
    directive_timeout: Annotated[float, env("IBEX_CONTEXT_DIRECTIVE_TIMEOUT_MS", unit="ms")] = 0.005
    hot_timeout: Annotated[float, env("IBEX_CONTEXT_HOT_TIMEOUT_MS", unit="ms")] = 0.015
    cold_timeout: Annotated[float, env("IBEX_CONTEXT_COLD_TIMEOUT_MS", unit="ms")] = 0.045
    pipeline_headroom: Annotated[float, env("IBEX_CONTEXT_PIPELINE_HEADROOM_MS", unit="ms")] = 0.010
    hot_limit: Annotated[int, env("IBEX_CONTEXT_HOT_LIMIT", bounds=(1, 100))] = 20
    cold_limit: Annotated[int, env("IBEX_CONTEXT_COLD_LIMIT", bounds=(1, 100))] = 20
    min_confidence: Annotated[float, env("IBEX_CONTEXT_MIN_CONFIDENCE", bounds=(0.0, 1.0))] = 0.0

    @property
    def time_limit(self) -> float:
        """Seconds a call's retrieval may take at most, min(TIMEOUT, DEADLINE_MS): the
        contract's server-side retrieval wall."""
        return min(self.timeout, self.deadline)
