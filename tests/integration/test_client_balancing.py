"""`ContextClient(addresses=[...])`: calls go round robin; an address that is down is skipped."""

from __future__ import annotations

import pytest
import trio
import trio_asyncio

from ibex.client import ContextClient, parse_address
from ibex.testing.grpc_harness import AGENT, ORG, RunningDaemon, free_port, running_daemon

CALLS = 30


def answered(d: RunningDaemon) -> float:
    value = d.daemon.metrics.registry.get_sample_value(
        "ibex_grpc_requests_total", {"method": "AssembleContext", "code": "OK"}
    )
    return value or 0.0


async def test_client_balances_calls_over_addresses_and_skips_a_dead_one() -> None:
    async with (
        running_daemon() as a,
        running_daemon() as b,
        trio_asyncio.open_loop(),
    ):
        dead = f"127.0.0.1:{free_port()}"
        client = ContextClient(addresses=[a.target, dead, ("127.0.0.1", b.port)], deadline=5.0)
        try:
            results = [
                await client.assemble_trio(
                    org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy"
                )
                for _ in range(CALLS)
            ]
        finally:
            client.close()
    # Fail-open never had to happen: every call found a live daemon and was answered OK.
    # (An answer may be degraded: both daemons and this client share one process, and
    # a machine busy with other work can stall it past a branch's timeout.)
    assert {r.status for r in results} == {"OK"}
    # The two live addresses share the calls (the dead one's turns go to the next address).
    assert answered(a) + answered(b) == CALLS
    assert min(answered(a), answered(b)) >= CALLS / 3


async def test_client_fails_open_when_no_address_answers() -> None:
    async with trio_asyncio.open_loop():
        client = ContextClient(
            addresses=[f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], deadline=2.0
        )
        try:
            result = await client.assemble_trio(org_id=ORG, agent_id=AGENT)
        finally:
            client.close()
    assert (result.status, result.degraded, result.degradation_level) == ("UNAVAILABLE", True, "L2")


def test_parse_address() -> None:
    assert parse_address("10.0.0.5:9100") == ("10.0.0.5", 9100)
    assert parse_address("[::1]:9100") == ("::1", 9100)
    assert parse_address(("h", 1)) == ("h", 1)


async def test_single_process_also_serves_on_the_worker_port_base_until_drained() -> None:
    """Without --workers the lone process is worker 0: it listens on WORKER_PORT_BASE too."""
    base = free_port()
    async with running_daemon(worker_port_base=base) as d:
        assert d.port != base
        async with trio_asyncio.open_loop():
            client = ContextClient("127.0.0.1", base, deadline=5.0)
            try:
                result = await client.assemble_trio(
                    org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy"
                )
            finally:
                client.close()
        assert (result.status, result.degraded) == ("OK", False)
        assert answered(d) == 1
        d.shutdown.set()
        with trio.fail_after(10):
            while d.daemon.admission.draining is False:  # noqa: ASYNC110  (daemon state flag)
                await trio.sleep(0.01)
        # Draining: the worker port stops accepting with the shared one.
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", base)
