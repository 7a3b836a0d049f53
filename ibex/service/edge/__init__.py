"""The HTTP/2 and gRPC edge: connections, frames, flow control and reading a request's bytes.

Serving (`ibex.service`) builds on it; nothing here knows what an assembly is, who a
caller is or how admission decides (what it needs is passed in: a gate callable, a
byte reservation, an authenticator protocol), and it reads no settings.

What serving uses:

- listening: `TrackedServer` and `track_connections` (every accepted connection
  through the tracked protocol, with the HEADERS gate), `bound_port`, `listen_also`,
  `stop_accepting`, and `grpclib_configuration` (the receive windows);
- connections: `Connections` and `ConnectionsConfig` (caps, idle close, age, the
  two-step GOAWAY), `default_max_connections`, `LoopErrorHandler`;
- a call: `CallDeadline` (arrival and deadline, read once from its HEADERS),
  `call_deadline`, `handler_started`, `caller_authenticated`, `connection_of`;
- its request: `recv_bounded`, `request_complete`, and `request_rules` /
  `check_counts` / `Rules` (repeated fields counted on the wire);
- its answer: `grpc_error` (an `IbexError` as a gRPC status), `in_trio` (the one
  crossing into Trio), `answer_in_trio` (a unary answer made in Trio and written
  from there, `Reply`), `raise_swallowed_cancel` (a handler cancelled after its
  Trio side's last checkpoint ends cancelled);
- Health and reflection: `BoundedReads`, `HEALTH_MAX_MESSAGE_BYTES`,
  `REFLECTION_MAX_MESSAGE_BYTES`, `with_reflection`.

Each name is imported from its module on first use: the settings table reads
`ConnectionsConfig` (`connections_config`) without loading grpclib, h2 or Trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ibex._lazy import lazy_exports

if TYPE_CHECKING:
    from ibex.service.edge.bounded import (
        HEALTH_MAX_MESSAGE_BYTES,
        REFLECTION_MAX_MESSAGE_BYTES,
        BoundedReads,
    )
    from ibex.service.edge.calls import call_deadline, caller_authenticated, handler_started
    from ibex.service.edge.connections import Connections
    from ibex.service.edge.connections_config import ConnectionsConfig, default_max_connections
    from ibex.service.edge.crossing import Reply, answer_in_trio, in_trio, raise_swallowed_cancel
    from ibex.service.edge.deadline import CallDeadline
    from ibex.service.edge.flow import grpclib_configuration
    from ibex.service.edge.listeners import (
        TrackedServer,
        bound_port,
        listen_also,
        stop_accepting,
        track_connections,
    )
    from ibex.service.edge.loop_errors import LoopErrorHandler
    from ibex.service.edge.reflection import with_reflection
    from ibex.service.edge.status import grpc_error
    from ibex.service.edge.stream_reads import connection_of, recv_bounded, request_complete
    from ibex.service.edge.wire_counts import Rules, check_counts, request_rules

__all__ = [
    "HEALTH_MAX_MESSAGE_BYTES",
    "REFLECTION_MAX_MESSAGE_BYTES",
    "BoundedReads",
    "CallDeadline",
    "Connections",
    "ConnectionsConfig",
    "LoopErrorHandler",
    "Reply",
    "Rules",
    "TrackedServer",
    "answer_in_trio",
    "bound_port",
    "call_deadline",
    "caller_authenticated",
    "check_counts",
    "connection_of",
    "default_max_connections",
    "grpc_error",
    "grpclib_configuration",
    "handler_started",
    "in_trio",
    "listen_also",
    "raise_swallowed_cancel",
    "recv_bounded",
    "request_complete",
    "request_rules",
    "stop_accepting",
    "track_connections",
    "with_reflection",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "HEALTH_MAX_MESSAGE_BYTES": "bounded",
        "REFLECTION_MAX_MESSAGE_BYTES": "bounded",
        "BoundedReads": "bounded",
        "CallDeadline": "deadline",
        "Connections": "connections",
        "ConnectionsConfig": "connections_config",
        "LoopErrorHandler": "loop_errors",
        "Reply": "crossing",
        "Rules": "wire_counts",
        "TrackedServer": "listeners",
        "answer_in_trio": "crossing",
        "bound_port": "listeners",
        "call_deadline": "calls",
        "caller_authenticated": "calls",
        "check_counts": "wire_counts",
        "connection_of": "stream_reads",
        "default_max_connections": "connections_config",
        "grpc_error": "status",
        "grpclib_configuration": "flow",
        "handler_started": "calls",
        "in_trio": "crossing",
        "listen_also": "listeners",
        "raise_swallowed_cancel": "crossing",
        "recv_bounded": "stream_reads",
        "request_complete": "stream_reads",
        "request_rules": "wire_counts",
        "stop_accepting": "listeners",
        "track_connections": "listeners",
        "with_reflection": "reflection",
    },
)
