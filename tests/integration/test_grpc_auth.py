"""Caller authentication at the gRPC boundary, seen from the stock grpcio client.

Bearer tokens (configured as SHA-256 hashes), TLS, mutual TLS with a SAN
allow-list (certificates from trustme), the principal binding, and the rule
that a non-loopback bind without authentication refuses to start.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio_asyncio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf.timestamp_pb2 import Timestamp

from ibex.client import ContextClient
from ibex.config import ConfigError, load_settings
from ibex.service.root import make_daemon
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    RunningDaemon,
    daemon_process,
    in_thread,
    running_daemon,
    test_settings,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc, principal_context_pb2

TOKEN = "proxy-token-Aq7sL0n9-do-not-log"
OTHER_TOKEN = "second-proxy-token-for-rotation"
ALLOWED_SAN = "proxy.ibex.test"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def request(principal: Any = None, **fields: Any) -> Any:
    base: dict[str, Any] = dict(org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing")
    return context_pb2.AssembleContextRequest(**{**base, **fields}, principal_context=principal)


def principal(org_id: str = ORG, agent_id: str = AGENT, expires_in: int = 300) -> Any:
    now = int(time.time())
    return principal_context_pb2.PrincipalContext(
        org_id=org_id,
        agent_id=agent_id,
        principal_id="user-1",
        principal_type="user",
        issued_at=Timestamp(seconds=now - 600),
        expires_at=Timestamp(seconds=now + expires_in),
    )


def call(
    daemon: RunningDaemon,
    req: Any,
    *,
    token: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    method: str = "AssembleContext",
) -> Any:
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with daemon.channel(credentials) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        return getattr(stub, method)(req, timeout=5, metadata=metadata)


async def status_of(daemon: RunningDaemon, req: Any, **kw: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await in_thread(call, daemon, req, **kw)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


# -- bearer tokens -----------------------------------------------------------------------------


async def test_bearer_tokens_are_checked_against_their_hashes() -> None:
    hashes = (sha256(TOKEN), sha256(OTHER_TOKEN))
    async with running_daemon(auth_tokens_sha256=hashes) as daemon:
        code, details = await status_of(daemon, request())
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        code, details = await status_of(daemon, request(), token="guess")
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        code, details = await status_of(daemon, request(), token=TOKEN[:-1])
        assert code == grpc.StatusCode.UNAUTHENTICATED and TOKEN[:-1] not in details

        assert (await status_of(daemon, request(), token=TOKEN))[0] == grpc.StatusCode.OK
        assert (await status_of(daemon, request(), token=OTHER_TOKEN))[0] == grpc.StatusCode.OK

        search = context_pb2.SearchMemoriesRequest(org_id=ORG, agent_id=AGENT, query="deploy")
        code, _ = await status_of(daemon, search, method="SearchMemories")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = await status_of(daemon, search, method="SearchMemories", token=TOKEN)
        assert code == grpc.StatusCode.OK

        # Our client sends the token the same way.
        async with trio_asyncio.open_loop():
            client = ContextClient("127.0.0.1", daemon.port, token=TOKEN, deadline=5.0)
            try:
                result = await client.assemble_trio(org_id=ORG, agent_id=AGENT, model="gpt-4o")
            finally:
                client.close()
        assert result.status == "OK" and not result.degraded


# -- principal binding -------------------------------------------------------------------------


OTHER_ORG = "00000000-0000-4000-8000-000000000002"
OTHER_AGENT = "00000000-0000-4000-8000-0000000000b2"


@pytest.fixture
async def daemon() -> Any:
    async with running_daemon() as d:
        yield d


@pytest.mark.parametrize(
    ("bound", "why"),
    [
        (principal(org_id=OTHER_ORG), "org_id/agent_id"),
        (principal(agent_id=OTHER_AGENT), "org_id/agent_id"),
        (principal(org_id="not-a-uuid"), "does not match"),
        (principal(expires_in=-1), "expired"),
    ],
    ids=["other-org", "other-agent", "malformed-org", "expired"],
)
async def test_principal_must_match_and_be_current(
    daemon: RunningDaemon, bound: Any, why: str
) -> None:
    code, details = await status_of(daemon, request(bound))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert why in details
    assert OTHER_ORG not in details and OTHER_AGENT not in details


async def test_matching_principal_is_served(daemon: RunningDaemon) -> None:
    assert (await status_of(daemon, request(principal())))[0] == grpc.StatusCode.OK
    # Upper-case ids are the same UUIDs; an org-wide principal (no agent) covers every agent.
    assert (await status_of(daemon, request(principal(org_id=ORG.upper()))))[0] == (
        grpc.StatusCode.OK
    )
    assert (await status_of(daemon, request(principal(agent_id=""))))[0] == grpc.StatusCode.OK


# -- TLS and mutual TLS ------------------------------------------------------------------------


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    server_cert: Path
    server_key: Path
    dir: Path

    def client(self, san: str, ca: trustme.CA | None = None) -> tuple[bytes, bytes]:
        """(key, chain) PEM for a client certificate with this DNS SAN."""
        leaf = (ca or self.ca).issue_cert(san)
        return leaf.private_key_pem.bytes(), b"".join(p.bytes() for p in leaf.cert_chain_pems)

    def credentials(
        self, client: tuple[bytes, bytes] | None = None, ca: trustme.CA | None = None
    ) -> grpc.ChannelCredentials:
        key, chain = client or (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=(ca or self.ca).cert_pem.bytes(),
            private_key=key,
            certificate_chain=chain,
        )


@pytest.fixture
def pki(tmp_path: Path) -> Iterator[Pki]:
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    server.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(p.bytes() for p in server.cert_chain_pems))
    yield Pki(ca, ca_file, cert, key, tmp_path)


async def test_tls_port_refuses_plaintext_and_serves_tls(pki: Pki) -> None:
    settings = test_settings(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    async with running_daemon(settings) as daemon:
        code, _ = await status_of(daemon, request())  # plaintext HTTP/2 to a TLS port
        assert code == grpc.StatusCode.UNAVAILABLE
        code, _ = await status_of(daemon, request(), credentials=pki.credentials(ca=trustme.CA()))
        assert code == grpc.StatusCode.UNAVAILABLE  # server not trusted by this client
        assert (await status_of(daemon, request(), credentials=pki.credentials()))[0] == (
            grpc.StatusCode.OK
        )
        async with trio_asyncio.open_loop():
            client = ContextClient(
                "127.0.0.1",
                daemon.port,
                ssl_context=ContextClient.tls_context(str(pki.ca_file)),
                deadline=5.0,
            )
            try:
                result = await client.assemble_trio(org_id=ORG, agent_id=AGENT, model="gpt-4o")
            finally:
                client.close()
        assert result.status == "OK"


async def test_mutual_tls_requires_an_allowed_client_certificate(pki: Pki) -> None:
    settings = test_settings(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_file),
        tls_allowed_sans=(ALLOWED_SAN,),
    )
    async with running_daemon(settings) as daemon:
        no_cert, _ = await status_of(daemon, request(), credentials=pki.credentials())
        assert no_cert == grpc.StatusCode.UNAVAILABLE  # the handshake itself fails
        foreign = pki.credentials(pki.client(ALLOWED_SAN, ca=trustme.CA()))
        assert (await status_of(daemon, request(), credentials=foreign))[0] == (
            grpc.StatusCode.UNAVAILABLE
        )
        intruder = pki.credentials(pki.client("intruder.ibex.test"))
        code, details = await status_of(daemon, request(), credentials=intruder)
        assert (code, details) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "client certificate identity is not allowed",
        )
        allowed = pki.credentials(pki.client(ALLOWED_SAN))
        assert (await status_of(daemon, request(), credentials=allowed))[0] == grpc.StatusCode.OK

        # Our client with a client certificate.
        key, chain = pki.client(ALLOWED_SAN)
        (pki.dir / "client.key").write_bytes(key)
        (pki.dir / "client.pem").write_bytes(chain)
        ctx = ContextClient.tls_context(
            str(pki.ca_file), str(pki.dir / "client.pem"), str(pki.dir / "client.key")
        )
        async with trio_asyncio.open_loop():
            client = ContextClient("127.0.0.1", daemon.port, ssl_context=ctx, deadline=5.0)
            try:
                result = await client.assemble_trio(org_id=ORG, agent_id=AGENT, model="gpt-4o")
            finally:
                client.close()
        assert result.status == "OK"


def client_with_sans(ca: trustme.CA, sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
    """(key, chain) PEM for a client certificate with exactly these SANs, signed by `ca`.

    trustme issues DNS, IP and email SANs but not URIs, so this signs with the
    test CA's key (a private attribute of trustme's CA) through `cryptography`.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca._private_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


