"""Metrics scraped over real HTTP on loopback, and aggregated across worker processes."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ibex.assembly.structs import (
    AssemblyMetrics,
    AssemblyResult,
    BranchOutcome,
    MemoryUsed,
    PackSummary,
    TokenBudget,
)
from ibex.ops.metrics import Metrics
from ibex.ops.metrics_http import serve_metrics, token_digest
from ibex.ops.supervisor_metrics import (
    clear_multiprocess_dir,
    exposition_registry,
    mark_process_dead,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def make_result() -> AssemblyResult:
    """An L1 assembly: hot timed out, three memories packed greedily, two hits filtered."""
    budget = TokenBudget(
        context_window=8192,
        response_reserve=1024,
        safety_buffer=168,
        directive_tokens=120,
        messages_tokens=900,
        tool_schema_tokens=0,
        formatter_overhead_tokens=40,
        usable_budget=5940,
        constrained=False,
        tokenizer_family="openai-o200k",
        estimate_kind="exact",
        messages_dropped=3,
        messages_dropped_tokens=950,
    )  # ceiling = 7000
    used = tuple(
        MemoryUsed(memory_id=f"m{i}", composite_score=0.9 - i / 10, rank=i + 1, category="factual")
        for i in range(3)
    )
    # Another tenant's hits are only counted (PackSummary.tenant_filtered), never listed.
    excluded = (MemoryUsed(memory_id="x3", exclusion="budget"),)
    return AssemblyResult(
        assembled_context="<context>…</context>",
        tokens_used=3500,
        memories_used=used,
        excluded=excluded,
        directive_tokens=120,
        history_tokens=900,
        memory_tokens=2440,
        tool_tokens=0,
        formatter_tokens=40,
        score_schema="interim_v1",
        degradation_level="L1",
        branches=(
            BranchOutcome("directive", "success", 1.5),
            BranchOutcome("hot", "timeout", 15.2, "deadline"),
            BranchOutcome("cold", "success", 31.0),
        ),
        budget=budget,
        pack=PackSummary(
            path="greedy", candidates_evaluated=6, excluded_for_budget=1, tenant_filtered=2
        ),
        metrics=AssemblyMetrics(
            budget_calculation_ms=0,
            ranking_ms=1,
            packing_ms=2,
            formatting_ms=0,
            total_ms=36,
            candidates_evaluated=6,
        ),
        request_id="req-1",
    )


async def http(
    port: int, request: bytes, *, local: str | None = None
) -> tuple[str, dict[str, str], bytes]:
    """One raw HTTP exchange (from source address `local`); the server closes the
    connection after its answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
    async with stream:
        await stream.send_all(request)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return status, headers, body


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_scrape_reports_an_assembly(nursery: trio.Nursery) -> None:
    metrics = Metrics()
    port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
    hits_misses = [7, 3]
    metrics.set_token_cache_source(lambda: (hits_misses[0], hits_misses[1]))
    metrics.observe_assembly(make_result())
    metrics.observe_assembly(make_result(), stage_seconds={"budget": 0.00004, "total": 0.0362})
    metrics.observe_request("AssembleContext", "OK", 0.037)
    metrics.observe_request("AssembleContext", "INVALID_ARGUMENT", 0.0004)
    metrics.shed("in_flight")
    hits_misses[:] = [19, 4]  # read at scrape time, not at registration

    with trio.fail_after(5), metrics.in_flight():
        status, headers, body = await http(
            port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
        )
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == CONTENT_TYPE_LATEST
    assert int(headers["content-length"]) == len(body)
    got = samples(body.decode())

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert value("ibex_grpc_requests_total", method="AssembleContext", code="OK") == 1
    assert value("ibex_grpc_requests_total", method="AssembleContext", code="INVALID_ARGUMENT") == 1
    assert value("ibex_grpc_request_duration_seconds_count", method="AssembleContext") == 2
    assert value("ibex_in_flight_requests") == 1
    assert value("ibex_shed_requests_total", reason="in_flight") == 1
    assert value("ibex_shed_requests_total", reason="queue") == 0
    assert value("ibex_branch_outcomes_total", source="hot", status="timeout") == 2
    assert value("ibex_branch_outcomes_total", source="cold", status="success") == 2
    assert value("ibex_branch_outcomes_total", source="hot", status="success") == 0
    assert value("ibex_branch_latency_seconds_bucket", source="hot", le="0.015") == 0
    assert value("ibex_branch_latency_seconds_bucket", source="hot", le="0.025") == 2
    assert value("ibex_branch_latency_seconds_sum", source="cold") == pytest.approx(0.062)
    assert value("ibex_stage_duration_seconds_count", stage="packing") == 2
    assert value("ibex_stage_duration_seconds_sum", stage="packing") == pytest.approx(0.004)
    # One observation in whole ms (0 ms), one precise 40 us: both in the first bucket.
    assert value("ibex_stage_duration_seconds_bucket", stage="budget", le="0.0001") == 2
    assert value("ibex_stage_duration_seconds_sum", stage="total") == pytest.approx(0.0722)
    assert value("ibex_degradation_total", level="L1") == 2
    assert value("ibex_degradation_total", level="L0") == 0
    assert value("ibex_pack_path_total", path="greedy") == 2
    assert value("ibex_pack_path_total", path="dp") == 0
    assert value("ibex_context_tokens_used_sum") == 7000
    assert value("ibex_context_budget_utilization_ratio_bucket", le="0.5") == 2
    assert value("ibex_context_budget_utilization_ratio_bucket", le="0.25") == 0
    assert value("ibex_context_budget_utilization_ratio_sum") == pytest.approx(1.0)
    assert value("ibex_context_memories_included_sum") == 6
    assert value("ibex_tenant_filtered_hits_total") == 4
    assert value("ibex_history_messages_dropped_total") == 6
    assert value("ibex_token_cache_hits_total") == 19
    assert value("ibex_token_cache_misses_total") == 4


