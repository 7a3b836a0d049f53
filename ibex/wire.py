"""The wire messages of `ibex.context.v1`, shared by the server and the Python client.

betterproto2's pure-Python codec costs hundreds of times what upb does per
call (`python -m benchmarks.codec`, figures in docs/performance.md), and its
Rust codec does not work with betterproto2 0.10. The descriptors betterproto2
generates are registered in their own pool, so the same schema is served here
as upb-backed classes from `google.protobuf`. One `just proto` run produces
both; there is no second copy of the schema to drift.

This module imports no server code (no `ibex.service`, no Trio), so a proxy
that imports `ibex.client` loads only what a client needs. Every message of
the contract is here, by its proto name: build a request from typed parts,
e.g. `AssembleContextRequest(recent_messages=[Message(role="user", content=...)],
options=AssemblyOptions(max_memories=5))`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message_factory import GetMessageClass

import ibex._proto.ibex.auth.v1
import ibex._proto.ibex.context.v1  # noqa: F401  (registers the descriptors in POOL)
from ibex._proto.google_proto_descriptor_pool import default_google_proto_descriptor_pool as POOL

PACKAGE = "ibex.context.v1"
AUTH_PACKAGE = "ibex.auth.v1"
#: The gRPC service every RPC path starts with.
SERVICE = f"{PACKAGE}.ContextAssemblyService"


def message_class(name: str) -> Any:
    """The upb class of a fully qualified message name."""
    return GetMessageClass(POOL.FindMessageTypeByName(name))


AssembleContextRequest: Any = message_class(f"{PACKAGE}.AssembleContextRequest")
AssembleContextResponse: Any = message_class(f"{PACKAGE}.AssembleContextResponse")
Message: Any = message_class(f"{PACKAGE}.Message")
AssemblyOptions: Any = message_class(f"{PACKAGE}.AssemblyOptions")
AssemblyMetrics: Any = message_class(f"{PACKAGE}.AssemblyMetrics")
MemoryUsed: Any = message_class(f"{PACKAGE}.MemoryUsed")
BranchOutcome: Any = message_class(f"{PACKAGE}.BranchOutcome")
TokenBudget: Any = message_class(f"{PACKAGE}.TokenBudget")
PackSummary: Any = message_class(f"{PACKAGE}.PackSummary")
SearchMemoriesRequest: Any = message_class(f"{PACKAGE}.SearchMemoriesRequest")
SearchMemoriesResponse: Any = message_class(f"{PACKAGE}.SearchMemoriesResponse")
Memory: Any = message_class(f"{PACKAGE}.Memory")
RecordMemoryFeedbackRequest: Any = message_class(f"{PACKAGE}.RecordMemoryFeedbackRequest")
RecordMemoryFeedbackResponse: Any = message_class(f"{PACKAGE}.RecordMemoryFeedbackResponse")
MemoryScoreUpdate: Any = message_class(f"{PACKAGE}.MemoryScoreUpdate")
PrincipalContext: Any = message_class(f"{AUTH_PACKAGE}.PrincipalContext")
