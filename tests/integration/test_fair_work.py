"""One tenant's large calls cannot take the service from another tenant (issue 20, row 3).

`python -m ibex serve` as its own process, the memory stand-in as its own
process, the stock grpcio client over real sockets. One org keeps many
large calls in flight, each with a fresh ~100 K-character tool schema (fresh,
so the token cache cannot answer: every one needs the worker thread for its
count). Another org calls at 50 rps. Its calls need no worker thread and
come back OK (degraded answers are OK): the large calls queue for the thread
before they take an assembly slot, and one org holds at most half the slots.

Statuses only, no timings. The quiet org's deadline is 250 ms, not the 45 ms
of production: on this shared 2-core machine even an idle daemon misses 45 ms
now and then (the benchmark `noisy_tenant` scenario measures 45 ms). Before
the fix the quiet org waited behind the slots the large calls held: at 250 ms
about 6 % of its calls were OK and 70 % refused (RESOURCE_EXHAUSTED `queue`),
at 45 ms none was OK. Now none may be refused, and a stall of the machine may
cost at most a few calls their deadline (`MIN_OK_SHARE`; a second attempt is
allowed, as in the chaos tests).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from tests.grpcio_stubs import context_pb2, context_pb2_grpc
from tests.integration.grpc_harness import DaemonProcess, daemon_process
from tests.memory_server import DEMO_AGENT, DEMO_ORG, memory_server_process

NOISY_ORG = "30000000-0000-4000-8000-000000000001"
NOISY_AGENT = "30000000-0000-4000-8000-000000000002"
NOISY_IN_FLIGHT = 24
SCHEMA_CHARS = 100_000
PROBE_RPS = 50
PROBE_CALLS = 100  # two seconds
PROBE_DEADLINE_S = 0.25
MIN_OK_SHARE = 0.9
ATTEMPTS = 2
_WORDS = [
    "invoice", "customer", "amount", "currency", "string", "integer", "object", "required",
    "description", "properties", "enum", "format", "date", "refund", "ledger", "account",
]  # fmt: skip


_TEXT = " ".join(random.Random(3).choices(_WORDS, k=400_000))


def large_schema(rng: random.Random) -> str:
    """A tool schema of about SCHEMA_CHARS characters that no earlier call sent.

    A slice of one long text at a random offset: cheap for the test process, whose
    own CPU would otherwise delay its calls.
    """
    start = rng.randrange(len(_TEXT) - SCHEMA_CHARS)
    name = f"bulk_{rng.getrandbits(64):x}"
    return f'{{"name": "{name}", "description": "{_TEXT[start : start + SCHEMA_CHARS]}"}}'


def request(org: str, agent: str, schemas: tuple[str, ...] = ()) -> Any:
    return context_pb2.AssembleContextRequest(
        org_id=org,
        agent_id=agent,
        query="How do I deploy the billing service?",
        model="gpt-4o",
        tool_schemas=list(schemas),
    )


class NoisyTenant:
    """Keeps `in_flight` large calls open: each one that ends is replaced at once."""

    def __init__(self, stub: Any, in_flight: int) -> None:
        self.stub = stub
        self.in_flight = in_flight
        self.codes: Counter[str] = Counter()
        self._rng = random.Random(7)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._open = 0
        self._drained = threading.Event()

    def start(self) -> None:
        for _ in range(self.in_flight):
            self._issue()

    def _issue(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self._open += 1
            schema = large_schema(self._rng)
        future = self.stub.AssembleContext.future(
            request(NOISY_ORG, NOISY_AGENT, (schema,)), timeout=10.0
        )
        future.add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        code = future.code()
        with self._lock:
            self.codes[code.name if code is not None else "CANCELLED"] += 1
            self._open -= 1
            if self._stopped.is_set() and self._open == 0:
                self._drained.set()
        self._issue()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopped.set()
            if self._open == 0:
                self._drained.set()
        assert self._drained.wait(timeout), "the large calls did not end"


@contextmanager
def daemon_with_memory(tmp_path: Path, **env: str) -> Iterator[DaemonProcess]:
    with memory_server_process(memories=20) as memory:
        daemon_env = {
            "IBEX_CONTEXT_MEMORY_BASE_URL": memory.url,
            "IBEX_CONTEXT_MEMORY_API_TOKEN": memory.token,
            **env,
        }
        with daemon_process(daemon_env, tmp_path / "daemon.log") as daemon:
            yield daemon


def probe(stub: Any, calls: int) -> Counter[str]:
    """`calls` AssembleContext calls of the quiet org, PROBE_RPS a second, 45 ms deadlines."""
    futures = []
    start = time.monotonic()
    for i in range(calls):
        delay = start + i / PROBE_RPS - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(
            stub.AssembleContext.future(request(DEMO_ORG, DEMO_AGENT), timeout=PROBE_DEADLINE_S)
        )
    codes: Counter[str] = Counter()
    for f in futures:
        try:
            f.result()
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
    return codes


def test_a_tenants_large_calls_leave_another_tenants_calls_ok(tmp_path: Path) -> None:
    with (
        daemon_with_memory(tmp_path) as daemon,
        grpc.insecure_channel(daemon.target) as noisy_channel,
        grpc.insecure_channel(daemon.target) as quiet_channel,
    ):
        quiet = context_pb2_grpc.ContextAssemblyServiceStub(quiet_channel)
        quiet.AssembleContext(request(DEMO_ORG, DEMO_AGENT), timeout=10)  # connection up
        noisy = NoisyTenant(
            context_pb2_grpc.ContextAssemblyServiceStub(noisy_channel), NOISY_IN_FLIGHT
        )
        noisy.start()
        try:
            # The worker threads are busy before the probe starts: some large calls ended.
            deadline = time.monotonic() + 20
            while sum(noisy.codes.values()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            busy_before = sum(noisy.codes.values())
            for attempt in range(ATTEMPTS):
                codes = probe(quiet, PROBE_CALLS)
                print(f"quiet org, attempt {attempt + 1}: {dict(codes)}")
                if codes["OK"] >= MIN_OK_SHARE * PROBE_CALLS:
                    break
            busy_during = sum(noisy.codes.values()) - busy_before
        finally:
            noisy.stop()
    print(f"noisy org: {dict(noisy.codes)}")
    assert busy_before >= 4, f"the large calls never finished: {dict(noisy.codes)}"
    assert busy_during >= 2, "the large calls were not running while the quiet org called"
    assert noisy.codes["OK"] >= 4  # the large calls are served too, just not ahead of others
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"}, f"quiet calls refused: {dict(codes)}"
    assert codes["OK"] >= MIN_OK_SHARE * PROBE_CALLS, dict(codes)
