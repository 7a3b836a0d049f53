"""`AdmissionConfig`: admission's limits, each setting declared on its field.

Apart from `ibex.service.admission` (the decisions) so the settings table
(`ibex.config`) reads the declarations without loading the serving stack.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env

__all__ = ["AdmissionConfig"]


class AdmissionConfig(msgspec.Struct, frozen=True):
    """Admission limits (seconds). A field an operator sets declares its variable
    (`ibex.envvar.env`); its default here is the only one."""

    max_in_flight: Annotated[int, env("IBEX_CONTEXT_MAX_IN_FLIGHT", bounds=(1, 100_000))] = 256
    max_in_flight_bytes: Annotated[
        int, env("IBEX_CONTEXT_MAX_IN_FLIGHT_BYTES", bounds=(1024, 64 * 1024**3))
    ] = 64 * 1024 * 1024
    #: Request bytes one authenticated caller, and one connection, may hold in flight
    #: (`ibex.service.budgets`); derived from `max_in_flight_bytes`, a quarter of it
    #: (`ibex.config.effective.admission_config`).
    max_caller_bytes: int = 16 * 1024 * 1024
    #: The separate pool for Health, reflection and reads before authentication.
    max_unauthenticated_bytes: Annotated[
        int, env("IBEX_CONTEXT_MAX_UNAUTHENTICATED_BYTES", bounds=(1024, 1024**3))
    ] = 1024 * 1024
    max_concurrent: Annotated[
        int, env("IBEX_CONTEXT_MAX_CONCURRENT_ASSEMBLIES", bounds=(1, 100_000))
    ] = 16
    min_answer: Annotated[float, env("IBEX_CONTEXT_MIN_ANSWER_MS", unit="ms")] = 0.002
    min_useful: Annotated[float, env("IBEX_CONTEXT_MIN_USEFUL_MS", unit="ms")] = 0.020
    queue_target: Annotated[float, env("IBEX_CONTEXT_QUEUE_TARGET_MS", unit="ms")] = 0.005
    queue_interval: Annotated[float, env("IBEX_CONTEXT_QUEUE_INTERVAL_MS", unit="ms")] = 0.100
    read_timeout: Annotated[float, env("IBEX_CONTEXT_REQUEST_READ_TIMEOUT", unit="s")] = 5.0
    saturated: float = 0.5
    wait_margin: float = 0.015
    #: The share of an answer's loop CPU still ahead of a call whose branches are in
    #: flight: its intake is done, and what is left is taking the answers in, the
    #: pipeline and the send (about half an answer in `python -m benchmarks.load --profile`).
    retrieving_share: float = 0.5
    max_org_concurrent: int = 8  # assemblies one org may run at once
    # the longest wait for a thread or a slot without a deadline
    max_queue_wait: Annotated[float, env("IBEX_CONTEXT_MAX_QUEUE_WAIT", unit="s")] = 1.0
    max_thread_queue: int = 64  # calls waiting for a worker thread before the next is refused
