"""Caller authentication at the gRPC boundary and the principal binding check.

Bearer tokens are configured as SHA-256 hashes (the daemon never holds the
tokens themselves) and compared in constant time. Mutual TLS is enforced by
the TLS handshake (CERT_REQUIRED against the client CA); an optional allow-list
of subject alternative names narrows which client certificates are accepted.
A SAN matches an entry only when both type and value match (`DNS:` names
case-insensitively): an email or URI SAN spelled like an allowed DNS name is
someone else. When both are configured, both are required.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Mapping
from typing import Any

from ibex.assembly.validation import canonical_uuid
from ibex.errors import AuthError, PermissionDenied
from ibex.netaddr import parse_allowed_san, san_key


def is_loopback(host: str) -> bool:
    """An empty host binds every interface, so it is not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Authenticator:
    """Bearer-token and client-certificate checks; built by the composition root."""

    def __init__(
        self,
        *,
        token_hashes: tuple[str, ...] = (),
        allowed_sans: tuple[str, ...] = (),
        mtls: bool = False,
    ) -> None:
        self._hashes = tuple(bytes.fromhex(h) for h in token_hashes)
        self._sans = frozenset(parse_allowed_san(s) for s in allowed_sans)
        self.mtls = mtls

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
                allowed = [
                    v
                    for t, v in peer_cert.get("subjectAltName", ())
                    if _san_allowed(t, v, self._sans)
                ]
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


def _san_allowed(san_type: str, value: str, allowed: frozenset[tuple[str, str]]) -> bool:
    try:
        return (san_type, san_key(san_type, value)) in allowed
    except ValueError:
        return False  # a malformed IP SAN matches nothing


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
        raise PermissionDenied("principal_context does not match the request") from None
    if p_org != org_id or (p_agent and p_agent != agent_id):
        raise PermissionDenied("principal_context does not match the request's org_id/agent_id")
    ts = _epoch(getattr(principal, "expires_at", None))
    if ts and ts <= now:
        raise PermissionDenied("principal_context has expired")


def _epoch(value: Any) -> float:
    """A protobuf Timestamp, datetime or None as epoch seconds (0 = unset)."""
    if value is None:
        return 0.0
    if hasattr(value, "seconds"):
        return float(value.seconds) + value.nanos / 1e9
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value)
