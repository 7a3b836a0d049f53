import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrincipalContext(_message.Message):
    __slots__ = ("org_id", "principal_id", "agent_id", "principal_type", "authz_snapshot_id", "authz_snapshot_digest", "authority", "issued_at", "expires_at", "request_id", "trace_id", "source", "permissions", "token_id")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_TYPE_FIELD_NUMBER: _ClassVar[int]
    AUTHZ_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHZ_SNAPSHOT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    principal_id: str
    agent_id: str
    principal_type: str
    authz_snapshot_id: str
    authz_snapshot_digest: str
    authority: str
    issued_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    request_id: str
    trace_id: str
    source: str
    permissions: int
    token_id: str
    def __init__(self, org_id: _Optional[str] = ..., principal_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., principal_type: _Optional[str] = ..., authz_snapshot_id: _Optional[str] = ..., authz_snapshot_digest: _Optional[str] = ..., authority: _Optional[str] = ..., issued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., request_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., source: _Optional[str] = ..., permissions: _Optional[int] = ..., token_id: _Optional[str] = ...) -> None: ...

class PrincipalContextProof(_message.Message):
    __slots__ = ("context", "signature_algorithm", "signature", "key_id")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    context: PrincipalContext
    signature_algorithm: str
    signature: bytes
    key_id: str
    def __init__(self, context: _Optional[_Union[PrincipalContext, _Mapping]] = ..., signature_algorithm: _Optional[str] = ..., signature: _Optional[bytes] = ..., key_id: _Optional[str] = ...) -> None: ...
