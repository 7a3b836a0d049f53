"""The connection policy (cap, idle close, age rotation, drain) on a fake clock and fake
connections; `tests/integration/test_connections.py` runs the same on real sockets."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from ibex.service.edge.connections import REFUSAL_LOG_INTERVAL, Connections
from ibex.service.edge.connections_config import (
    MAX_CONNECTIONS_CEILING,
    ConnectionsConfig,
    default_max_connections,
)


class FakeConn:
    def __init__(self) -> None:
        self.streams = 0
        self.calls: list[str] = []

    def open_streams(self) -> int:
        return self.streams

    def goaway_heads_up(self) -> None:
        self.calls.append("heads_up")

    def goaway_confirm(self) -> None:
        self.calls.append("confirm")

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
    """Connections with the close of unauthenticated connections off unless a test sets it
    (these connections never authenticate)."""
    config.setdefault("auth_timeout", None)
    config.setdefault("first_call_grace", 0.0)  # the tests of the grace set one
    return Connections(ConnectionsConfig(**config), clock=clock, jitter=lambda: jitter)  # type: ignore[arg-type]


@pytest.mark.parametrize("soft,cap", [(128, 64), (1024, 960), (65536, 1024), (60, 1)])
def test_default_cap_leaves_headroom_under_the_fd_limit(soft: int, cap: int) -> None:
    assert default_max_connections(soft) == cap


def test_over_the_cap_is_refused_when_every_connection_is_a_busy_caller() -> None:
    conns = make(Clock(), max_connections=2)
    a, b, c = FakeConn(), FakeConn(), FakeConn()
    assert conns.admit(a) and conns.admit(b)
    for conn in (a, b):
        conns.authenticated(conn)
        conn.streams = 1
    assert not conns.admit(c)
    assert conns.refused == 1
    assert a.calls == b.calls == []
    conns.closed(a)
    assert conns.admit(c)


def test_at_the_cap_the_oldest_unauthenticated_then_the_oldest_idle_is_evicted() -> None:
    conns = make(Clock(), max_connections=4)
    busy, idle_old, unauth_old, unauth_new = (FakeConn() for _ in range(4))
    for conn in (busy, idle_old, unauth_old, unauth_new):
        assert conns.admit(conn)
    conns.authenticated(busy)
    busy.streams = 1
    conns.authenticated(idle_old)
    unauth_old.streams = unauth_new.streams = 1  # e.g. Health calls: still unauthenticated
    first, second, third, fourth = (FakeConn() for _ in range(4))
    assert conns.admit(first)
    assert unauth_old.calls == ["close_idle"] and unauth_new.calls == []
    assert conns.admit(second)
    assert unauth_new.calls == ["close_idle"]
    # `first` and `second` are unauthenticated too: they go before the idle caller.
    assert conns.admit(third)
    assert first.calls == ["close_idle"] and idle_old.calls == []
    for conn in (second, third):
        conns.authenticated(conn)
        conn.streams = 1
    assert conns.admit(fourth)  # only now the idle authenticated connection goes
    assert idle_old.calls == ["close_idle"]
    assert busy.calls == []
    assert conns.evicted == 4 and conns.refused == 0
    assert conns.count == 4


def test_the_per_peer_cap_evicts_only_that_peers_connections() -> None:
    conns = make(Clock(), max_connections=10, max_per_peer=2)
    other = FakeConn()
    assert conns.admit(other, "10.0.0.2")
    a, b, c = FakeConn(), FakeConn(), FakeConn()
    assert conns.admit(a, "10.0.0.1") and conns.admit(b, "10.0.0.1")
    assert conns.admit(c, "10.0.0.1")  # evicts a, the peer's oldest unauthenticated
    assert a.calls == ["close_idle"] and other.calls == []
    assert conns.peer_count("10.0.0.1") == 2
    for conn in (b, c):
        conns.authenticated(conn)
        conn.streams = 1
    assert not conns.admit(FakeConn(), "10.0.0.1")  # the peer's callers are all busy
    assert conns.admit(FakeConn(), "10.0.0.3")
    conns.closed(b)
    assert conns.peer_count("10.0.0.1") == 1
    assert conns.admit(FakeConn(), "10.0.0.1")


def test_a_connection_within_its_first_call_grace_is_not_evicted() -> None:
    """A storm of new connections cannot push out a caller that has not yet made its first
    call: at the cap the newcomer is refused while every unauthenticated connection is
    younger than the grace, and the oldest goes once it has had the grace."""
    clock = Clock()
    reasons: list[str] = []
    conns = Connections(
        ConnectionsConfig(max_connections=2, auth_timeout=None, first_call_grace=2.0),
        clock=clock,
        closed_for=reasons.append,
    )
    caller, other = FakeConn(), FakeConn()
    assert conns.admit(caller, "127.0.0.1")
    clock.now += 0.5
    assert conns.admit(other, "127.0.0.2")
    clock.now += 1.0
    assert not conns.admit(FakeConn(), "127.0.0.3")  # both within their grace
    assert caller.calls == other.calls == []
    assert reasons == ["refused_cap"]
    clock.now += 0.6  # `caller` has had 2.1 s, `other` 1.6 s
    assert conns.admit(FakeConn(), "127.0.0.3")
    assert caller.calls == ["close_idle"] and other.calls == []
    assert reasons == ["refused_cap", "evicted"]


def test_at_the_process_cap_the_peer_holding_the_most_gives_way_to_a_quieter_one() -> None:
    """Every connection young: a newcomer from a peer holding fewer evicts the oldest
    unauthenticated connection of the peer holding the most; one from that peer does not."""
    conns = make(Clock(), max_connections=4, first_call_grace=2.0)
    storm = [FakeConn() for _ in range(3)]
    for conn in storm:
        assert conns.admit(conn, "10.0.0.66")
    quiet = FakeConn()
    assert conns.admit(quiet, "10.0.0.7")
    assert not conns.admit(FakeConn(), "10.0.0.66")  # the heaviest peer itself: refused
    caller = FakeConn()
    assert conns.admit(caller, "127.0.0.1")  # holds 0 < 3 - 1: the storm's oldest goes
    assert storm[0].calls == ["close_idle"] and quiet.calls == []
    assert conns.peer_count("10.0.0.66") == 2
    assert conns.admit(FakeConn(), "10.0.0.8")  # the storm's 2 > 0 + 1: its next oldest
    assert storm[1].calls == ["close_idle"]
    assert not conns.admit(FakeConn(), "10.0.0.9")  # every peer holds one: refused
    assert caller.calls == [] and quiet.calls == [] and storm[2].calls == []


def test_a_peer_over_its_connection_rate_is_refused_and_others_are_not() -> None:
    clock = Clock()
    reasons: list[str] = []
    conns = Connections(
        ConnectionsConfig(max_connections=1000, auth_timeout=None, peer_rate=5.0),
        clock=clock,
        closed_for=reasons.append,
    )
    admitted = [conns.admit(FakeConn(), "10.0.0.9") for _ in range(12)]
    assert admitted == [True] * 10 + [False] * 2  # a burst of twice the rate
    assert reasons == ["refused_rate"] * 2
    assert conns.admit(FakeConn(), "10.0.0.1")  # another peer has its own rate
    clock.now += 0.2  # one more connection's worth at 5 per second
    assert conns.admit(FakeConn(), "10.0.0.9")
    assert not conns.admit(FakeConn(), "10.0.0.9")


def test_closes_are_reported_by_reason() -> None:
    clock = Clock()
    reasons: list[str] = []
    conns = Connections(
        ConnectionsConfig(auth_timeout=1.0, idle_timeout=5.0, first_call_grace=0.0),
        clock=clock,
        closed_for=reasons.append,
    )
    holder, caller = FakeConn(), FakeConn()
    conns.admit(holder, "10.0.0.1")
    conns.admit(caller, "10.0.0.1")
    conns.authenticated(caller)
    clock.now += 1.0
    conns.sweep()
    clock.now += 5.0
    conns.sweep()
    conns.flood_closed(caller, "ping_flood")
    assert reasons == ["auth_timeout", "idle", "ping_flood"]
    assert conns.flooded == {"ping_flood": 1}


def test_a_connection_without_an_authenticated_call_is_closed_after_the_auth_timeout() -> None:
    clock = Clock()
    conns = make(clock, auth_timeout=5.0)
    caller, holder, prober = FakeConn(), FakeConn(), FakeConn()
    for conn in (caller, holder, prober):
        conns.admit(conn, "127.0.0.1")
    prober.streams = 1  # an open Health call does not authenticate a connection
    clock.now += 4.9
    conns.authenticated(caller)
    conns.sweep()
    assert holder.calls == prober.calls == []
    clock.now += 0.2
    conns.sweep()
    assert holder.calls == prober.calls == ["close_idle"]
    assert caller.calls == []
    assert conns.closed_unauthenticated == 2
    assert conns.count == 1 and conns.peer_count("127.0.0.1") == 1


def busy_and_idle(clock: Clock) -> tuple[Connections, FakeConn, FakeConn]:
    """A 10 s idle timeout and two connections: one with a stream open, one without."""
    conns = make(clock, idle_timeout=10.0)
    busy, idle = FakeConn(), FakeConn()
    conns.admit(busy)
    conns.admit(idle)
    busy.streams = 1
    return conns, busy, idle


def test_idle_means_no_stream_open_and_none_started_for_the_timeout() -> None:
    clock = Clock()
    conns, busy, idle = busy_and_idle(clock)
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
    conns.acked(conn)  # the PING came back: the client has read the first GOAWAY
    assert conn.calls == ["heads_up", "confirm"]
    conns.confirmed(conn)  # and the second: every stream it started has arrived
    assert conn.calls == ["heads_up", "confirm", "final"]
    conns.sweep()
    assert conn.calls == ["heads_up", "confirm", "final"]  # the in-flight call finishes first
    conn.streams = 0
    conns.sweep()
    assert conn.calls == ["heads_up", "confirm", "final", "close"]
    assert conns.count == 0 and conns.rotated == 1


def test_final_goaway_without_a_ping_ack_and_grace_expiry() -> None:
    clock = Clock()
    conns = make(clock, max_age=10.0, age_grace=3.0, goaway_ack_timeout=1.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    clock.now += 11
    conns.sweep()
    clock.now += 0.5
    conns.sweep()
    assert conn.calls == ["heads_up"]  # half the ack timeout since the heads-up: waiting
    clock.now += 0.5
    conns.sweep()
    assert conn.calls == ["heads_up", "final"]  # no ack (a client that ignores PINGs)
    clock.now += 1.9
    conns.sweep()
    assert conn.calls[-1] == "final"
    clock.now += 0.1
    conns.sweep()
    assert conn.calls == ["heads_up", "final", "close"]  # the grace ran out


def test_the_final_goaway_waits_for_the_second_ping_however_slow_the_first_ack() -> None:
    """The final GOAWAY's last-stream-id must cover every stream the client started before
    it read the first GOAWAY; only the ack of a PING sent after the first ack proves they
    all arrived. A client answering late is waited for (up to the ack timeout)."""
    clock = Clock()
    conns = make(clock, goaway_ack_timeout=5.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    conns.goaway_all(grace=30.0)
    clock.now += 4.9  # a busy client: its ack comes late
    conns.sweep()
    assert conn.calls == ["heads_up"]
    conns.confirmed(conn)  # an ack of the second PING before it was sent changes nothing
    conns.acked(conn)
    conns.acked(conn)  # nor does the first PING acked twice
    assert conn.calls == ["heads_up", "confirm"]
    conns.sweep()
    assert conn.calls == ["heads_up", "confirm"]
    conns.confirmed(conn)
    assert conn.calls == ["heads_up", "confirm", "final"]


@pytest.mark.parametrize(
    "grace,final_after", [(30.0, 5.0), (2.0, 2.0)], ids=["ack_timeout", "grace_end"]
)
def test_without_acks_the_final_goaway_goes_at_the_ack_timeout_or_the_grace_end(
    grace: float, final_after: float
) -> None:
    clock = Clock()
    conns = make(clock, goaway_ack_timeout=5.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    conns.goaway_all(grace=grace)
    conns.acked(conn)  # the first PING answered, the second never
    clock.now += final_after - 0.01
    conns.sweep()
    assert conn.calls == ["heads_up", "confirm"]
    clock.now += 0.01
    conns.sweep()
    assert conn.calls[:3] == ["heads_up", "confirm", "final"]


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
    for conn in (a, b):
        conns.acked(conn)
        conns.confirmed(conn)
    conns.sweep()
    assert b.calls == ["heads_up", "confirm", "final", "close"]
    assert a.calls == ["heads_up", "confirm", "final"]
    a.streams = 0
    conns.sweep()
    assert a.calls[-1] == "close" and conns.count == 0


def hold_busy(conns: Connections) -> FakeConn:
    """An authenticated caller's connection with a call open: never evicted."""
    conn = FakeConn()
    assert conns.admit(conn)
    conns.authenticated(conn)
    conn.streams = 1
    return conn


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == name]


