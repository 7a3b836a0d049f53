"""The connection policy (cap, idle close, age rotation, drain) on a fake clock and fake
connections; `tests/integration/test_connections.py` runs the same on real sockets."""

from __future__ import annotations

import pytest

from ibex.service.connections import Connections, ConnectionsConfig, default_max_connections


class FakeConn:
    def __init__(self) -> None:
        self.streams = 0
        self.calls: list[str] = []

    def open_streams(self) -> int:
        return self.streams

    def goaway_heads_up(self) -> None:
        self.calls.append("heads_up")

    def goaway_final(self) -> None:
        self.calls.append("final")

    def close_idle(self) -> None:
        self.calls.append("close_idle")

    def close(self) -> None:
        self.calls.append("close")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, jitter: float = 0.5, **config: object) -> Connections:
    return Connections(ConnectionsConfig(**config), clock=clock, jitter=lambda: jitter)  # type: ignore[arg-type]


@pytest.mark.parametrize("soft,cap", [(128, 64), (1024, 960), (65536, 1024), (60, 1)])
def test_default_cap_leaves_headroom_under_the_fd_limit(soft: int, cap: int) -> None:
    assert default_max_connections(soft) == cap


def test_over_the_cap_is_refused() -> None:
    conns = make(Clock(), max_connections=2)
    a, b, c = FakeConn(), FakeConn(), FakeConn()
    assert conns.admit(a) and conns.admit(b)
    assert not conns.admit(c)
    assert conns.refused == 1
    conns.closed(a)
    assert conns.admit(c)


def test_idle_means_no_stream_open_and_none_started_for_the_timeout() -> None:
    clock = Clock()
    conns = make(clock, idle_timeout=10.0)
    busy, idle = FakeConn(), FakeConn()
    conns.admit(busy)
    conns.admit(idle)
    busy.streams = 1
    clock.now += 9
    conns.sweep()
    assert busy.calls == idle.calls == []
    clock.now += 1
    conns.sweep()
    assert idle.calls == ["close_idle"]
    assert busy.calls == []  # a call is open: not idle however long it runs
    busy.streams = 0
    clock.now += 9.5
    conns.sweep()  # the stream was seen open at the last sweep: idle only 9.5 s since
    assert busy.calls == []
    clock.now += 0.5
    conns.sweep()
    assert busy.calls == ["close_idle"]
    assert conns.count == 0 and conns.closed_idle == 2


@pytest.mark.parametrize("jitter,due", [(0.0, 90.0), (0.5, 100.0), (1.0, 110.0)])
def test_age_rotation_with_jitter_then_final_goaway_then_close(jitter: float, due: float) -> None:
    """grpc-go's MaxConnectionAge: age +-10%, GOAWAY(max)+PING, final GOAWAY, close when done."""
    clock = Clock()
    conns = make(clock, jitter, max_age=100.0, age_grace=5.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    clock.now += due - 0.01
    conns.sweep()
    assert conn.calls == []
    clock.now += 0.01
    conns.sweep()
    assert conn.calls == ["heads_up"]
    conns.acked(conn)  # the PING came back: the client has seen the first GOAWAY
    assert conn.calls == ["heads_up", "final"]
    conns.sweep()
    assert conn.calls == ["heads_up", "final"]  # the in-flight call finishes first
    conn.streams = 0
    conns.sweep()
    assert conn.calls == ["heads_up", "final", "close"]
    assert conns.count == 0 and conns.rotated == 1


def test_final_goaway_without_a_ping_ack_and_grace_expiry() -> None:
    clock = Clock()
    conns = make(clock, max_age=10.0, age_grace=3.0, goaway_ack_timeout=1.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    clock.now += 11
    conns.sweep()
    clock.now += 1
    conns.sweep()
    assert conn.calls == ["heads_up", "final"]  # no ack (a client that ignores PINGs)
    clock.now += 1.9
    conns.sweep()
    assert conn.calls[-1] == "final"
    clock.now += 0.1
    conns.sweep()
    assert conn.calls == ["heads_up", "final", "close"]  # the grace ran out


def test_drain_says_goodbye_to_every_connection_and_refuses_new_ones() -> None:
    clock = Clock()
    conns = make(clock)
    a, b = FakeConn(), FakeConn()
    conns.admit(a)
    conns.admit(b)
    a.streams = 1
    conns.goaway_all(grace=10.0)
    assert a.calls == b.calls == ["heads_up"]
    assert not conns.admit(FakeConn())
    conns.acked(a)
    conns.acked(b)
    conns.sweep()
    assert b.calls == ["heads_up", "final", "close"]
    assert a.calls == ["heads_up", "final"]
    a.streams = 0
    conns.sweep()
    assert a.calls[-1] == "close" and conns.count == 0
