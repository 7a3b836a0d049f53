"""Warm start and dependency state, on the real daemon with real Redis and the memory stand-in.

The design's life-cycle rule: the first call after a start is answered like the
thousandth (connections to Redis and the memory service made, the pipeline run
once, before Health says SERVING); a dependency down at start does not stop the
start, the daemon serves degraded and says so, and each dependency's change of
state is logged once, with the error, and exported as `ibex_dependency_up`.

The memory stand-in serves https and makes every new connection wait
`CONNECT_MS` before its TLS handshake, far above the branch budgets used here:
a branch that has to connect on the call's path cannot succeed, one that finds
its connection made does. Budgets are raised from the defaults (5/15/45 ms) so
a busy test machine does not decide the outcome; the connect cost does.
"""

from __future__ import annotations

import functools
import json
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trustme
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from ibex.ops.branch_errors import BranchErrors
from ibex.service.daemon import Daemon
from ibex.service.dependencies import Dependency, DependencyConfig, DependencyStates, keep, warm_all
from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    DaemonProcess,
    daemon_process,
    free_port,
    in_thread,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import FakeMemoryServer, make_memories
from ibex.testing.redis_server import RedisServer, find_redis_server

CONNECT_MS = 400.0
STARTS = 5
PATIENCE = 30.0  # seconds: generous bounds for waits on conditions, never a timing claim
BUDGETS = {
    "IBEX_CONTEXT_TIMEOUT": "300ms",
    "IBEX_CONTEXT_DEADLINE_MS": "300",
    "IBEX_CONTEXT_DIRECTIVE_TIMEOUT_MS": "100",
    "IBEX_CONTEXT_HOT_TIMEOUT_MS": "150",
    "IBEX_CONTEXT_COLD_TIMEOUT_MS": "300",
}
VERSION = "00000000-0000-4000-8000-0000000000d1"
ENVELOPE = json.dumps(
    {"v": 1, "content": "Answer as the billing agent.", "version_id": VERSION}
).encode()


@pytest.fixture
def tls_memory(tmp_path: Path) -> Iterator[tuple[FakeMemoryServer, Path]]:
    """The stand-in over https with a slow connection set-up; the CA file the daemon trusts."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_path = tmp_path / "memory-ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    with FakeMemoryServer(ssl_context=server_ctx) as server:
        server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 8))
        server.connect_latency_ms = CONNECT_MS
        yield server, ca_path


@pytest.fixture
def plain_memory() -> Iterator[FakeMemoryServer]:
    with FakeMemoryServer() as server:
        server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 8))
        yield server


@pytest.fixture
def stopped_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with its port chosen but not started: connections are refused."""
    server = RedisServer(find_redis_server(), tmp_path)
    try:
        yield server
    finally:
        server.stop()


def health(target: str) -> int | None:
    """The Health status for "" (None when the port does not answer yet)."""
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        try:
            return int(check(HealthCheckRequest(), timeout=1.0).status)
        except grpc.RpcError:
            return None


def first_call(target: str) -> dict[str, str]:
    """One AssembleContext call: branch source -> status (with detail when not success)."""
    with grpc.insecure_channel(target) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        resp = stub.AssembleContext(
            context_pb2.AssembleContextRequest(
                org_id=ORG,
                agent_id=AGENT,
                model="gpt-4o",
                query="deploy billing",
                directive_version_id=VERSION,
            ),
            timeout=5,
        )
    return {
        b.source: b.status if b.status == "success" else f"{b.status}: {b.detail}"
        for b in resp.branches
    }


def serving(proc: DaemonProcess) -> float:
    """Poll Health until SERVING; seconds it took. Blocking: run it in a thread."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < PATIENCE:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"daemon exited: {proc.stderr[-2000:]}")
        if health(proc.target) == HealthCheckResponse.SERVING:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise RuntimeError(f"not SERVING after {PATIENCE}s: {proc.stderr[-2000:]}")


def directive_clients(redis: RedisServer) -> set[str]:
    """Ids of the daemon's Redis connections (named `ibex-directive`) open now."""
    listing = redis.command("CLIENT", "LIST").decode()
    return {
        line.split(" ", 1)[0] for line in listing.splitlines() if " name=ibex-directive " in line
    }


def events(proc: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]


