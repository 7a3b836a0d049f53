"""Server reflection as grpcurl uses it: every listed service describable, method symbols
resolved, and the whole surface behind authentication when auth is on (health stays open).

The client is grpcio-reflection's `ProtoReflectionDescriptorDatabase` in a child
process (its protobuf symbols clash with grpclib's copies in this one).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

from ibex.testing.grpc_harness import SERVICE, child_env, in_thread, running_daemon

TOKEN = "reflection-test-token-not-logged"

_PROBE = r"""
import json, sys
import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

target, token, method = sys.argv[1:4]


class Bearer(grpc.StreamStreamClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    def _details(self, details):
        metadata = list(details.metadata or []) + [("authorization", "Bearer " + token)]
        return details._replace(metadata=metadata)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)


out = {}
with grpc.insecure_channel(target) as raw:
    channel = grpc.intercept_channel(raw, Bearer()) if token else raw
    health = health_pb2_grpc.HealthStub(raw)  # never with a token
    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    db = ProtoReflectionDescriptorDatabase(channel)
    try:
        services = list(db.get_services())
    except grpc.RpcError as exc:
        out["reflection_error"] = exc.code().name
        print(json.dumps(out))
        raise SystemExit(0)
    out["services"] = services
    pool = DescriptorPool(db)
    out["described"] = {}
    for name in services:
        svc = pool.FindServiceByName(name)
        out["described"][name] = {
            "file": db.FindFileContainingSymbol(name).name,
            "methods": [m.name for m in svc.methods],
        }
    out["method_file"] = db.FindFileContainingSymbol(method).name
    m = pool.FindMethodByName(method)
    out["method"] = [m.input_type.full_name, m.output_type.full_name]
print(json.dumps(out))
"""


def probe(target: str, token: str = "") -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, target, token, f"{SERVICE}.AssembleContext"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


EXPECTED_SERVICES = {
    SERVICE: {
        "file": "ibex/context/v1/context.proto",
        "methods": ["AssembleContext", "SearchMemories", "RecordMemoryFeedback"],
    },
    "grpc.health.v1.Health": {
        "file": "grpclib/health/v1/health.proto",
        "methods": ["Check", "Watch"],
    },
}


async def test_every_listed_service_is_describable_and_methods_resolve() -> None:
    async with running_daemon() as d:
        seen = await in_thread(probe, d.target)
    assert seen["health"] == "SERVING"
    assert sorted(seen["services"]) == sorted(EXPECTED_SERVICES)
    assert seen["described"] == EXPECTED_SERVICES
    assert seen["method_file"] == "ibex/context/v1/context.proto"
    assert seen["method"] == [
        "ibex.context.v1.AssembleContextRequest",
        "ibex.context.v1.AssembleContextResponse",
    ]


async def test_reflection_requires_auth_when_auth_is_on_and_health_does_not() -> None:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    async with running_daemon(auth_tokens_sha256=(digest,)) as d:
        anonymous = await in_thread(probe, d.target)
        authenticated = await in_thread(probe, d.target, TOKEN)
    assert anonymous == {"health": "SERVING", "reflection_error": "UNAUTHENTICATED"}
    assert authenticated["health"] == "SERVING"
    assert authenticated["described"] == EXPECTED_SERVICES
    assert authenticated["method_file"] == "ibex/context/v1/context.proto"
