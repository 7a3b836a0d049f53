"""The HTTP/2 attack catalogue against `python -m ibex serve` on loopback.

Each flood is sent with h2 (the HTTP/2 library grpclib serves with) from its own
loopback address, without credentials, reconnecting whenever the daemon closes it,
while an authenticated grpcio caller makes calls at 50 per second from 127.0.0.1.
Expected, per docs/security.md: every flooding connection is closed with GOAWAY
(ENHANCE_YOUR_CALM, or PROTOCOL_ERROR for malformed header blocks) within 5 s,
`ibex_connections_closed_total` counts the reason, and every call of the caller
succeeds. The churn test: a storm of new connections from other loopback
addresses does not evict a client that makes its first call 100 ms after connecting.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import ContinuationFrame, DataFrame, Frame, GoAwayFrame, HeadersFrame
from prometheus_client.parser import text_string_to_metric_families

from ibex.testing.grpc_harness import AGENT, ORG, DaemonProcess, daemon_process, free_port
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc

TOKEN = "attack-catalogue-token-Zq81"
ENHANCE_YOUR_CALM = ErrorCodes.ENHANCE_YOUR_CALM
PROTOCOL_ERROR = ErrorCodes.PROTOCOL_ERROR
ASSEMBLE = "/ibex.context.v1.ContextAssemblyService/AssembleContext"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
CLOSED_WITHIN = 5.0  # seconds from a flooding connection's first frame to its close
FLOOD_FOR = 2.5  # seconds the attacker keeps reconnecting and flooding
CALLS_PER_SECOND = 50
FLOOD_BYTES_PER_SECOND = 1_000_000  # the attacker's pace, as in the probes
ENV = {
    "IBEX_CONTEXT_AUTH_TOKENS_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
    # Budgets for a loaded test machine: these tests are about floods, not latency.
    "IBEX_CONTEXT_TIMEOUT": "2s",
    "IBEX_CONTEXT_DEADLINE_MS": "2000",
    "IBEX_CONTEXT_DIRECTIVE_TIMEOUT_MS": "2000",
    "IBEX_CONTEXT_HOT_TIMEOUT_MS": "2000",
    "IBEX_CONTEXT_COLD_TIMEOUT_MS": "2000",
    "IBEX_CONTEXT_MAX_IN_FLIGHT": "1000",
}


@dataclass
class Served:
    proc: DaemonProcess
    metrics_port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    metrics_port = free_port()
    env = {**ENV, "IBEX_CONTEXT_METRICS_ADDR": f"127.0.0.1:{metrics_port}"}
    log = tmp_path_factory.mktemp("attacks") / "daemon.log"
    with daemon_process(env, log) as proc:
        yield Served(proc, metrics_port)


def closed_total(metrics_port: int, reason: str) -> float:
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    text = data.split(b"\r\n\r\n", 1)[1].decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ibex_connections_closed_total" and sample.labels == {
                "reason": reason
            }:
                return sample.value
    return 0.0


# -- the authenticated caller ---------------------------------------------------------------


def assemble_request() -> Any:
    return context_pb2.AssembleContextRequest(
        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing", request_id="flood"
    )


def steady_calls(target: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """AssembleContext with the token, started `CALLS_PER_SECOND` times a second whatever
    the answers' latency (grpcio futures), until `stop` (at most 10 s); their codes."""
    metadata = [("authorization", f"Bearer {TOKEN}")]
    codes: list[str] = out.setdefault("codes", [])
    with grpc.insecure_channel(target) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        stub.AssembleContext(assemble_request(), metadata=metadata, timeout=10)  # connected
        out["ready"].set()
        futures = []
        start = time.monotonic()
        for i in range(10 * CALLS_PER_SECOND):
            if stop.is_set():
                break
            delay = start + i / CALLS_PER_SECOND - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            futures.append(
                stub.AssembleContext.future(assemble_request(), metadata=metadata, timeout=2)
            )
        for future in futures:
            try:
                future.result()
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)


# -- the attacker ---------------------------------------------------------------------------


@dataclass
class Flooded:
    """One attacking connection, as its reader saw it."""

    goaway: int | None = None  # the GOAWAY's error code
    closed_after: float | None = None  # seconds from its first flood frame to EOF or reset
    frames: list[Frame] = field(default_factory=list)