def test_a_flood_of_refusals_is_logged_once_per_interval_with_what_was_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    conns = make(clock, max_connections=1)
    hold_busy(conns)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        for _ in range(3):  # the first one logs at once, the next two wait for the interval
            assert not conns.admit(FakeConn())
        clock.now += REFUSAL_LOG_INTERVAL - 0.5
        assert not conns.admit(FakeConn())
        clock.now += 0.5  # exactly one interval after the first line
        assert not conns.admit(FakeConn())
    lines = _events(caplog, "connections_refused")
    assert [(r.refused, r.open, r.max_connections, r.draining) for r in lines] == [  # type: ignore[attr-defined]
        (1, 1, 1, False),
        (4, 1, 1, False),  # refused since the last line
    ]
    assert conns.refused == 5
    assert [r.max_per_peer for r in lines] == [None, None]  # type: ignore[attr-defined]


def test_a_refusal_line_carries_the_per_peer_cap(caplog: pytest.LogCaptureFixture) -> None:
    """docs/operations.md: connections_refused carries max_per_peer."""
    conns = make(Clock(), max_connections=1, max_per_peer=3)
    hold_busy(conns)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        assert not conns.admit(FakeConn(), "192.0.2.7")
    (line,) = _events(caplog, "connections_refused")
    assert line.max_per_peer == 3  # type: ignore[attr-defined]