async def test_the_first_call_after_serving_gets_every_branch_start_after_start(
    redis_server: RedisServer, tls_memory: tuple[FakeMemoryServer, Path], tmp_path: Path
) -> None:
    """5 starts in a row: before Health says SERVING the daemon has its Redis connection,
    and the first call gets `success` from directive, hot and cold, every time (a memory
    branch that had to connect inside its budget, through the slow TLS set-up, could not)."""
    memory, ca_path = tls_memory
    redis_server.set(f"{ORG}:directive:{AGENT}", ENVELOPE)
    env = {
        "IBEX_CONTEXT_REDIS_URL": redis_server.url,
        "IBEX_CONTEXT_MEMORY_BASE_URL": memory.url,
        "IBEX_CONTEXT_MEMORY_API_TOKEN": memory.token,
        "SSL_CERT_FILE": str(ca_path),  # the stand-in's CA, through the default trust
        **BUDGETS,
    }
    seen = []
    for start in range(STARTS):
        before = directive_clients(redis_server)
        with daemon_process(env, tmp_path / f"serve-{start}.log", ready=False) as proc:
            await in_thread(serving, proc)
            connected = bool(directive_clients(redis_server) - before)
            branches = await in_thread(first_call, proc.target)
        seen.append((connected, branches))
    complete = {"directive": "success", "hot": "success", "cold": "success"}
    assert seen == [(True, complete)] * STARTS


async def test_redis_down_at_start_serves_degraded_says_so_and_recovers(
    stopped_redis: RedisServer, plain_memory: FakeMemoryServer, tmp_path: Path
) -> None:
    """Redis refusing at start: the daemon still reaches SERVING (warming is bounded),
    answers without the directive, and logs `dependency_down` for redis with the error;
    Redis started later is logged `dependency_up` once and the directive branch succeeds."""
    env = {
        "IBEX_CONTEXT_REDIS_URL": stopped_redis.url,
        "IBEX_CONTEXT_MEMORY_BASE_URL": plain_memory.url,
        "IBEX_CONTEXT_MEMORY_API_TOKEN": plain_memory.token,
        **BUDGETS,
    }
    with daemon_process(env, tmp_path / "serve.log", ready=False) as proc:
        await in_thread(serving, proc)
        degraded = await in_thread(first_call, proc.target)
        down = [e for e in events(proc) if e["event"] == "dependency_down"]
        stopped_redis.start()
        stopped_redis.set(f"{ORG}:directive:{AGENT}", ENVELOPE)
        with trio.fail_after(PATIENCE):
            while not any(e["event"] == "dependency_up" for e in events(proc)):  # noqa: ASYNC110
                await trio.sleep(0.05)
        recovered = await in_thread(first_call, proc.target)
        lines = events(proc)

    assert degraded["directive"] == "error: redis: connection failed"
    assert (degraded["hot"], degraded["cold"]) == ("success", "success")
    assert [(e["level"], e["dependency"], e["error"], e["starting"]) for e in down] == [
        ("warning", "redis", "redis: connection failed", True)
    ]
    assert down[0]["target"] == stopped_redis.url
    ups = [e for e in lines if e["event"] == "dependency_up"]
    assert [(e["level"], e["dependency"]) for e in ups] == [("warning", "redis")]
    assert recovered == {"directive": "success", "hot": "success", "cold": "success"}
    # Said once each: no second down line while it stayed down, no second up line.
    assert [e["event"] for e in lines if e["event"].startswith("dependency_")] == [
        "dependency_down",
        "dependency_up",
    ]


def _gauge(daemon: Daemon, dependency: str) -> float | None:
    return daemon.metrics.registry.get_sample_value(
        "ibex_dependency_up", {"dependency": dependency}
    )