def h2_client(port: int, source: str) -> tuple[socket.socket, H2Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    conn = H2Connection(
        H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
    )
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def request_headers(path: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def read_until_closed(sock: socket.socket, seen: Flooded, started: list[float]) -> None:
    """Every frame the daemon sends, until EOF or a reset (at most `CLOSED_WITHIN` + 5 s)."""
    buf = b""
    sock.settimeout(CLOSED_WITHIN + 5)
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            buf += chunk
    if started:
        seen.closed_after = time.monotonic() - started[0]
    while len(buf) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(buf[:9]))
        if len(buf) < 9 + length:
            break
        frame.parse_body(memoryview(buf[9 : 9 + length]))
        buf = buf[9 + length :]
        seen.frames.append(frame)
        if isinstance(frame, GoAwayFrame):
            seen.goaway = frame.error_code


#: One burst of an attack: given the client's connection and a counter, the frames to send.
Burst = Callable[[H2Connection, list[int]], bytes]


def flood_once(port: int, source: str, burst: Burst) -> Flooded:
    """Open a connection and send `burst` after `burst` until the daemon closes it."""
    seen = Flooded()
    started: list[float] = []
    try:
        sock, conn = h2_client(port, source)
    except OSError:
        seen.closed_after = 0.0
        return seen
    started.append(time.monotonic())
    reader = threading.Thread(target=read_until_closed, args=(sock, seen, started))
    reader.start()
    state = [1]
    deadline = time.monotonic() + CLOSED_WITHIN + 1
    sent = 0
    try:
        with contextlib.suppress(OSError):
            while reader.is_alive() and time.monotonic() < deadline:
                data = burst(conn, state)
                sock.sendall(data)
                sent += len(data)
                ahead = started[0] + sent / FLOOD_BYTES_PER_SECOND - time.monotonic()
                if ahead > 0:
                    reader.join(ahead)  # paced: returns early when the daemon closes
    finally:
        reader.join(CLOSED_WITHIN + 10)
        sock.close()
    return seen


def attack(served: Served, burst: Burst, source: str) -> tuple[list[Flooded], list[str]]:
    """Flood from `source` for `FLOOD_FOR` seconds, reconnecting after each close, while the
    authenticated caller runs; the connections as seen, and the caller's status codes."""
    stop = threading.Event()
    calls: dict[str, Any] = {"ready": threading.Event()}
    caller = threading.Thread(target=steady_calls, args=(served.proc.target, stop, calls))
    caller.start()
    flooded: list[Flooded] = []
    try:
        assert calls["ready"].wait(20)
        until = time.monotonic() + FLOOD_FOR
        while time.monotonic() < until and len(flooded) < 1000:
            flooded.append(flood_once(served.proc.port, source, burst))
            time.sleep(0.005)  # bounds the test's own reconnect loop, not the daemon's
    finally:
        stop.set()
        caller.join(30)
    return flooded, calls["codes"]


def rapid_reset(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2023-44487: HEADERS, then RST_STREAM at once, on ever new streams."""
    for _ in range(50):
        sid = state[0]
        state[0] += 2
        conn.send_headers(sid, request_headers(ASSEMBLE))
        conn.reset_stream(sid, ErrorCodes.CANCEL)
    return conn.data_to_send()


def ping_flood(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2019-9512."""
    for _ in range(50):
        state[0] += 1
        conn.ping(state[0].to_bytes(8, "big"))
    return conn.data_to_send()


def settings_flood(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2019-9515."""
    for _ in range(50):
        conn.update_settings({SettingCodes.ENABLE_PUSH: 0})
    return conn.data_to_send()


def empty_frames(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2019-9518: zero-length DATA without END_STREAM on a Health stream."""
    if state[0] == 1:
        conn.send_headers(1, request_headers(HEALTH_CHECK))
        state[0] = 3
    for _ in range(50):
        conn.send_data(1, b"")
    return conn.data_to_send()


def empty_headers(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2019-9516: header blocks of a thousand empty literal fields."""
    sid = state[0]
    state[0] += 2
    conn.send_headers(sid, [(b"", b"")] * 1000)
    return conn.data_to_send()


def reset_flood(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2019-9514: DATA on a stream the client reset, which h2 answers with RST_STREAM."""
    if state[0] == 1:
        conn.send_headers(1, request_headers(HEALTH_CHECK))
        conn.reset_stream(1, ErrorCodes.CANCEL)
        state[0] = 3
    return conn.data_to_send() + DataFrame(1, b"x").serialize() * 50


def continuation_flood(conn: H2Connection, state: list[int]) -> bytes:
    """CVE-2024-27316 family: a header block that never ends."""
    if state[0] == 1:
        state[0] = 3
        first = HeadersFrame(1, b"\x82").serialize()  # no END_HEADERS
        return conn.data_to_send() + first
    return ContinuationFrame(1, b"\x00\x01a\x00").serialize() * 50


ATTACKS = [
    ("rapid_reset", rapid_reset, ENHANCE_YOUR_CALM),
    ("ping_flood", ping_flood, ENHANCE_YOUR_CALM),
    ("settings_flood", settings_flood, ENHANCE_YOUR_CALM),
    ("empty_frames", empty_frames, ENHANCE_YOUR_CALM),
    ("empty_headers", empty_headers, PROTOCOL_ERROR),
    ("reset_flood", reset_flood, ENHANCE_YOUR_CALM),
    ("continuation_flood", continuation_flood, PROTOCOL_ERROR),
]


@pytest.mark.parametrize("reason,burst,code", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_a_flood_is_closed_with_goaway_and_the_caller_is_served(
    served: Served, reason: str, burst: Burst, code: int
) -> None:
    before = closed_total(served.metrics_port, reason)
    # Each attack from its own address: the connection rate is counted per peer.
    source = f"127.0.0.{10 + [a[0] for a in ATTACKS].index(reason)}"
    flooded, codes = attack(served, burst, source)
    first = flooded[0]
    assert first.goaway == code, (reason, first.frames[-3:])
    closes = [f.closed_after for f in flooded]
    assert all(c is not None and c < CLOSED_WITHIN for c in closes), closes
    assert closed_total(served.metrics_port, reason) >= before + 1
    refused = sum(f.goaway is None for f in flooded)  # over the peer's connection rate
    summary = (reason, len(flooded), refused, {c: codes.count(c) for c in set(codes)})
    assert set(codes) == {"OK"}, summary
    assert len(codes) >= FLOOD_FOR * CALLS_PER_SECOND * 0.9, summary


UNREAD = ("unread_output", "too_many_streams")


def test_a_peer_that_never_reads_its_answers_is_closed(served: Served) -> None:
    """CVE-2019-9517: the peer opens its windows, asks for answers and reads none."""
    before = sum(closed_total(served.metrics_port, r) for r in UNREAD)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.3", 0))
    sock.settimeout(CLOSED_WITHIN + 5)
    sock.connect(("127.0.0.1", served.proc.port))
    conn = H2Connection(H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    conn.increment_flow_control_window(2**31 - 1 - 65535)
    message = b"\x00\x00\x00\x00\x00"  # an empty HealthCheckRequest
    started = time.monotonic()
    closed_after = None
    sid = 1
    try:
        while time.monotonic() - started < CLOSED_WITHIN + 5:
            for _ in range(20):
                conn.send_headers(sid, request_headers(HEALTH_CHECK))
                conn.send_data(sid, message, end_stream=True)
                sid += 2
            sock.sendall(conn.data_to_send())
    except OSError:
        closed_after = time.monotonic() - started
    finally:
        sock.close()
    assert closed_after is not None and closed_after < CLOSED_WITHIN
    # Which bound it meets first depends on how many requests one read holds: past 100
    # streams open (answers not yet written) or 32 requests while its answers back up.
    after = sum(closed_total(served.metrics_port, r) for r in UNREAD)
    assert after >= before + 1


# -- churn ----------------------------------------------------------------------------------


def storm(port: int, stop: threading.Event, sources: list[str], out: dict[str, int]) -> None:
    """About 260 new connections a second, round-robin over `sources`, each sending the
    preface and a SETTINGS frame and then held until the storm ends (at most 15 s)."""
    held: list[socket.socket] = []
    out["opened"] = 0
    hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    start = time.monotonic()
    try:
        for i in range(260 * 15):
            if stop.is_set():
                break
            delay = start + i / 260 - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.bind((sources[i % len(sources)], 0))
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
            with contextlib.suppress(OSError):
                s.send(hello)
            out["opened"] += 1
            if len(held) > 400:  # the oldest are long evicted: keep the test's fds bounded
                held.pop(0).close()
    finally:
        for s in held:
            s.close()


def first_call_after(port: int, wait: float) -> str:
    """Connect (h2, from 127.0.0.1), wait `wait` seconds, then make the first call; its
    grpc-status, or what ended the connection before an answer."""
    sock, conn = h2_client(port, "127.0.0.1")
    sock.settimeout(10)
    try:
        time.sleep(wait)  # the scenario: a first call 100 ms after connecting
        message = assemble_request().SerializeToString()
        conn.send_headers(1, request_headers(ASSEMBLE, ("authorization", f"Bearer {TOKEN}")))
        conn.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        sock.sendall(conn.data_to_send())
        for _ in range(1000):
            try:
                data = sock.recv(65536)
            except OSError as exc:
                return f"reset: {exc}"
            if not data:
                return "closed"
            for event in conn.receive_data(data):
                headers = dict(getattr(event, "headers", None) or ())
                if b"grpc-status" in headers:
                    return headers[b"grpc-status"].decode()
                if type(event).__name__ == "ConnectionTerminated":
                    return "goaway"
            sock.sendall(conn.data_to_send())
        return "no answer"
    finally:
        sock.close()


def test_a_connection_storm_does_not_evict_a_caller_before_its_first_call(
    tmp_path: Path,
) -> None:
    env = {**ENV, "IBEX_CONTEXT_MAX_CONNECTIONS": "32"}
    with daemon_process(env, tmp_path / "daemon.log") as proc:
        stop = threading.Event()
        out: dict[str, int] = {}
        sources = [f"127.0.0.{i}" for i in range(2, 10)]
        flood = threading.Thread(target=storm, args=(proc.port, stop, sources, out))
        flood.start()
        try:
            while out.get("opened", 0) < 200 and flood.is_alive():
                time.sleep(0.01)
            results = [first_call_after(proc.port, 0.1) for _ in range(10)]
        finally:
            stop.set()
            flood.join(30)
    assert out["opened"] >= 200
    assert results == ["0"] * 10
