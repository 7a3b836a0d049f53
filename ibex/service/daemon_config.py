"""`DaemonConfig`: one serving process's address, drain and dependency bounds.

Apart from `ibex.service.daemon` so the settings table (`ibex.config`) reads
the declarations without loading grpclib, trio-asyncio or the assembler.
`DependencyConfig` (warming and probing Redis and the memory service,
`ibex.service.dependencies`) is held by it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env
from ibex.service.edge.connections_config import ConnectionsConfig

__all__ = ["DaemonConfig", "DependencyConfig"]


class DependencyConfig(msgspec.Struct, frozen=True):
    """Time bounds of warming and probing (seconds)."""

    start_timeout: float = 3.0  # per dependency, before serving
    probe_interval: float = 1.0  # between probes of an up dependency
    probe_timeout: float = 1.0
    backoff_min: float = 0.1  # first retry of a down dependency
    backoff_max: float = 5.0


class DaemonConfig(msgspec.Struct, frozen=True):
    """One serving process: where it listens, how long it drains, its connection limits
    and the bounds of warming and probing its dependencies (seconds)."""

    host: str = "127.0.0.1"
    port: int = 9092
    reuse_port: bool = False
    drain_grace: Annotated[float, env("IBEX_CONTEXT_DRAIN_GRACE", unit="s")] = 10.0
    connections: ConnectionsConfig = ConnectionsConfig()
    # This process's own ports besides `port` (a worker's WORKER_PORT_BASE + i), so a
    # client can balance calls over workers; and its worker slot, sent to callers
    # in the `x-ibex-worker` trailer.
    own_ports: tuple[int, ...] = ()
    worker: int | None = None
    # Bounds of warming the dependencies before serving and of probing them after.
    dependencies: DependencyConfig = DependencyConfig()
    # Seconds between two `branch_errors` summary lines of one source.
    branch_errors_interval: float = 10.0
