"""No peer can take the gRPC port from the others (issue 20 rows 1, 2, 7 and 10).

Against the in-process daemon over real loopback sockets, with raw HTTP/2 (h2) where a
stock client cannot misbehave on purpose:

- row 1: Health reads its request bounded (1 KiB), under the read timeout, counted;
- row 10: a request's bytes count toward MAX_IN_FLIGHT_BYTES as they arrive, one step ahead;
- row 2: one peer holding every socket it can open (idle, or holding Health/Watch) does
  not keep an authenticated caller out; Watch is capped per connection and is not
  activity; a connection with no authenticated call is closed;
- row 7: a TLS connection counts from accept and its handshake has a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import trustme

from ibex.service.edge.stream_reads import LOOK_AHEAD
from ibex.testing.grpc_harness import AGENT, ORG, SERVICE, in_thread, running_daemon, test_settings
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import running_memory_server

TOKEN = "edge-test-token-not-a-secret"
HASHES = (hashlib.sha256(TOKEN.encode()).hexdigest(),)
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
ASSEMBLE = f"/{SERVICE}/AssembleContext"
MIB = 1024 * 1024
# About connections, not latency: generous retrieval budgets so a loaded machine answers.
RELAXED: dict[str, Any] = dict(
    timeout=2.0, deadline=2.0, directive_timeout=2.0, hot_timeout=2.0, cold_timeout=2.0
)


def prefix(length: int) -> bytes:
    return struct.pack(">?I", False, length)


def health_request(service: str = "") -> bytes:
    body = service.encode()
    payload = (b"\x0a" + bytes([len(body)]) + body) if body else b""
    return prefix(len(payload)) + payload


def assemble_request() -> bytes:
    payload = context_pb2.AssembleContextRequest(
        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
    ).SerializeToString()
    return prefix(len(payload)) + payload


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Raw:
    """A raw HTTP/2 client connection (h2) on a blocking socket, from `source`."""

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=10, source_address=(source, 0)
        )
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()
        self.status: dict[int, str] = {}
        self.reset: set[int] = set()
        self.eof = False
        settled = False
        while not settled:  # the server's SETTINGS (its windows) before any DATA
            settled = any(isinstance(e, h2.events.RemoteSettingsChanged) for e in self.pump())
            if self.eof:
                raise ConnectionError("closed by the server before its SETTINGS")

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, timeout: float = 10.0) -> list[Any]:
        """One read's events ([] and `eof` at EOF or a reset connection)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return []
        events = self.conn.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                for k, v in event.headers:
                    if _text(k) == "grpc-status":
                        self.status[event.stream_id] = _text(v)
            elif isinstance(event, h2.events.StreamReset):
                self.reset.add(event.stream_id)
        self.flush()
        return events

    def open(self, path: str, token: str | None = None) -> int:
        stream = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        self.conn.send_headers(stream, headers)
        self.flush()
        return stream

    def send(self, stream: int, data: bytes, end: bool = False) -> None:
        """Send within the flow-control window; stops early once the stream is reset."""
        while data:
            if stream in self.reset or self.eof:
                return
            window = min(
                self.conn.local_flow_control_window(stream), self.conn.max_outbound_frame_size
            )
            if window <= 0:
                self.pump()
                continue
            self.conn.send_data(stream, data[:window])
            data = data[window:]
            self.flush()
        if end:
            self.conn.end_stream(stream)
            self.flush()

    def wait_status(self, stream: int, timeout: float) -> str | None:
        """The stream's grpc-status, or None if none came within `timeout`."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            while stream not in self.status and not self.eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.pump(left)
        return self.status.get(stream)

    def wait_closed(self, timeout: float) -> bool:
        """True when the server closed the connection within `timeout`."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            while not self.eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.pump(left)
        return self.eof

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def raws(port: int, n: int, source: str = "127.0.0.1") -> Iterator[list[Raw]]:
    opened: list[Raw] = []
    try:
        for _ in range(n):
            opened.append(Raw(port, source))
        yield opened
    finally:
        for r in opened:
            r.close()


