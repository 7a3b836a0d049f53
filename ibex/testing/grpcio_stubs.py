"""The independent grpcio-tools client (pb2 messages and grpc stub) for interop tests.

The modules live in `ibex/testing/_grpcio_client/`, which git ignores: importing this
module makes the tree from `protos/` when it is missing or was made from other protos
or another grpcio-tools (`ibex.tools.protogen.ensure_grpcio_client`), so the interop
tests always speak the contract being tested. grpcio-tools emits absolute imports
(`from ibex.auth.v1 import ...`) that would shadow or collide with the real `ibex`
package if that directory were put on sys.path, so protogen rewrites them to
relative imports and no sys.path handling is needed: import this module as
`ibex.testing.grpcio_stubs`.

The pb2 classes register into protobuf's default descriptor pool under the proto
file names (`ibex/context/v1/context.proto`); the betterproto2 code uses its own
pool, so both can be loaded in one process.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from ibex.tools.protogen import ensure_grpcio_client

ensure_grpcio_client()

from ._grpcio_client.ibex.auth.v1 import principal_context_pb2  # noqa: E402
from ._grpcio_client.ibex.context.v1 import context_pb2, context_pb2_grpc  # noqa: E402

__all__ = ["GrpcioStubs", "context_pb2", "context_pb2_grpc", "load", "principal_context_pb2"]


class GrpcioStubs(NamedTuple):
    context_pb2: ModuleType
    context_pb2_grpc: ModuleType
    principal_context_pb2: ModuleType


def load() -> GrpcioStubs:
    """The pb2 modules; `context_pb2_grpc.ContextAssemblyServiceStub(channel)` is the client."""
    return GrpcioStubs(context_pb2, context_pb2_grpc, principal_context_pb2)