async def test_san_allow_list_matches_type_and_value(pki: Pki) -> None:
    """An email or URI SAN spelled like an allowed DNS name is refused; DNS ignores case."""
    settings = test_settings(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_file),
        tls_allowed_sans=(
            ALLOWED_SAN,
            "URI:spiffe://ibex.test/proxy",
            "email:ops@Ibex.Test",
            "IP:10.0.0.7",
        ),
    )
    refused = (grpc.StatusCode.UNAUTHENTICATED, "client certificate identity is not allowed")
    cases: dict[str, tuple[list[x509.GeneralName], Any]] = {
        "email spelled as the DNS name": ([x509.RFC822Name(ALLOWED_SAN)], refused),
        "URI spelled as the DNS name": ([x509.UniformResourceIdentifier(ALLOWED_SAN)], refused),
        "DNS spelled as the URI": ([x509.DNSName("spiffe://ibex.test/proxy")], refused),
        "DNS spelled as the IP": ([x509.DNSName("10.0.0.7")], refused),
        "DNS, other case": ([x509.DNSName(ALLOWED_SAN.upper())], grpc.StatusCode.OK),
        "URI": ([x509.UniformResourceIdentifier("spiffe://ibex.test/proxy")], grpc.StatusCode.OK),
        "URI, other case": (
            [x509.UniformResourceIdentifier("spiffe://ibex.test/PROXY")],
            refused,
        ),
        "email, domain case": ([x509.RFC822Name("ops@ibex.test")], grpc.StatusCode.OK),
        "IP": ([x509.IPAddress(ipaddress.ip_address("10.0.0.7"))], grpc.StatusCode.OK),
    }
    seen = {}
    async with running_daemon(settings) as daemon:
        for name, (sans, _) in cases.items():
            creds = pki.credentials(client_with_sans(pki.ca, sans))
            code, details = await status_of(daemon, request(), credentials=creds)
            seen[name] = code if code == grpc.StatusCode.OK else (code, details)
    assert seen == {name: expected for name, (_, expected) in cases.items()}