async def test_dependency_state_metric_and_branch_error_summary(
    stopped_redis: RedisServer, plain_memory: FakeMemoryServer, caplog: pytest.LogCaptureFixture
) -> None:
    """`ibex_dependency_up` is 0 for a Redis down at start and 1 for the memory service,
    and turns 1 once Redis answers; failed directive branches of real calls are logged as
    one `branch_errors` line per source and window, with their count by reason."""

    def quick_summary(daemon: Daemon) -> None:
        daemon.branch_errors = BranchErrors(interval=0.2)

    caplog.set_level(logging.INFO)
    async with running_daemon(
        redis_url=stopped_redis.url,
        memory_base_url=plain_memory.url,
        memory_api_token=plain_memory.token,
        directive_timeout=0.1,
        hot_timeout=0.15,
        cold_timeout=0.3,
        timeout=0.3,
        deadline=0.3,
        prepare=quick_summary,
    ) as d:
        at_start = (_gauge(d.daemon, "redis"), _gauge(d.daemon, "memory"))
        calls = [await in_thread(first_call, d.target) for _ in range(3)]
        with trio.fail_after(PATIENCE):
            while not any(r.getMessage() == "branch_errors" for r in caplog.records):  # noqa: ASYNC110
                await trio.sleep(0.05)
        await trio.to_thread.run_sync(stopped_redis.start)
        with trio.fail_after(PATIENCE):
            while _gauge(d.daemon, "redis") != 1.0:  # noqa: ASYNC110
                await trio.sleep(0.05)

    assert at_start == (0.0, 1.0)
    assert [c["directive"] for c in calls] == ["error: redis: connection failed"] * 3
    summaries = [r for r in caplog.records if r.getMessage() == "branch_errors"]
    assert summaries and all(r.levelno == logging.WARNING for r in summaries)
    # The memory branches succeeded: a line for the directive source only.
    assert {r.source for r in summaries} == {"directive"}  # type: ignore[attr-defined]
    assert sum(r.errors for r in summaries) == 3  # type: ignore[attr-defined]
    assert sum(r.timeouts for r in summaries) == 0  # type: ignore[attr-defined]
    assert [r.reasons for r in summaries] == [  # type: ignore[attr-defined]
        {"error: redis: connection failed": r.errors}  # type: ignore[attr-defined]
        for r in summaries
    ]


async def test_an_idle_memory_pool_keeps_a_connection_ready(plain_memory: FakeMemoryServer) -> None:
    """Idle pooled connections expire (`keepalive_expiry`), so after an idle spell a call
    would connect inside its budget; the dependency probe replaces each before it lapses.
    After more than two expiry periods of idle, the call finds a connection: it opens none."""
    source = MemoryHttpSource(plain_memory.url, plain_memory.token, keepalive_expiry=2.0)
    config = DependencyConfig(probe_interval=0.1)
    warm = functools.partial(source.warm, 1, fresh_for=1.0)
    dep = Dependency("memory", plain_memory.url, warm)
    states = DependencyStates()
    async with source:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                await warm_all([dep], states, config)
                nursery.start_soon(keep, dep, states, config)
                # 2 warmed, then each pool's replaced twice: over 2 s of idle (> the expiry).
                while plain_memory.accepted_connections < 6:  # noqa: ASYNC110
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            opened = source.pool_stats("hot").opened
            hits = await source.hot(ORG, AGENT, limit=5, min_confidence=0.0)
            after = source.pool_stats("hot").opened
    assert len(hits) == 5
    assert after == opened  # no connect on the call's path
    assert states.up("memory") is True


async def test_a_refusing_memory_service_at_start_is_down_then_up_once_it_listens(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The memory service refusing connections at start: SERVING anyway, the memory
    dependency down (logged with the connect error, gauge 0), hot and cold answered as
    errors; once it listens, up (logged once, gauge 1) and the branches succeed."""
    port = free_port()
    caplog.set_level(logging.INFO)
    async with running_daemon(
        redis_url=redis_server.url,
        memory_base_url=f"http://127.0.0.1:{port}",
        memory_api_token="test-memory-token-0123456789",
        directive_timeout=0.1,
        hot_timeout=0.15,
        cold_timeout=0.3,
        timeout=0.3,
        deadline=0.3,
    ) as d:
        at_start = _gauge(d.daemon, "memory")
        degraded = await in_thread(first_call, d.target)
        with FakeMemoryServer(port=port) as memory:
            memory.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 8))
            with trio.fail_after(PATIENCE):
                while _gauge(d.daemon, "memory") != 1.0:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            recovered = await in_thread(first_call, d.target)

    refused = "transport error (ConnectError)"
    assert at_start == 0.0
    assert (degraded["hot"], degraded["cold"]) == (
        f"error: hot: {refused}",
        f"error: cold: {refused}",
    )
    state = [
        (r.getMessage(), r.levelno, getattr(r, "error", None))
        for r in caplog.records
        if r.getMessage().startswith("dependency_")
    ]
    assert state == [
        ("dependency_down", logging.WARNING, f"cold: {refused}; hot: {refused}"),
        ("dependency_up", logging.WARNING, None),
    ]
    assert (recovered["hot"], recovered["cold"]) == ("success", "success")