def test_refusals_while_draining_say_so(caplog: pytest.LogCaptureFixture) -> None:
    conns = make(Clock())
    conns.goaway_all(grace=1.0)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        assert not conns.admit(FakeConn())
    (line,) = _events(caplog, "connections_refused")
    assert line.draining is True and line.open == 0  # type: ignore[attr-defined]


def test_an_ack_for_a_connection_not_saying_goodbye_changes_nothing() -> None:
    conns = make(Clock())
    stranger, open_one = FakeConn(), FakeConn()
    conns.acked(stranger)  # never admitted (or already gone)
    conns.confirmed(stranger)
    conns.admit(open_one)
    conns.acked(open_one)  # a PING ack with no heads-up pending
    conns.confirmed(open_one)
    assert open_one.calls == []
    conns.closed(stranger)  # closing one never admitted is harmless too
    assert conns.count == 1


def test_every_idle_connection_closes_in_one_sweep() -> None:
    clock = Clock()
    conns = make(clock, idle_timeout=10.0)
    idle = [FakeConn() for _ in range(3)]
    for conn in idle:
        conns.admit(conn)
    clock.now += 10
    conns.sweep()
    assert [c.calls for c in idle] == [["close_idle"]] * 3
    assert conns.count == 0 and conns.closed_idle == 3


