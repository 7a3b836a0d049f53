"""Client library for Python proxies: one reused HTTP/2 connection, fail-open.

`ContextClient` is asyncio (grpclib); from Trio, call the `*_trio` methods inside
`trio_asyncio.open_loop()`. Importing this module loads no server code and no
Trio (the wire messages come from `ibex.wire`; trio-asyncio, which replaces
asyncio's event-loop policy when imported, is imported by the `*_trio` methods
only), so an asyncio proxy's loop and policy stay as it set them. Examples:
docs/api.md. The default deadline is 45 ms. When the daemon is
slow, down or shedding (DEADLINE_EXCEEDED, UNAVAILABLE, RESOURCE_EXHAUSTED
"overloaded: ...") the client does not raise: it returns an `Assembled` marked
degraded whose context is the history alone (`fallback_history`, in
ibex.client_fallback), so the proxy can go on with the call. Input and auth
errors still raise, including a RESOURCE_EXHAUSTED that names a field (an
input that cannot fit): they are bugs to fix, not load to ride out
(`is_input_error`).

Several addresses (`addresses=["10.0.0.5:9100", "10.0.0.5:9101", ...]`, e.g. one
per worker port, see docs/operations.md "One host: workers and per-worker
ports") are balanced per call, round robin, the
way gRPC's `round_robin` policy does it: one HTTP/2 connection per address, each
call on the next one. An address whose connection cannot be made is skipped for
`DOWN_FOR` seconds and the call goes to the next address at once (nothing was
sent, so nothing runs twice); only when no address answers does the call fail
(open).
"""

from __future__ import annotations

import re
import ssl
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import Deadline

from ibex.assembly.structs import Message
from ibex.client_fallback import fallback_history, history_only
from ibex.netaddr import split_host_port
from ibex.wire import (
    SERVICE,
    AssembleContextRequest,
    AssembleContextResponse,
    RecordMemoryFeedbackRequest,
    RecordMemoryFeedbackResponse,
    SearchMemoriesRequest,
    SearchMemoriesResponse,
)

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_FEEDBACK_DEADLINE",
    "Assembled",
    "ContextClient",
    "fallback_history",
    "history_only",
    "is_input_error",
    "parse_address",
]

DEFAULT_DEADLINE = 0.045
# Feedback is sent after the model answered, off the latency path: room for the
# daemon's one retry against the memory service.
DEFAULT_FEEDBACK_DEADLINE = 1.0
FAIL_OPEN = frozenset({Status.DEADLINE_EXCEEDED, Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED})
_PATH = f"/{SERVICE}/"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DOWN_FOR = 1.0  # seconds an address that refused a connection is passed over (gRPC: 1 s backoff)

Address = str | tuple[str, int]


def parse_address(address: Address) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or a (host, port) pair."""
    if isinstance(address, tuple):
        return address[0], int(address[1])
    host, port = split_host_port(address)
    if not host:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, port


# The daemon's overload refusals start with this; any other RESOURCE_EXHAUSTED
# that names a field ("recent_messages: ...") is an input that cannot fit.
_OVERLOADED = "overloaded"
_FIELD_MESSAGE = re.compile(r"[A-Za-z_][\w.\[\]]*: ")


class Assembled(msgspec.Struct, frozen=True):
    """The daemon's answer, or the history-only fallback when it could not answer."""

    context: str
    degraded: bool
    degradation_level: str
    status: str
    response: Any = None
    branches: str = ""
    messages_dropped: int = 0  # fallback only: oldest messages left out to fit the window


def is_input_error(exc: GRPCError) -> bool:
    """An error to raise, not ride out: anything but overload, unavailability or time."""
    if exc.status is Status.RESOURCE_EXHAUSTED:
        message = exc.message or ""
        return not message.startswith(_OVERLOADED) and bool(_FIELD_MESSAGE.match(message))
    return exc.status not in FAIL_OPEN


