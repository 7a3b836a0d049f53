"""The one place an `IbexError` becomes a gRPC status."""

from __future__ import annotations

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from ibex.errors import IbexError


def grpc_error(exc: IbexError) -> GRPCError:
    """The status the error class carries, with its caller-safe message."""
    return GRPCError(Status[exc.status], str(exc))