def test_allowed_san_entries_are_validated() -> None:
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_TLS_ALLOWED_SANS"):
        load_settings({"IBEX_CONTEXT_TLS_ALLOWED_SANS": "otherName:x"})
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_TLS_ALLOWED_SANS"):
        load_settings({"IBEX_CONTEXT_TLS_ALLOWED_SANS": "IP:not-an-ip"})
    sans = "proxy.ibex.test, DNS:b.test, uri:spiffe://x/y, email:a@b.test, IP:::1"
    assert load_settings({"IBEX_CONTEXT_TLS_ALLOWED_SANS": sans}).tls_allowed_sans == (
        "proxy.ibex.test", "DNS:b.test", "uri:spiffe://x/y", "email:a@b.test", "IP:::1"
    )  # fmt: skip


async def test_mutual_tls_and_token_are_both_required(pki: Pki) -> None:
    settings = test_settings(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_file),
        auth_tokens_sha256=(sha256(TOKEN),),
    )
    async with running_daemon(settings) as daemon:
        creds = pki.credentials(pki.client("any.ibex.test"))  # no SAN allow-list: CA suffices
        code, details = await status_of(daemon, request(), credentials=creds)
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        code, _ = await status_of(daemon, request(), credentials=creds, token=TOKEN)
        assert code == grpc.StatusCode.OK


# -- bind policy -------------------------------------------------------------------------------


async def test_non_loopback_bind_without_auth_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_GRPC_ADDR"):
        await make_daemon(test_settings(grpc_addr="0.0.0.0:0")).serve()


async def test_non_loopback_bind_with_auth_or_override_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_daemon(grpc_addr="0.0.0.0:0", auth_tokens_sha256=(sha256(TOKEN),)) as d:
        assert (await status_of(d, request(), token=TOKEN))[0] == grpc.StatusCode.OK
    assert not [r for r in caplog.records if r.getMessage() == "insecure_bind"]
    async with running_daemon(grpc_addr="0.0.0.0:0", allow_insecure=True) as d:
        assert (await status_of(d, request()))[0] == grpc.StatusCode.OK
    warnings = [r for r in caplog.records if r.getMessage() == "insecure_bind"]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def _log_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_cli_serve_bind_policy(tmp_path: Path) -> None:
    """Exit code 2 and the variable on stderr; with the override, a warning line at start."""
    with daemon_process({}, tmp_path / "refused.log", host="0.0.0.0", ready=False) as refused:
        assert await in_thread(refused.wait) == 2
        assert "IBEX_CONTEXT_GRPC_ADDR" in refused.stderr
        assert "IBEX_CONTEXT_ALLOW_INSECURE" in refused.stderr

    env = {"IBEX_CONTEXT_ALLOW_INSECURE": "1"}
    with daemon_process(env, tmp_path / "insecure.log", host="0.0.0.0") as proc:
        proc.terminate()
        assert await in_thread(proc.wait) == 0
        events = _log_events(proc.stderr)
    insecure = [e for e in events if e.get("event") == "insecure_bind"]
    assert len(insecure) == 1 and insecure[0]["level"] == "warning"
