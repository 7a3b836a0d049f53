"""Caller authentication at the gRPC boundary and the principal binding check.

Bearer tokens are configured as SHA-256 hashes (the daemon never holds the
tokens themselves) and compared in constant time. Mutual TLS is enforced by
the TLS handshake (CERT_REQUIRED against the client CA); an optional allow-list
of subject alternative names narrows which client certificates are accepted.
A SAN matches an entry only when both type and value match (`DNS:` names
case-insensitively): an email or URI SAN spelled like an allowed DNS name is
someone else. When both are configured, both are required.

Tenant scope is enforced here too, not only by the proxy: a token may be bound
to orgs (`token_orgs`), and a caller presenting it may act only for those
(PERMISSION_DENIED otherwise, on every RPC); a token not bound acts for any org,
as the proxy's own token does. With `require_principal`, a call must also carry
a `principal_context` that matches it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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


#: Said for an org outside the caller's scope: the same words whatever the org, so a
#: refusal tells nothing about which orgs or memories exist.
OUT_OF_SCOPE = "the authenticated caller may not act for this org_id"


class Caller(NamedTuple):
    """An authenticated caller: its identity (token hash prefix or certificate SAN) and,
    for a token bound to orgs, those orgs (None: any org)."""

    identity: str
    orgs: frozenset[str] | None = None
    #: The per-org concurrency key of a bound caller: its whole scope, so naming
    #: another of its orgs (or an org it may not act for) never buys another share.
    scope: str = ""

    def may_act_for(self, org_id: str) -> bool:
        return self.orgs is None or org_id in self.orgs

    def fairness_key(self, org_id: str) -> str:
        """Whose share of the assembly slots a call draws on: the bound scope, else the org."""
        return org_id if self.orgs is None else self.scope


ANONYMOUS = Caller("anonymous")


class Authenticator:
    """Bearer-token and client-certificate checks; built by the composition root."""

    def __init__(
        self,
        *,
        token_hashes: tuple[str, ...] = (),
        allowed_sans: tuple[str, ...] = (),
        mtls: bool = False,
        token_orgs: Mapping[str, Sequence[str]] | None = None,
        require_principal: bool = False,
    ) -> None:
        """`token_orgs` maps a token's SHA-256 (hex, one of `token_hashes`) to the canonical
        org UUIDs it may act for."""
        bound = {h.lower(): frozenset(orgs) for h, orgs in (token_orgs or {}).items()}
        if unknown := set(bound) - {h.lower() for h in token_hashes}:
            raise ValueError(f"{len(unknown)} bound token hash(es) are not accepted tokens")
        self._hashes = tuple(bytes.fromhex(h) for h in token_hashes)
        self._callers = tuple(
            Caller(f"token:{h.hex()[:12]}", orgs, "+".join(sorted(orgs)))
            if (orgs := bound.get(h.hex())) is not None
            else Caller(f"token:{h.hex()[:12]}")
            for h in self._hashes
        )
        self._sans = frozenset(parse_allowed_san(s) for s in allowed_sans)
        self.mtls = mtls
        self.require_principal = require_principal

    @property
    def enabled(self) -> bool:
        return bool(self._hashes) or self.mtls

    def authenticate(self, metadata: Mapping[str, Any], peer_cert: dict[str, Any] | None) -> str:
        """The caller's identity (token hash prefix or certificate SAN), or AuthError."""
        return self.caller(metadata, peer_cert).identity

    def caller(self, metadata: Mapping[str, Any], peer_cert: dict[str, Any] | None) -> Caller:
        """The authenticated caller with its org scope, or AuthError."""
        caller = ANONYMOUS
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
                caller = Caller(f"san:{allowed[0]}")
            elif sans:
                caller = Caller(f"san:{sans[0]}")
        if self._hashes:
            raw = metadata.get("authorization")
            if not isinstance(raw, str) or not raw[:7].lower() == "bearer ":
                raise AuthError("missing bearer token")
            digest = hashlib.sha256(raw[7:].strip().encode()).digest()
            # Compare against every configured hash so timing doesn't reveal which matched.
            matched = [hmac.compare_digest(digest, h) for h in self._hashes]
            if not any(matched):
                raise AuthError("invalid bearer token")
            caller = self._callers[matched.index(True)]
        return caller

    def authorize(self, caller: Caller, org_id: str, agent_id: str | None, principal: Any) -> None:
        """PERMISSION_DENIED unless `caller` may act for `org_id` (canonical) and the
        request's `principal` (None when absent) binds it; `agent_id` is None for a
        request that names no agent (RecordMemoryFeedback).

        The scope is checked first and before any I/O, so an org outside it is refused
        alike whatever the rest of the request names.
        """
        if not caller.may_act_for(org_id):
            raise PermissionDenied(OUT_OF_SCOPE)
        if principal is None:
            if self.require_principal:
                raise PermissionDenied("principal_context is required")
            return
        check_principal(principal, org_id, agent_id)


def _san_allowed(san_type: str, value: str, allowed: frozenset[tuple[str, str]]) -> bool:
    try:
        return (san_type, san_key(san_type, value)) in allowed
    except ValueError:
        return False  # a malformed IP SAN matches nothing


def check_principal(
    principal: Any, org_id: str, agent_id: str | None, now: float | None = None
) -> None:
    """The proxy's verified principal must be for this org and agent, and not expired.

    `agent_id` None: the request names no agent, so only the principal's org binds it
    (its agent, when set, must still be a UUID)."""
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
    if p_org != org_id or (p_agent and agent_id is not None and p_agent != agent_id):
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
