"""One tenant keeping large calls in flight while another calls at a steady rate.

Shared by tests/integration/test_fair_work.py and `python -m benchmarks.load.noisy`:
`python -m ibex serve` as its own process, the memory stand-in as its own process,
the stock grpcio client. The large calls each carry a fresh ~100 K-character tool
schema (fresh, so the token cache cannot answer: every one needs a worker thread).
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

from ibex.testing.grpc_harness import DaemonProcess, daemon_process
from ibex.testing.grpcio_stubs import context_pb2
from ibex.testing.memory_server import DEMO_AGENT, DEMO_ORG, memory_server_process

NOISY_ORG = "30000000-0000-4000-8000-000000000001"
NOISY_AGENT = "30000000-0000-4000-8000-000000000002"
NOISY_IN_FLIGHT = 24
SCHEMA_CHARS = 100_000
CJK_SCHEMA_CHARS = 40_000  # about 60 K tokens: 100 K CJK characters would not fit gpt-4o
PROBE_RPS = 50
PROBE_CALLS = 100  # two seconds
_WORDS = [
    "invoice", "customer", "amount", "currency", "string", "integer", "object", "required",
    "description", "properties", "enum", "format", "date", "refund", "ledger", "account",
]  # fmt: skip


_TEXT = " ".join(random.Random(3).choices(_WORDS, k=400_000))
# CJK text costs the most to escape and to count: the worker threads' worst case.
_CJK_TEXT = "".join(chr(c) for c in random.Random(4).choices(range(0x4E00, 0x9FA0), k=400_000))


def large_schema(rng: random.Random, cjk: bool = False) -> str:
    """A tool schema of about SCHEMA_CHARS characters that no earlier call sent.

    A slice of one long text at a random offset: cheap for the test process, whose
    own CPU would otherwise delay its calls.
    """
    text, chars = (_CJK_TEXT, CJK_SCHEMA_CHARS) if cjk else (_TEXT, SCHEMA_CHARS)
    start = rng.randrange(len(text) - chars)
    name = f"bulk_{rng.getrandbits(64):x}"
    return f'{{"name": "{name}", "description": "{text[start : start + chars]}"}}'


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

    def __init__(self, stub: Any, in_flight: int, cjk: bool = False) -> None:
        self.stub = stub
        self.in_flight = in_flight
        self.cjk = cjk
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
            schema = large_schema(self._rng, self.cjk)
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
def daemon_with_memory(log_dir: Path, **env: str) -> Iterator[DaemonProcess]:
    with memory_server_process(memories=20) as memory:
        daemon_env = {
            "IBEX_CONTEXT_MEMORY_BASE_URL": memory.url,
            "IBEX_CONTEXT_MEMORY_API_TOKEN": memory.token,
            **env,
        }
        with daemon_process(daemon_env, log_dir / "daemon.log") as daemon:
            yield daemon


def probe(stub: Any, calls: int, deadline: float, rps: float = PROBE_RPS) -> Counter[str]:
    """`calls` AssembleContext calls of the quiet org, `rps` a second, each with `deadline`."""
    futures = []
    start = time.monotonic()
    for i in range(calls):
        delay = start + i / rps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(stub.AssembleContext.future(request(DEMO_ORG, DEMO_AGENT), timeout=deadline))
    codes: Counter[str] = Counter()
    for f in futures:
        try:
            f.result()
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
    return codes
