"""One tenant's large calls cannot take the service from another tenant.

`python -m ibex serve` as its own process, the memory stand-in as its own
process, the stock grpcio client over real sockets. One org keeps many
large calls in flight, each with a fresh 40 K-character CJK tool schema
(fresh, so the token cache cannot answer: every one keeps a worker thread
busy counting it). Another org calls at 50 rps. Its calls need no worker thread and
come back OK (degraded answers are OK): the large calls queue for the thread
before they take an assembly slot, and one org holds at most half the slots.

Statuses only, no timings. The quiet org's deadline is 250 ms, not the 45 ms
of production: on this shared 2-core machine even an idle daemon misses 45 ms
now and then (`python -m benchmarks.load.noisy` measures 45 ms). Without fair
queues the quiet org waits behind the slots the large calls hold: at 250 ms 0-2 %
of its calls were OK and 17-36 % refused (RESOURCE_EXHAUSTED `queue`), at 45 ms
none was OK. None may be refused, and a stall of the machine may
cost at most a few calls their deadline (`MIN_OK_SHARE`; further attempts
are allowed, as in the chaos tests, since a burst of other work on the machine
can cost one probe its deadlines).

What the machine itself allows is measured first: the same probe with no
noisy org. On a machine busy with other work (another process spinning on a
core) fewer than `MIN_OK_SHARE` of the quiet org's calls make 250 ms even
then, so the quiet org must keep `KEEP_SHARE` of that baseline, capped at
`MIN_OK_SHARE` (without fair queues it keeps a few percent of it).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from ibex.testing.grpcio_stubs import context_pb2_grpc
from ibex.testing.memory_server import DEMO_AGENT, DEMO_ORG
from ibex.testing.noisy_tenant import (
    NOISY_IN_FLIGHT,
    PROBE_CALLS,
    NoisyTenant,
    daemon_with_memory,
    probe,
    request,
)

PROBE_DEADLINE_S = 0.25
MIN_OK_SHARE = 0.9
KEEP_SHARE = 0.75
ATTEMPTS = 3


def test_a_tenants_large_calls_leave_another_tenants_calls_ok(tmp_path: Path) -> None:
    with (
        daemon_with_memory(tmp_path) as daemon,
        grpc.insecure_channel(daemon.target) as noisy_channel,
        grpc.insecure_channel(daemon.target) as quiet_channel,
    ):
        quiet = context_pb2_grpc.ContextAssemblyServiceStub(quiet_channel)
        quiet.AssembleContext(request(DEMO_ORG, DEMO_AGENT), timeout=10)  # connection up
        alone = probe(quiet, PROBE_CALLS, PROBE_DEADLINE_S)
        print(f"quiet org alone: {dict(alone)}")
        needed = min(MIN_OK_SHARE * PROBE_CALLS, KEEP_SHARE * alone["OK"])
        noisy = NoisyTenant(
            context_pb2_grpc.ContextAssemblyServiceStub(noisy_channel), NOISY_IN_FLIGHT, cjk=True
        )
        noisy.start()
        try:
            # The worker threads are busy before the probe starts: some large calls ended.
            deadline = time.monotonic() + 20
            while sum(noisy.codes.values()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            busy_before = sum(noisy.codes.values())
            for attempt in range(ATTEMPTS):
                codes = probe(quiet, PROBE_CALLS, PROBE_DEADLINE_S)
                print(f"quiet org, attempt {attempt + 1}: {dict(codes)}")
                if codes["OK"] >= needed:
                    break
            busy_during = sum(noisy.codes.values()) - busy_before
        finally:
            noisy.stop()
    print(f"noisy org: {dict(noisy.codes)}")
    assert busy_before >= 4, f"the large calls never finished: {dict(noisy.codes)}"
    assert busy_during >= 2, "the large calls were not running while the quiet org called"
    assert noisy.codes["OK"] >= 4  # the large calls are served too, just not ahead of others
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"}, f"quiet calls refused: {dict(codes)}"
    assert set(alone) <= {"OK", "DEADLINE_EXCEEDED"}, f"quiet calls refused: {dict(alone)}"
    assert codes["OK"] >= needed, (dict(codes), dict(alone))
