"""`HttpPool.warm`: connections made before a call needs them, and kept from expiring.

In-memory connections through the pool's injectable `connect` (the harness of
test_http_pool_memory), on a mock clock: a warmed connection is the one the
next call uses; a warm while an idle connection still has `fresh_for` seconds
before it expires opens nothing, one that would expire sooner is replaced, and
expired ones are closed; a failed connect is an error that holds no slot.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ibex.sources.http_connect import Link
from ibex.sources.http_framing import TransportError
from tests.unit.test_http_pool_memory import CAP, OK, Harness


async def test_a_warmed_connection_is_the_one_the_first_call_uses(nursery: trio.Nursery) -> None:
    h = Harness(nursery)
    h.replies.append(OK)
    pool = h.pool()
    with trio.fail_after(CAP):
        assert await pool.warm() == 1
        assert (pool.stats().idle, len(h.links), h.requests) == (1, 1, [])
        assert await pool.request("GET", "/a") == (200, b"ok")
    assert len(h.links) == 1 and pool.stats().opened == 1
    await pool.aclose()


async def test_warm_replaces_idle_connections_before_they_expire(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    h = Harness(nursery)
    pool = h.pool(keepalive_expiry=5.0)
    assert await pool.warm(fresh_for=2.0) == 1
    mock_clock.jump(2.0)  # 3 s left: fresh enough
    assert await pool.warm(fresh_for=2.0) == 0
    mock_clock.jump(1.5)  # 1.5 s left: replaced ahead of time
    assert await pool.warm(fresh_for=2.0) == 1
    assert pool.stats().idle == 2
    mock_clock.jump(2.0)  # the first one expired: closed, the second is enough
    assert await pool.warm(fresh_for=2.0) == 0
    assert (pool.stats().idle, [link.closed for link in h.links]) == (1, [True, False])
    await pool.aclose()


async def test_a_failed_connect_raises_and_holds_no_slot(nursery: trio.Nursery) -> None:
    async def refused() -> tuple[trio.abc.Stream, Link]:
        raise OSError("connection refused")

    h = Harness(nursery)
    h.connect = refused  # type: ignore[method-assign]
    pool = h.pool()
    with pytest.raises(TransportError, match="ConnectError"):
        await pool.warm()
    stats = pool.stats()
    assert (stats.leases, stats.connections, stats.opened) == (0, 0, 0)
    await pool.aclose()