class ContextClient:
    """A reusable client; open it once per process and share it."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9092,
        *,
        addresses: Sequence[Address] | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        deadline: float = DEFAULT_DEADLINE,
    ) -> None:
        """One address (`host`, `port`), or several (`addresses`) balanced per call.

        Nothing touches asyncio here: each address's channel is made on its first
        call, inside the caller's running loop. (grpclib binds a channel to
        `asyncio.get_event_loop()` when it is made, which outside a running loop
        would create and install a loop in the caller's process.)"""
        self._targets = [parse_address(a) for a in addresses] if addresses else [(host, port)]
        self._ssl = ssl_context
        self._channels: list[Channel | None] = [None] * len(self._targets)
        self._down_until = [0.0] * len(self._targets)
        self._next = 0
        self._metadata = {"authorization": f"Bearer {token}"} if token else None
        self.deadline = deadline

    @staticmethod
    def tls_context(
        ca_file: str, cert_file: str | None = None, key_file: str | None = None
    ) -> ssl.SSLContext:
        """TLS (and mutual TLS when a client cert is given) for HTTP/2."""
        ctx = ssl.create_default_context(cafile=ca_file)
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
        ctx.set_alpn_protocols(["h2"])
        return ctx

    def close(self) -> None:
        for channel in self._channels:
            if channel is not None:
                channel.close()

    def _channel(self, index: int) -> Channel:
        channel = self._channels[index]
        if channel is None:
            host, port = self._targets[index]
            channel = self._channels[index] = Channel(host, port, ssl=self._ssl)
        return channel

    def _rotation(self) -> list[int]:
        """Channel indexes for one call: round robin, addresses marked down last."""
        n = len(self._channels)
        start, self._next = self._next, (self._next + 1) % n
        order = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        return sorted(order, key=lambda i: self._down_until[i] > now)

    async def __aenter__(self) -> ContextClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _unary(
        self,
        path: str,
        request: Any,
        reply: Any,
        timeout: float | None,  # noqa: ASYNC109  (a gRPC deadline, sent as grpc-timeout)
    ) -> Any:
        deadline = Deadline.from_timeout(self.deadline if timeout is None else timeout)
        refused: OSError | None = None
        for index in self._rotation():
            async with self._channel(index).request(
                path,
                Cardinality.UNARY_UNARY,
                type(request),
                reply,
                deadline=deadline,
                metadata=self._metadata,
            ) as stream:
                try:
                    await stream.send_request()
                except TimeoutError:
                    raise
                except OSError as exc:
                    # No connection, so the request never left: try the next address.
                    self._down_until[index] = time.monotonic() + DOWN_FOR
                    refused = exc
                    continue
                await stream.send_message(request, end=True)
                message = await stream.recv_message()
                await stream.recv_trailing_metadata()
                return message, dict(stream.initial_metadata or {})
        assert refused is not None
        raise refused

    async def assemble(
        self,
        request: Any | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (gRPC deadline)
        **fields: Any,
    ) -> Assembled:
        """AssembleContext; `request` is an `ibex.wire.AssembleContextRequest` or its
        fields as keyword arguments (nested messages as `ibex.wire` messages or dicts)."""
        if request is None:
            request = AssembleContextRequest(**fields)
        try:
            msg, meta = await self._unary(
                _PATH + "AssembleContext", request, AssembleContextResponse, timeout
            )
        except GRPCError as exc:
            if is_input_error(exc):
                raise
            return self._fallback(request, exc.status.name)
        except TimeoutError:  # grpclib's own deadline; caught before OSError, its base class
            return self._fallback(request, "DEADLINE_EXCEEDED")
        except (StreamTerminatedError, ConnectionError, OSError):
            return self._fallback(request, "UNAVAILABLE")
        return Assembled(
            context=msg.assembled_context,
            degraded=msg.degradation_level not in ("", "L0"),
            degradation_level=msg.degradation_level,
            status="OK",
            response=msg,
            branches=str(meta.get("x-ibex-branches", "")),
        )

    async def search(
        self,
        request: Any | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (gRPC deadline)
        **fields: Any,
    ) -> Any:
        """SearchMemories; `request` is an `ibex.wire.SearchMemoriesRequest` or its fields.
        Not fail-open: errors raise GRPCError, an unreachable daemon OSError."""
        if request is None:
            request = SearchMemoriesRequest(**fields)
        msg, _ = await self._unary(
            _PATH + "SearchMemories", request, SearchMemoriesResponse, timeout
        )
        return msg

    async def health(
        self,
        service: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (gRPC deadline)
    ) -> str:
        """The standard gRPC Health Check's status name (`SERVING`, `NOT_SERVING`, ...)
        for `service` ("" is the whole server); errors raise GRPCError (NOT_FOUND for a
        service the daemon does not know) or OSError (no connection)."""
        # grpclib's copy of the health messages, imported here: a proxy that has its own
        # (grpcio-health-checking) registers the same protobuf names, and one process
        # cannot load both unless it calls this.
        from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

        msg, _ = await self._unary(
            _HEALTH_CHECK, HealthCheckRequest(service=service), HealthCheckResponse, timeout
        )
        return str(HealthCheckResponse.ServingStatus.Name(msg.status))

    async def record_feedback(
        self,
        memory_ids: Sequence[str],
        feedback: str,
        *,
        org_id: str,
        session_id: str = "",
        trace_id: str = "",
        principal_context: Any = None,
        timeout: float | None = None,  # noqa: ASYNC109  (gRPC deadline)
    ) -> Any:
        """RecordMemoryFeedback; the RecordMemoryFeedbackResponse (success, updates).

        Not fail-open: errors raise GRPCError. UNAVAILABLE (memory service down)
        may be retried with the same arguments: the daemon derives the
        idempotency key from them, so the feedback is still counted once.
        `principal_context` (a `PrincipalContext`) binds the call to its org, as on
        AssembleContext; a daemon with IBEX_CONTEXT_REQUIRE_PRINCIPAL needs it.
        `timeout` defaults to DEFAULT_FEEDBACK_DEADLINE.
        """
        request = RecordMemoryFeedbackRequest(
            memory_ids=list(memory_ids),
            feedback=feedback,
            org_id=org_id,
            session_id=session_id,
            trace_id=trace_id,
            principal_context=principal_context,
        )
        msg, _ = await self._unary(
            _PATH + "RecordMemoryFeedback",
            request,
            RecordMemoryFeedbackResponse,
            DEFAULT_FEEDBACK_DEADLINE if timeout is None else timeout,
        )
        return msg

    def _fallback(self, request: Any, status: str) -> Assembled:
        messages = [Message(m.role, m.content) for m in request.recent_messages]
        context, dropped = fallback_history(
            messages, model=request.model, available_tokens=request.available_tokens
        )
        return Assembled(
            context=context,
            degraded=True,
            degradation_level="L2",
            status=status,
            messages_dropped=dropped,
        )

    # Trio entry points (inside trio_asyncio.open_loop()). trio_asyncio is imported here,
    # not at the top: importing it installs its own asyncio event-loop policy.

    async def assemble_trio(self, request: Any | None = None, **kw: Any) -> Assembled:
        import trio_asyncio

        result: Assembled = await trio_asyncio.aio_as_trio(self.assemble)(request, **kw)
        return result

    async def record_feedback_trio(
        self, memory_ids: Sequence[str], feedback: str, **kw: Any
    ) -> Any:
        import trio_asyncio

        return await trio_asyncio.aio_as_trio(self.record_feedback)(memory_ids, feedback, **kw)

    async def search_trio(self, request: Any | None = None, **kw: Any) -> Any:
        import trio_asyncio

        return await trio_asyncio.aio_as_trio(self.search)(request, **kw)