async def test_other_paths_and_methods(nursery: trio.Nursery) -> None:
    metrics = Metrics()
    port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
    with trio.fail_after(5):
        status, _, body = await http(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == "HTTP/1.1 404 Not Found"
        assert b"ibex_" not in body
        status, _, _ = await http(port, b"GET /metricsfoo HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 404 Not Found"
        status, _, _ = await http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert status == "HTTP/1.1 405 Method Not Allowed"
        status, _, _ = await http(port, b"garbage\r\n\r\n")
        assert status == "HTTP/1.1 400 Bad Request"
        status, headers, body = await http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        assert int(headers["content-length"]) > 0
        assert body == b""
        status, _, body = await http(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        assert b"ibex_grpc_requests_total" in body


async def test_a_silent_client_is_dropped_and_others_are_served(nursery: trio.Nursery) -> None:
    port = await nursery.start(
        lambda task_status: serve_metrics(
            Metrics(), "127.0.0.1", 0, connection_timeout=0.3, task_status=task_status
        )
    )
    with trio.fail_after(5):
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        async with silent:
            status, _, _ = await http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status == "HTTP/1.1 200 OK"
            # The server gives up on the silent connection and closes it: EOF.
            assert await silent.receive_some(1024) == b""


async def test_unknown_stage_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown stages"):
        Metrics().observe_assembly(make_result(), stage_seconds={"retrieval": 0.01})


WORKER = textwrap.dedent(
    """
    import os
    import sys
    from ibex.ops.metrics import Metrics
    m = Metrics()
    m.set_token_cache_source(lambda: (5, 2))
    m.observe_request("AssembleContext", "OK", 0.01)
    m.observe_assembly(RESULT)
    if sys.argv[1] == "crash-in-flight":
        m.in_flight().__enter__()  # a request in progress when the process dies
    print(os.getpid())
    """
)


def test_workers_aggregate_through_the_multiprocess_dir(tmp_path: Path) -> None:
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    (mp_dir / "stale_123.db").write_bytes(b"left over from the previous run")
    clear_multiprocess_dir(str(mp_dir))
    assert list(mp_dir.iterdir()) == []

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir), "PYTHONPATH": root}
    prelude = (
        "from tests.integration.test_metrics_http import make_result\nRESULT = make_result()\n"
    )
    pids = []
    for mode in ("clean", "crash-in-flight"):
        proc = subprocess.run(
            [sys.executable, "-c", prelude + WORKER, mode],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        pids.append(int(proc.stdout))

    def scrape() -> Samples:
        return samples(generate_latest(exposition_registry(str(mp_dir))).decode())

    got = scrape()
    key = ("ibex_grpc_requests_total", (("code", "OK"), ("method", "AssembleContext")))
    assert got[key] == 2
    assert got[("ibex_degradation_total", (("level", "L1"),))] == 2
    assert got[("ibex_tenant_filtered_hits_total", ())] == 4
    assert got[("ibex_history_messages_dropped_total", ())] == 6
    assert got[("ibex_token_cache_hits_total", ())] == 10
    assert got[("ibex_token_cache_misses_total", ())] == 4
    assert got[("ibex_in_flight_requests", ())] == 1

    mark_process_dead(pids[1], str(mp_dir))
    got = scrape()
    assert got[("ibex_in_flight_requests", ())] == 0
    assert got[key] == 2  # a dead worker's totals still count


def test_exposition_registry_needs_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        exposition_registry()


# -- who may scrape: bearer token, read timeout, per-peer cap (issue 20 row 8) ---------------

TOKEN = "scrape-token-0f1e2d3c4b5a69788796a5b4"
NEXT_TOKEN = "rotated-token-8796a5b4c3d2e1f00f1e2d3c"
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def scrape_with(authorization: str | None, path: str = "/metrics", method: str = "GET") -> bytes:
    header = f"Authorization: {authorization}\r\n" if authorization is not None else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode()


async def test_with_a_token_every_request_needs_it(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    metrics = Metrics()
    metrics.observe_request("AssembleContext", "OK", 0.01)
    port = await nursery.start(
        functools.partial(
            serve_metrics,
            metrics,
            "127.0.0.1",
            0,
            token_sha256=[token_digest(TOKEN), token_digest(NEXT_TOKEN).upper()],
        )
    )
    refused = [
        SCRAPE,
        scrape_with(f"Bearer {TOKEN[:-1]}"),
        scrape_with(f"Bearer {TOKEN}x"),
        scrape_with(f"Basic {TOKEN}"),
        scrape_with(TOKEN),
        scrape_with("Bearer "),
        scrape_with(f"Bearer {token_digest(TOKEN)}"),  # the digest is not the token
        scrape_with(f"Bearer {TOKEN}")[:-2] + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode(),
        scrape_with(None, path="/"),  # unknown paths too: nothing is said without the token
        scrape_with(None, method="HEAD"),
    ]
    with trio.fail_after(10):
        for request in refused:
            status, headers, body = await http(port, request)
            assert status == "HTTP/1.1 401 Unauthorized", request
            assert headers["www-authenticate"] == 'Bearer realm="ibex-metrics"'
            assert b"ibex_" not in body
        for authorization in (f"Bearer {TOKEN}", f"bearer  {TOKEN} ", f"Bearer {NEXT_TOKEN}"):
            status, _, body = await http(port, scrape_with(authorization))
            assert status == "HTTP/1.1 200 OK", authorization
            assert b'ibex_grpc_requests_total{code="OK",method="AssembleContext"} 1.0' in body
        upper = SCRAPE[:-2] + f"AUTHORIZATION: Bearer {TOKEN}\r\n\r\n".encode()
        assert (await http(port, upper))[0] == "HTTP/1.1 200 OK"
        status, _, _ = await http(port, scrape_with(f"Bearer {TOKEN}", path="/"))
        assert status == "HTTP/1.1 404 Not Found"
        status, headers, body = await http(port, scrape_with(f"Bearer {TOKEN}", method="HEAD"))
        assert (status, body) == ("HTTP/1.1 200 OK", b"")
    for secret in (TOKEN, NEXT_TOKEN, token_digest(TOKEN)):
        assert secret not in caplog.text


async def test_a_peer_that_sends_nothing_is_closed_after_the_head_timeout(
    nursery: trio.Nursery,
) -> None:
    port = await nursery.start(
        functools.partial(
            serve_metrics, Metrics(), "127.0.0.1", 0, head_timeout=0.3, connection_timeout=60
        )
    )
    with trio.fail_after(10):
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        async with silent, slow:
            await slow.send_all(b"GET /metrics HTTP/1.1\r\n")  # never ends its head
            t0 = trio.current_time()
            assert await silent.receive_some(1024) == b""
            assert await slow.receive_some(1024) == b""
            assert trio.current_time() - t0 < 5  # the head timeout, not the connection's 60 s


async def _idle(port: int, local: str, n: int) -> list[trio.SocketStream]:
    return [await trio.open_tcp_stream("127.0.0.1", port, local_address=local) for _ in range(n)]


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(2):
        return await stream.receive_some(1024) == b""
    return False


async def test_idle_sockets_of_one_peer_cannot_shut_out_the_scraper(nursery: trio.Nursery) -> None:
    """16 idle connections from one address (the process-wide cap), then scrapes from
    another address and from that same one: both are answered."""
    port = await nursery.start(serve_metrics, Metrics(), "127.0.0.1", 0)  # the defaults
    with trio.fail_after(20):
        idle = await _idle(port, "127.0.0.1", 16)
        try:
            status, _, body = await http(port, SCRAPE, local="127.0.0.2")
            assert status == "HTTP/1.1 200 OK" and b"ibex_grpc_requests_total" in body
            status, _, _ = await http(port, SCRAPE, local="127.0.0.1")
            assert status == "HTTP/1.1 200 OK"
            # The peer holds at most 4: each newer connection closed its oldest idle one.
            closed = [await _closed_by_server(s) for s in idle[:12]]
            assert all(closed)
        finally:
            for s in idle:
                await trio.aclose_forcefully(s)


async def test_idle_sockets_of_many_peers_cannot_shut_out_the_scraper(
    nursery: trio.Nursery,
) -> None:
    port = await nursery.start(
        functools.partial(serve_metrics, Metrics(), "127.0.0.1", 0, max_connections=8)
    )
    with trio.fail_after(20):
        idle = [s for peer in ("127.0.0.10", "127.0.0.11") for s in await _idle(port, peer, 4)]
        try:
            status, _, _ = await http(port, SCRAPE, local="127.0.0.2")
            assert status == "HTTP/1.1 200 OK"
            assert await _closed_by_server(idle[0])  # the oldest idle one made room
        finally:
            for s in idle:
                await trio.aclose_forcefully(s)
