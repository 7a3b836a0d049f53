"""Fast protobuf message classes for the server's hot path.

betterproto2's pure-Python codec costs about 1.1 ms to decode a request and
encode a 30-memory response (benchmarks/codec.py); its Rust codec does not
work with betterproto2 0.10. The descriptors betterproto2 generates are
registered in their own pool, so the same schema is served here as upb-backed
classes from `google.protobuf` (about 3.4 µs for the same work). One `just
proto` run produces both; there is no second copy of the schema to drift.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message_factory import GetMessageClass

import ibex._proto.ibex.auth.v1
import ibex._proto.ibex.context.v1  # noqa: F401
from ibex._proto.google_proto_descriptor_pool import default_google_proto_descriptor_pool as POOL

PACKAGE = "ibex.context.v1"


def message_class(name: str) -> Any:
    return GetMessageClass(POOL.FindMessageTypeByName(name))


AssembleContextRequest: Any = message_class(f"{PACKAGE}.AssembleContextRequest")
AssembleContextResponse: Any = message_class(f"{PACKAGE}.AssembleContextResponse")
SearchMemoriesRequest: Any = message_class(f"{PACKAGE}.SearchMemoriesRequest")
SearchMemoriesResponse: Any = message_class(f"{PACKAGE}.SearchMemoriesResponse")
RecordMemoryFeedbackRequest: Any = message_class(f"{PACKAGE}.RecordMemoryFeedbackRequest")
RecordMemoryFeedbackResponse: Any = message_class(f"{PACKAGE}.RecordMemoryFeedbackResponse")
Memory: Any = message_class(f"{PACKAGE}.Memory")
