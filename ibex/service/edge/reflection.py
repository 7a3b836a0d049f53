"""Server reflection: behind caller authentication, and able to describe what it lists.

grpclib's reflection answers from one descriptor pool. Ours holds the ibex
protos (betterproto does not register descriptors anywhere else); grpclib's
health service lives in the default pool, so reflection listed
`grpc.health.v1.Health` but could not describe it. The pool here gets the
health file too, and method symbols (`pkg.Service.Method`, what grpcurl asks
for before a call) resolve to their service's file, as in grpc-go.

Reflection tells a caller the whole API surface, so with authentication on it
asks for the same credentials as the service; health stays open for probes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from google.protobuf.descriptor_pool import DescriptorPool
from grpclib.health.v1 import health_pb2
from grpclib.reflection._deprecated import ServerReflection as ServerReflectionV1Alpha
from grpclib.reflection.service import ServerReflection

from ibex._proto.google_proto_descriptor_pool import default_google_proto_descriptor_pool
from ibex.errors import IbexError
from ibex.service.edge.calls import caller_authenticated
from ibex.service.edge.status import grpc_error


def reflection_pool() -> DescriptorPool:
    """The ibex descriptors plus grpclib's health service (added once)."""
    pool = default_google_proto_descriptor_pool
    try:
        pool.FindFileByName(health_pb2.DESCRIPTOR.name)
    except KeyError:
        pool.AddSerializedFile(health_pb2.DESCRIPTOR.serialized_pb)
    return pool


class _MethodSymbols:
    """Resolve `pkg.Service.Method` to the service's file (grpclib's pool lookup does not)."""

    _pool: Any

    def _file_containing_symbol_response(self, symbol: str) -> Any:
        try:
            self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                found = None
            if found is not None and method in found.methods_by_name:
                return self._file_descriptor_response(found.file)  # type: ignore[attr-defined]
        return super()._file_containing_symbol_response(symbol)  # type: ignore[misc]


class _Reflection(_MethodSymbols, ServerReflection):
    pass


class _ReflectionV1Alpha(_MethodSymbols, ServerReflectionV1Alpha):
    pass


class Authenticates(Protocol):
    """What reflection asks of the service's authenticator (`ibex.service.auth`)."""

    @property
    def enabled(self) -> bool:
        """Callers must authenticate."""

    @property
    def mtls(self) -> bool:
        """Callers present a client certificate."""

    def authenticate(self, metadata: Mapping[str, Any], peer_cert: dict[str, Any] | None) -> str:
        """The caller's identity; raises an `IbexError` for a caller it refuses."""


class _Authenticated:
    """A servable whose every method first authenticates the caller."""

    def __init__(self, inner: Any, auth: Authenticates) -> None:
        self._inner = inner
        self._auth = auth

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            name: h._replace(func=self._guard(h.func))
            for name, h in self._inner.__mapping__().items()
        }

    def _guard(self, func: Callable[..., Any]) -> Callable[..., Any]:
        auth = self._auth

        async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
            try:
                peer_cert = stream.peer.cert() if auth.mtls else None
                auth.authenticate(stream.metadata or {}, peer_cert)
            except IbexError as exc:
                raise grpc_error(exc) from None
            caller_authenticated(stream)
            await func(stream)

        return run


def with_reflection(services: Collection[Any], auth: Authenticates) -> list[Any]:
    """`services` plus reflection (v1 and v1alpha), authenticated when auth is on."""
    pool = reflection_pool()
    names = [next(iter(s.__mapping__())).split("/")[1] for s in services]
    added: list[Any] = [
        _Reflection(_service_names=names, _pool=pool),
        _ReflectionV1Alpha(_service_names=names, _pool=pool),
    ]
    if auth.enabled:
        added = [_Authenticated(s, auth) for s in added]
    return [*services, *added]