def test_rotations_are_counted_and_a_grace_expiry_is_logged_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    conns = make(clock, max_age=10.0, age_grace=3.0, goaway_ack_timeout=1.0, idle_timeout=None)
    a, b = FakeConn(), FakeConn()
    conns.admit(a)
    conns.admit(b)
    a.streams, b.streams = 2, 1
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        conns.sweep()
        assert conns.rotated == 2
        clock.now += 3  # past the ack timeout and the grace (heads-up at 110, grace to 113)
        conns.sweep()
        conns.sweep()
    assert a.calls == b.calls == ["heads_up", "final", "close"]
    lines = _events(caplog, "connection_grace_expired")
    assert sorted((r.reason, r.streams) for r in lines) == [("max_age", 1), ("max_age", 2)]  # type: ignore[attr-defined]
    assert conns.count == 0


def test_a_drain_shortens_the_grace_of_a_connection_already_saying_goodbye(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    conns = make(clock, max_age=10.0, age_grace=60.0, idle_timeout=None)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    clock.now += 10
    conns.sweep()  # rotating, with 60 s of grace
    conns.acked(conn)
    conns.confirmed(conn)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        conns.goaway_all(grace=2.0)  # the drain's 2 s win over the rotation's 60
        assert conn.calls == ["heads_up", "confirm", "final"]  # no second goodbye
        clock.now += 1.5
        conns.sweep()
        assert conn.calls == ["heads_up", "confirm", "final"]  # within the drain's grace
        clock.now += 0.5
        conns.sweep()
    assert conn.calls == ["heads_up", "confirm", "final", "close"]
    (line,) = _events(caplog, "connection_grace_expired")
    assert line.reason == "max_age"  # type: ignore[attr-defined]


def test_a_drain_gives_open_connections_the_reason_drain(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    conns = make(clock)
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        conns.goaway_all(grace=1.0)
        conns.acked(conn)
        clock.now += 1
        conns.sweep()
    (line,) = _events(caplog, "connection_grace_expired")
    assert line.reason == "drain"  # type: ignore[attr-defined]


def test_an_unlimited_fd_limit_gives_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    def limits(soft: int) -> object:
        def getrlimit(which: int) -> tuple[int, int]:
            assert which == resource.RLIMIT_NOFILE
            return soft, resource.RLIM_INFINITY

        return getrlimit

    monkeypatch.setattr(resource, "getrlimit", limits(resource.RLIM_INFINITY))
    assert default_max_connections() == MAX_CONNECTIONS_CEILING
    monkeypatch.setattr(resource, "getrlimit", limits(256))
    assert default_max_connections() == 256 - 64


def test_the_first_refusal_is_logged_even_at_clock_zero(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    clock.now = 0.0  # a monotonic clock may start near zero (a fresh boot)
    conns = make(clock, max_connections=1)
    hold_busy(conns)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        assert not conns.admit(FakeConn())
    assert len(_events(caplog, "connections_refused")) == 1


@pytest.mark.parametrize(
    ("config", "tick"),
    [
        ({"idle_timeout": None, "max_age": None}, 1.0),  # nothing due soon: once a second
        ({"idle_timeout": 5.0, "max_age": None}, 0.5),  # a tenth of the idle timeout
        ({"idle_timeout": 300.0, "max_age": 4.0}, 0.2),  # a twentieth of the age
        ({"idle_timeout": 0.05, "max_age": None}, 0.01),  # never more often than 10 ms
        ({"idle_timeout": None, "max_age": None, "auth_timeout": 3.3}, 0.33),  # a tenth
    ],
)
def test_the_sweep_runs_often_enough_for_what_is_configured(
    config: dict[str, float | None], tick: float
) -> None:
    conns = make(Clock(), **config)
    conns.admit(FakeConn())
    assert conns._tick() == pytest.approx(tick)


def test_while_a_connection_says_goodbye_the_sweep_runs_every_10_ms() -> None:
    conns = make(Clock())
    conn = FakeConn()
    conns.admit(conn)
    conn.streams = 1
    conns.goaway_all(grace=5.0)
    assert conns._tick() == 0.01


def test_data_on_an_open_stream_restarts_the_idle_clock() -> None:
    clock = Clock()
    conns = make(clock, idle_timeout=10.0)
    conn = FakeConn()
    conns.admit(conn)
    clock.now += 9
    conn.streams = 1
    conns.active(conn)  # a stream started and ended between two sweeps
    conn.streams = 0
    clock.now += 9
    conns.sweep()
    assert conn.calls == []  # idle 9 s since that stream, not 18
    conns.active(conn)  # data with no stream open (a PING, a WINDOW_UPDATE) is not activity
    clock.now += 1
    conns.sweep()
    assert conn.calls == ["close_idle"]
    conns.active(FakeConn())  # one never admitted: nothing to do


async def test_the_sweeper_task_closes_idle_connections_and_wakes_for_a_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = Clock()
    conns, busy, idle = busy_and_idle(clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conns.run)
        clock.now += 10
        await trio.sleep(1.5)  # past one tick (a tenth of the idle timeout) of Trio's clock
        assert idle.calls == ["close_idle"]
        conns.goaway_all(grace=5.0)
        await trio.sleep(0.001)  # the drain wakes the sweeper: no wait for its tick
        assert busy.calls == ["heads_up"]
        conns.acked(busy)
        conns.confirmed(busy)
        busy.streams = 0
        with trio.fail_after(1):
            await conns.wait_closed()
        assert busy.calls == ["heads_up", "confirm", "final", "close"]
        nursery.cancel_scope.cancel()
    assert conns.count == 0


def test_evictions_are_logged_once_per_interval_with_the_cap_that_made_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`connections_evicted`: at once for the first, then one line per REFUSAL_LOG_INTERVAL
    (exactly one interval later included) counting the evictions since the last line, the
    connections open and which cap (a peer's or the process's) forced them."""
    clock = Clock()
    clock.now = 0.0  # a monotonic clock may start near zero: the first still logs at once
    conns = make(clock, max_connections=2, max_per_peer=1)
    with caplog.at_level(logging.WARNING, logger="ibex.service.edge.connections"):
        assert conns.admit(FakeConn(), "10.0.0.1")
        assert conns.admit(FakeConn(), "10.0.0.1")  # the peer's cap: its idle one goes
        assert conns.admit(FakeConn(), "10.0.0.2")
        assert conns.admit(FakeConn(), "10.0.0.3")  # the process cap: the oldest idle goes
        assert conns.admit(FakeConn(), "10.0.0.4")
        clock.now += REFUSAL_LOG_INTERVAL
        assert conns.admit(FakeConn(), "10.0.0.5")  # one interval later: a line again
    lines = _events(caplog, "connections_evicted")
    assert [(r.evicted, r.open, r.cap) for r in lines] == [  # type: ignore[attr-defined]
        (1, 1, "per_peer"),
        (3, 2, "process"),
    ]
    assert conns.evicted == 4 and conns.count == 2
    assert conns.peer_count("10.0.0.1") == 0 and conns.peer_count("10.0.0.5") == 1


def test_a_peer_whose_connections_all_closed_leaves_no_entry_behind() -> None:
    """Per-peer counts are kept only for peers with a connection open: a scan from many
    addresses leaves nothing behind once its sockets are gone."""
    conns = make(Clock(), max_connections=100, max_per_peer=4)
    opened = [(FakeConn(), f"10.0.{i // 2}.1") for i in range(6)]
    for conn, peer in opened:
        assert conns.admit(conn, peer)
    assert conns.peer_count("10.0.0.1") == 2
    for conn, _ in opened:
        conns.closed(conn)
    assert conns.count == 0 and conns._peers == {}


def test_a_connection_that_never_authenticated_closes_at_exactly_the_auth_timeout() -> None:
    clock = Clock()
    conns = make(clock, auth_timeout=5.0, idle_timeout=None)
    silent = FakeConn()
    assert conns.admit(silent)
    clock.now = 104.99
    conns.sweep()
    assert silent.calls == []
    clock.now = 105.0  # accepted at 100.0
    conns.sweep()
    assert silent.calls == ["close_idle"] and conns.closed_unauthenticated == 1
