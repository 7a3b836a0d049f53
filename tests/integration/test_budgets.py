"""One caller cannot take the request-byte budget from the others, and unread DATA is
bounded by the windows the daemon advertises (issue 30 rows 1 and 3).

The hostile side is a raw HTTP/2 client (h2, `test_edge_bounds.Raw`) against the real
daemon over loopback; the well-behaved caller is the stock grpcio client.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import grpc
import h2.events
import h2.exceptions

from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    RunningDaemon,
    daemon_process,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from tests.integration.test_edge_bounds import (
    ASSEMBLE,
    CHECK,
    MIB,
    RELAXED,
    WATCH,
    Raw,
    health_request,
    prefix,
    raws,
    until,
)

HOLDER = "budget-holder-token-not-a-secret"
OTHER = "budget-other-token-not-a-secret"
HASHES = tuple(hashlib.sha256(t.encode()).hexdigest() for t in (HOLDER, OTHER))
KIB = 1024


def small_calls(target: str, n: int, token: str = OTHER) -> list[str]:
    """`n` small AssembleContext calls from another caller: each one's status name."""
    stub_channel = grpc.insecure_channel(target)
    stub = context_pb2_grpc.ContextAssemblyServiceStub(stub_channel)
    request = context_pb2.AssembleContextRequest(
        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
    )
    codes = []
    with stub_channel:
        for _ in range(n):
            try:
                stub.AssembleContext(
                    request, timeout=10, metadata=[("authorization", f"Bearer {token}")]
                )
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
    return codes


def ended(d: RunningDaemon) -> float:
    """AssembleContext calls that ended OK (their request bytes released before)."""
    return d.daemon.metrics.requests.labels("AssembleContext", "OK")._value.get()


def settled(raw: Raw, timeout: float = 10.0) -> bool:
    """True once the daemon has processed every frame sent before: it answers a PING
    only after reading what came ahead of it (False if the connection closed first)."""
    raw.conn.ping(b"settled!")
    raw.flush()
    while not raw.eof:
        for event in raw.pump(timeout):
            if isinstance(event, h2.events.PingAckReceived) and event.ping_data == b"settled!":
                return True
    return False


# -- row 1: a declared length alone holds one look-ahead step; each caller has its share ---------


async def test_declared_large_messages_do_not_keep_another_caller_out() -> None:
    """16 streams of one token holder, each a 5-byte prefix declaring 4 MiB (the whole
    64 MiB budget if a declared length were reserved): another caller's small calls all
    succeed."""
    async with running_daemon(auth_tokens_sha256=HASHES, request_read_timeout=60.0, **RELAXED) as d:

        def scenario() -> dict[str, Any]:
            with raws(d.port, 1) as (raw,):
                streams = [raw.open(ASSEMBLE, HOLDER) for _ in range(16)]
                for stream in streams:
                    raw.send(stream, prefix(4 * MIB))
                assert settled(raw)
                codes = small_calls(f"127.0.0.1:{d.port}", 30)
                # An answer leaves before its call ends (and releases its bytes).
                assert until(lambda: ended(d) == 30)
                held = d.daemon.admission.in_flight_bytes
                holding = [s for s in streams if s not in raw.status]
            return {"codes": codes, "held": held, "holding": len(holding)}

        out = await in_thread(scenario)
    assert out["codes"] == ["OK"] * 30
    assert out["holding"] == 16  # the holder's streams still wait for their bytes
    assert out["held"] <= 16 * 64 * KIB  # a look-ahead step each, not 4 MiB each


async def test_a_caller_holds_at_most_its_share_and_the_others_keep_theirs() -> None:
    """The holder sends real bytes on 8 streams (192 KiB of each 1 MiB message, then
    stalls): it is refused beyond its share (a quarter of the 4 MiB budget) and another
    caller's calls all succeed."""
    budget = 4 * MIB
    share = budget // 4
    async with running_daemon(
        auth_tokens_sha256=HASHES,
        request_read_timeout=60.0,
        max_in_flight_bytes=budget,
        **RELAXED,
    ) as d:
        shares = getattr(d.daemon.admission, "shares", None)

        def scenario() -> dict[str, Any]:
            with raws(d.port, 1) as (raw,):
                streams = [raw.open(ASSEMBLE, HOLDER) for _ in range(8)]
                for stream in streams:
                    raw.send(stream, prefix(MIB) + b"\x00" * (192 * KIB))
                assert settled(raw)
                held = None if shares is None else max(shares.held.values(), default=0)
                codes = small_calls(f"127.0.0.1:{d.port}", 12)
                refused = [raw.status.get(s) for s in streams if s in raw.status]
            return {"codes": codes, "held": held, "refused": refused}

        out = await in_thread(scenario)
    assert out["codes"] == ["OK"] * 12
    # Neither the holder nor its connection passed its share.
    assert out["held"] is not None and out["held"] <= share
    assert out["refused"] and set(out["refused"]) == {"8"}  # its own calls beyond it refused