@contextlib.contextmanager
def idle_sockets(port: int, n: int, source: str = "127.0.0.1") -> Iterator[list[socket.socket]]:
    """`n` TCP connections that never send a byte (nor a TLS ClientHello)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(
                socket.create_connection(
                    ("127.0.0.1", port), timeout=10, source_address=(source, 0)
                )
            )
        yield socks
    finally:
        for s in socks:
            s.close()


def until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True when the server closed `sock` within `timeout` (whatever it sent before)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def assemble(channel: grpc.Channel, token: str | None = TOKEN) -> str:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
    request = context_pb2.AssembleContextRequest(
        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
    )
    return str(stub.AssembleContext(request, timeout=10, metadata=metadata).degradation_level)


# -- row 1: Health reads bounded, timed and counted ---------------------------------------------


async def test_health_check_declaring_64_mib_is_refused_before_its_bytes_are_read() -> None:
    async with running_daemon(auth_tokens_sha256=HASHES, request_read_timeout=0.5) as d:

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with raws(d.port, 1) as (raw,):
                big = raw.open(CHECK)  # no credentials: Health is open to probes
                raw.send(big, prefix(64 * MIB) + b"\x00" * (64 * 1024))
                out["big"] = raw.wait_status(big, timeout=5)
                until(lambda: big in raw.reset or raw.eof, 2)
                out["big_reset"] = big in raw.reset
                stalled = raw.open(CHECK)
                raw.send(stalled, prefix(100) + b"\x0a")  # under the cap, then nothing
                pool = d.daemon.admission.unauthenticated
                until(lambda: pool.held >= 100, 2)
                out["counted"] = pool.held
                out["authenticated_counted"] = d.daemon.admission.in_flight_bytes
                out["stalled"] = raw.wait_status(stalled, timeout=5)
                ok = raw.open(CHECK)
                raw.send(ok, health_request(), end=True)
                out["ok"] = raw.wait_status(ok, timeout=5)
            return out

        out = await in_thread(scenario)
        assert d.daemon.admission.in_flight_bytes == 0
        assert d.daemon.admission.unauthenticated.held == 0
    assert out["big"] == "8"  # RESOURCE_EXHAUSTED, read no further than the prefix
    assert out["big_reset"]  # and reset: the peer stops sending
    # The declared bytes (under one look-ahead step), counted while they arrive, in the
    # unauthenticated pool: not in the authenticated callers' budget.
    assert out["counted"] == 100
    assert out["authenticated_counted"] == 0
    assert out["stalled"] == "4"  # DEADLINE_EXCEEDED at the read timeout
    assert out["ok"] == "0"


async def test_reflection_reads_are_bounded_too() -> None:
    async with running_daemon(request_read_timeout=0.5) as d:

        def scenario() -> str | None:
            with raws(d.port, 1) as (raw,):
                stream = raw.open("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
                raw.send(stream, prefix(64 * MIB) + b"\x00" * 1024)
                return raw.wait_status(stream, timeout=5)

        assert await in_thread(scenario) == "8"


# -- row 10: a request's bytes count toward MAX_IN_FLIGHT_BYTES as they arrive ------------------


async def test_a_partly_received_request_counts_what_has_arrived_plus_one_step() -> None:
    async with running_daemon(
        max_in_flight_bytes=4 * MIB, request_read_timeout=1.5, **RELAXED
    ) as d:
        state = d.daemon.admission
        counted = MIB + LOOK_AHEAD  # what arrived, and the step being read

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with raws(d.port, 2) as (slow, other):
                first = slow.open(ASSEMBLE)
                slow.send(first, prefix(3 * MIB) + b"\x00" * MIB)  # 1 of 3 MiB, then a stall
                out["counted"] = until(lambda: state.in_flight_bytes == counted, 5)
                out["first"] = slow.wait_status(first, timeout=5)
                out["released"] = until(lambda: state.in_flight_bytes == 0, 5)
                third = other.open(ASSEMBLE)
                other.send(third, assemble_request(), end=True)
                out["third"] = other.wait_status(third, timeout=10)
            return out

        out = await in_thread(scenario)
    assert out["counted"]  # 1 MiB arrived plus one look-ahead step, not the declared 3 MiB
    assert out["first"] == "4"  # the stalled one ends at the read timeout
    assert out["released"]
    assert out["third"] == "0"


# -- row 2: fair connections ---------------------------------------------------------------------


async def test_one_peer_holding_every_socket_does_not_keep_an_authenticated_caller_out() -> None:
    """Cap 8, one address: 8 idle sockets and 6 connections holding an unauthenticated
    Health/Watch (the per-peer cap is the process cap here, so eviction does the work)."""
    async with running_daemon(
        max_connections=8,
        max_connections_per_peer=8,
        connection_auth_timeout=60.0,
        auth_tokens_sha256=HASHES,
        **RELAXED,
    ) as d:

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {"levels": []}
            with raws(d.port, 6) as watchers:
                for w in watchers:
                    w.send(w.open(WATCH), health_request(), end=True)
                with idle_sockets(d.port, 8):
                    until(lambda: getattr(d.daemon.connections, "evicted", 0) >= 6, 5)
                    out["full"] = d.daemon.connections.count
                    with grpc.insecure_channel(d.target) as channel:
                        out["levels"] += [assemble(channel) for _ in range(10)]
                    for _ in range(3):  # and new connections, each evicting a socket holder
                        with grpc.insecure_channel(d.target) as fresh:
                            out["levels"].append(assemble(fresh))
            return out

        out = await in_thread(scenario)
        assert out["full"] == 8
        assert out["levels"] == ["L0"] * 13
        assert d.daemon.connections.evicted >= 7  # the 6 watchers, then an idle socket


def _from(conns: Any, address: str) -> int:
    return sum(
        1
        for c in list(conns._conns)
        if getattr(c, "_raw", None) is not None and c._raw.get_extra_info("peername")[0] == address
    )


async def test_the_per_peer_cap_keeps_one_address_to_its_share() -> None:
    async with running_daemon(
        max_connections=8, max_connections_per_peer=2, connection_auth_timeout=60.0, **RELAXED
    ) as d:
        conns = d.daemon.connections

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with idle_sockets(d.port, 10, source="127.0.0.2") as held:
                # the daemon's own view: its open connections from that address
                until(lambda: _from(conns, "127.0.0.2") == 2, 5)
                out["peer"] = _from(conns, "127.0.0.2")
                # the 8 older ones were evicted by the peer's own newer ones
                out["closed"] = sum(closed_by_server(s, 5) for s in held[:8])
                with grpc.insecure_channel(d.target) as channel:
                    out["level"] = assemble(channel, token=None)
            return out

        out = await in_thread(scenario)
    assert out == {"peer": 2, "closed": 8, "level": "L0"}


async def test_watch_is_capped_per_connection_and_is_not_activity() -> None:
    async with running_daemon(
        connection_idle_timeout=0.5, connection_auth_timeout=60.0, **RELAXED
    ) as d:

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with raws(d.port, 1) as (raw,):
                call = raw.open(ASSEMBLE)  # authenticated (auth is off): a caller's connection
                raw.send(call, assemble_request(), end=True)
                out["call"] = raw.wait_status(call, timeout=10)
                watches = []
                for _ in range(5):
                    w = raw.open(WATCH)
                    raw.send(w, health_request(), end=True)
                    watches.append(w)
                out["fifth"] = raw.wait_status(watches[4], timeout=5)
                out["gated"] = d.daemon.admission.gated  # open Watches are not calls waiting
                # Four Watch streams open and nothing else: idle, closed at the idle timeout.
                out["closed"] = raw.wait_closed(timeout=5)
            return out

        out = await in_thread(scenario)
        assert out == {"call": "0", "fifth": "8", "gated": 0, "closed": True}
        assert d.daemon.connections.closed_idle == 1


async def test_a_connection_without_an_authenticated_call_is_closed() -> None:
    async with running_daemon(connection_auth_timeout=0.5, auth_tokens_sha256=HASHES) as d:

        def scenario() -> dict[str, Any]:
            with raws(d.port, 2) as (holder, caller):
                holder.send(holder.open(WATCH), health_request(), end=True)
                refused = caller.open(ASSEMBLE, token="wrong")
                caller.send(refused, assemble_request(), end=True)
                good = caller.open(ASSEMBLE, token=TOKEN)
                caller.send(good, assemble_request(), end=True)
                out = {"refused": caller.wait_status(refused, 10)}
                out["good"] = caller.wait_status(good, 10)
                out["holder_closed"] = holder.wait_closed(5)
                time.sleep(0.5)
                probe = caller.open(CHECK)
                caller.send(probe, health_request(), end=True)
                out["caller_open"] = caller.wait_status(probe, 5)
                return out

        out = await in_thread(scenario)
        assert out == {"refused": "16", "good": "0", "holder_closed": True, "caller_open": "0"}
        assert d.daemon.connections.closed_unauthenticated == 1


# -- row 7: TLS connections count from accept; the handshake has a timeout -----------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[trustme.CA, Path, Path]:
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    server.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(p.bytes() for p in server.cert_chain_pems))
    return ca, cert, key


async def test_stalled_tls_handshakes_count_toward_the_cap_and_time_out(
    tls_files: tuple[trustme.CA, Path, Path],
) -> None:
    ca, cert, key = tls_files
    settings = test_settings(
        tls_cert=str(cert),
        tls_key=str(key),
        max_connections=4,
        max_connections_per_peer=4,
        tls_handshake_timeout=1.0,
        connection_auth_timeout=60.0,
        **RELAXED,
    )
    async with running_daemon(settings) as d:
        conns = d.daemon.connections
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())

        def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with idle_sockets(d.port, 4) as stalled:
                out["counted"] = until(lambda: conns.count == 4, 5)  # before any handshake
                with d.channel(credentials) as channel:  # at the cap: a stalled one is evicted
                    out["level"] = assemble(channel, token=None)
                    out["closed"] = sum(closed_by_server(s, 5) for s in stalled)
                    out["left"] = conns.count  # the caller's connection only
            return out

        out = await in_thread(scenario)
        assert out == {"counted": True, "level": "L0", "closed": 4, "left": 1}
        assert conns.evicted == 1


# -- a caller that leaves while its answer is made ----------------------------------------------


async def test_a_caller_whose_connection_closed_before_its_answer_is_cancelled_not_internal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The caller sends its request, then GOAWAY (as h2load and grpc clients do when they
    close): the answer finds the connection closed. Nobody is left to answer, and it is
    not the daemon's failure: the call counts CANCELLED and no `handler_failed` is logged."""
    with running_memory_server() as memory:
        memory.hot.latency_ms = memory.cold.latency_ms = 300.0
        async with running_daemon(
            memory_base_url=memory.url, memory_api_token=memory.token, **RELAXED
        ) as d:

            def scenario() -> None:
                with raws(d.port, 1) as (raw,):
                    stream = raw.open(ASSEMBLE)
                    raw.send(stream, assemble_request(), end=True)
                    # The call is running (its memory reads are out), then the caller leaves.
                    assert until(lambda: len(memory.seen) >= 1, 10)
                    raw.conn.close_connection()
                    raw.flush()

                    def finished(code: str) -> float:
                        value = d.daemon.metrics.registry.get_sample_value(
                            "ibex_grpc_requests_total",
                            {"method": "AssembleContext", "code": code},
                        )
                        return value or 0.0

                    assert until(lambda: finished("CANCELLED") + finished("INTERNAL") >= 1, 10)
                    assert finished("CANCELLED") == 1
                    assert finished("INTERNAL") == 0

            await in_thread(scenario)
    assert not [r for r in caplog.records if r.getMessage() == "handler_failed"]
