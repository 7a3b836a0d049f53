"""An admission policy swapped in over a real gRPC socket (ibex.service.policies)."""

from __future__ import annotations

from typing import Any

import grpc

from ibex.service.admission import Admission
from ibex.service.daemon import Daemon
from ibex.service.policies import default_policies
from ibex.testing.grpc_harness import AGENT, ORG, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from tests.unit.test_policies import MAINTENANCE_MESSAGE, Maintenance


def _calls(target: str) -> tuple[Any, Any]:
    """SearchMemories, then AssembleContext: each its response or its grpc.RpcError."""
    out: list[Any] = []
    with grpc.insecure_channel(target) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        for rpc, request in (
            (
                stub.SearchMemories,
                context_pb2.SearchMemoriesRequest(org_id=ORG, agent_id=AGENT, query="deploy"),
            ),
            (
                stub.AssembleContext,
                context_pb2.AssembleContextRequest(org_id=ORG, agent_id=AGENT, model="gpt-4o"),
            ),
        ):
            try:
                out.append(rpc(request, timeout=5))
            except grpc.RpcError as exc:
                out.append(exc)
    return out[0], out[1]


async def test_a_test_only_policy_refuses_its_method_over_grpc_while_on() -> None:
    maintenance = Maintenance("SearchMemories")

    def prepare(daemon: Daemon) -> None:
        config = daemon.admission.config
        daemon.admission = Admission(
            config, daemon.metrics, (maintenance, *default_policies(config))
        )

    async with running_daemon(prepare=prepare) as d:
        target = f"127.0.0.1:{d.port}"
        search, assembled = await in_thread(_calls, target)
        assert not isinstance(search, grpc.RpcError)  # off: served
        assert assembled.assembled_context
        maintenance.on = True
        search, assembled = await in_thread(_calls, target)
        assert isinstance(search, grpc.RpcError)
        assert search.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert search.details() == MAINTENANCE_MESSAGE
        assert not isinstance(assembled, grpc.RpcError)  # another method: served
        shed = d.daemon.metrics.shed_requests.labels("maintenance")._value.get()
        assert shed == 1
        assert d.daemon.admission.gated == 0  # every call let through was released