async def test_stalled_health_streams_do_not_empty_the_authenticated_budget() -> None:
    """64 unauthenticated Health streams, each stalled in a 1 KiB request, against a 64 KiB
    MAX_IN_FLIGHT_BYTES: they draw on their own pool, and authenticated calls all succeed."""
    async with running_daemon(
        auth_tokens_sha256=HASHES,
        request_read_timeout=60.0,
        connection_auth_timeout=60.0,
        max_in_flight_bytes=64 * KIB,
        **RELAXED,
    ) as d:
        pool = getattr(d.daemon.admission, "unauthenticated", None)

        def scenario() -> dict[str, Any]:
            with raws(d.port, 1) as (raw,):
                streams = [raw.open(CHECK) for _ in range(64)]
                for stream in streams:
                    raw.send(stream, prefix(KIB) + b"\x0a")  # under Health's cap, then nothing
                assert settled(raw)
                stalled = sum(s not in raw.status for s in streams)
                held = None if pool is None else pool.held
                codes = small_calls(f"127.0.0.1:{d.port}", 12)
            return {"codes": codes, "stalled": stalled, "held": held}

        out = await in_thread(scenario)
    assert out["codes"] == ["OK"] * 12
    assert out["stalled"] > 0  # Health streams were holding bytes during the calls
    assert out["held"] is not None and out["held"] <= 1 * MIB  # the unauthenticated pool's


# -- row 3: DATA past a complete request is reset, not buffered ----------------------------------


def _rss(pid: int) -> int:
    """VmRSS of `pid` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def push_past_request(raw: Raw, total: int) -> tuple[int, bool]:
    """A Health/Watch request (complete, without END_STREAM), then up to `total` bytes of
    DATA on the same stream, as far as the window lets: (bytes sent, stream reset)."""
    stream = raw.open(WATCH)
    raw.send(stream, health_request())
    chunk = b"\x00" * 16 * KIB
    sent = 0
    while sent < total and stream not in raw.reset and not raw.eof:
        try:
            window = min(raw.conn.local_flow_control_window(stream), len(chunk), total - sent)
        except h2.exceptions.StreamClosedError:
            break
        if window <= 0:
            # Blocked by the window: the daemon holds what it accepted and reads no more.
            if not settled(raw):
                break
            try:
                if raw.conn.local_flow_control_window(stream) <= 0:
                    break
            except h2.exceptions.StreamClosedError:
                break
            continue
        try:
            raw.conn.send_data(stream, chunk[:window])
        except h2.exceptions.StreamClosedError:
            break
        raw.flush()
        sent += window
    return sent, stream in raw.reset


def test_data_past_a_health_request_is_reset_and_not_buffered(tmp_path: Path) -> None:
    """24 connections each push 4 MiB after a Health/Watch request: each stream is reset,
    and the daemon's memory grows by less than 16 MiB (24 times its 1 MiB connection window
    would be 24 MiB; buffered as they come, 96 MiB)."""
    env = {
        "IBEX_CONTEXT_CONNECTION_AUTH_TIMEOUT": "60s",
        "IBEX_CONTEXT_MAX_CONNECTIONS_PER_PEER": "64",
    }
    with daemon_process(env, tmp_path / "serve.log") as proc:
        opened: list[Raw] = []
        try:
            for _ in range(24):
                opened.append(Raw(proc.port))
            # Warm: each connection's first Health call, so the baseline includes them.
            for raw in opened:
                s = raw.open(CHECK)
                raw.send(s, health_request(), end=True)
                assert raw.wait_status(s, timeout=10) == "0"
            before = _rss(proc.proc.pid)
            results = [push_past_request(raw, 4 * MIB) for raw in opened]
            for raw in opened:
                settled(raw)  # everything pushed has been read off the socket by the daemon
            grown = _rss(proc.proc.pid) - before
        finally:
            for raw in opened:
                raw.close()
    assert grown < 16 * MIB, (grown, results)
    assert all(reset for _, reset in results), results
