"""Caller authentication at the gRPC boundary and the principal binding check.

Bearer tokens are configured as SHA-256 hashes (the daemon never holds the
tokens themselves) and compared in constant time. Mutual TLS is enforced by
the TLS handshake (CERT_REQUIRED against the client CA); an optional allow-list
of subject alternative names narrows which client certificates are accepted.
When both are configured, both are required.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import ssl
import time
from collections.abc import Mapping
from typing import Any

from ibex.config import ConfigError, Settings
from ibex.validation import canonical_uuid


class AuthError(Exception):
    """Authentication failed (UNAUTHENTICATED); str() is safe to return."""


class PermissionError_(Exception):
    """The authenticated caller may not act for this org/agent (PERMISSION_DENIED)."""


def is_loopback(host: str) -> bool:
    """An empty host binds every interface, so it is not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self._hashes = tuple(bytes.fromhex(h) for h in settings.auth_tokens_sha256)
        self._sans = frozenset(settings.tls_allowed_sans)
        self.mtls = settings.tls_client_ca is not None

    @property
    def enabled(self) -> bool:
        return bool(self._hashes) or self.mtls

    def authenticate(self, metadata: Mapping[str, Any], peer_cert: dict[str, Any] | None) -> str:
        """The caller's identity (token hash prefix or certificate SAN), or AuthError."""
        identity = "anonymous"
        if self.mtls:
            if not peer_cert:
                raise AuthError("a client certificate is required")
            sans = [v for _, v in peer_cert.get("subjectAltName", ())]
            if self._sans:
                allowed = [s for s in sans if s in self._sans]
                if not allowed:
                    raise AuthError("client certificate identity is not allowed")
                identity = f"san:{allowed[0]}"
            elif sans:
                identity = f"san:{sans[0]}"
        if self._hashes:
            raw = metadata.get("authorization")
            if not isinstance(raw, str) or not raw[:7].lower() == "bearer ":
                raise AuthError("missing bearer token")
            digest = hashlib.sha256(raw[7:].strip().encode()).digest()
            # Compare against every configured hash so timing doesn't reveal which matched.
            matched = [hmac.compare_digest(digest, h) for h in self._hashes]
            if not any(matched):
                raise AuthError("invalid bearer token")
            identity = f"token:{self._hashes[matched.index(True)].hex()[:12]}"
        return identity


def check_principal(principal: Any, org_id: str, agent_id: str, now: float | None = None) -> None:
    """The proxy's verified principal must be for this org and agent, and not expired."""
    if principal is None:
        return
    now = time.time() if now is None else now
    try:
        p_org = canonical_uuid("principal_context.org_id", principal.org_id)
        p_agent = (
            canonical_uuid("principal_context.agent_id", principal.agent_id, required=False)
            if principal.agent_id
            else ""
        )
    except ValueError:
        raise PermissionError_("principal_context does not match the request") from None
    if p_org != org_id or (p_agent and p_agent != agent_id):
        raise PermissionError_("principal_context does not match the request's org_id/agent_id")
    ts = _epoch(getattr(principal, "expires_at", None))
    if ts and ts <= now:
        raise PermissionError_("principal_context has expired")


def _epoch(value: Any) -> float:
    """A protobuf Timestamp, datetime or None as epoch seconds (0 = unset)."""
    if value is None:
        return 0.0
    if hasattr(value, "seconds"):
        return float(value.seconds) + value.nanos / 1e9
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value)


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS for the gRPC port (HTTP/2 via ALPN); client certs required when a CA is set."""
    if not settings.tls_cert or not settings.tls_key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"IBEX_CONTEXT_TLS_CERT/KEY: cannot load: {exc}") from None
    if settings.tls_client_ca:
        try:
            ctx.load_verify_locations(settings.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"IBEX_CONTEXT_TLS_CLIENT_CA: cannot load: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


def check_bind_policy(settings: Settings) -> str | None:
    """Refuse a non-loopback bind without authentication unless explicitly allowed.

    Returns a warning to log at every start when the insecure override is in use.
    """
    host, _ = split_addr(settings.grpc_addr)
    has_auth = bool(settings.auth_tokens_sha256) or settings.tls_client_ca is not None
    if is_loopback(host) or has_auth:
        return None
    if not settings.allow_insecure:
        raise ConfigError(
            f"IBEX_CONTEXT_GRPC_ADDR: binding {host} (not loopback) requires caller "
            "authentication (IBEX_CONTEXT_AUTH_TOKENS_SHA256 or IBEX_CONTEXT_TLS_CLIENT_CA); "
            "set IBEX_CONTEXT_ALLOW_INSECURE=1 to accept unauthenticated callers"
        )
    return (
        f"insecure: listening on {host} without caller authentication "
        "(IBEX_CONTEXT_ALLOW_INSECURE=1); any caller can read any tenant's memories"
    )
