"""Who may reach /metrics: settings, the bind policy, and the connection gate's rules.

The socket-level behaviour (401, the head timeout, idle sockets of one or many
peers) is in tests/integration/test_metrics_http.py; here are the decisions.
"""

from __future__ import annotations

import subprocess

import pytest

from ibex.config import ConfigError, load_settings
from ibex.ops.metrics_http import _Gate, token_digest
from ibex.service.startup_checks import check_bind_policy

TOKEN_SHA = token_digest("scrape-token")


def test_token_digest_is_what_sha256sum_prints() -> None:
    # printf %s scrape-token | sha256sum
    out = subprocess.run(
        ["sha256sum"], input=b"scrape-token", capture_output=True, check=True
    ).stdout.split()[0]
    assert out.decode() == TOKEN_SHA


def test_a_bare_port_binds_loopback() -> None:
    assert load_settings({"IBEX_CONTEXT_METRICS_ADDR": "9464"}).metrics_addr == "127.0.0.1:9464"
    assert load_settings({"IBEX_CONTEXT_METRICS_ADDR": " 9464 "}).metrics_addr == "127.0.0.1:9464"
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_METRICS_ADDR"):
        load_settings({"IBEX_CONTEXT_METRICS_ADDR": "99999"})


def test_metrics_token_digests_are_validated_and_redacted() -> None:
    other = token_digest("next-token")
    s = load_settings({"IBEX_CONTEXT_METRICS_TOKEN_SHA256": f"{TOKEN_SHA.upper()}, {other}"})
    assert s.metrics_token_sha256 == (TOKEN_SHA, other)
    shown = repr(s.redacted())
    assert TOKEN_SHA not in shown and other not in shown
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_METRICS_TOKEN_SHA256: each entry") as info:
        load_settings({"IBEX_CONTEXT_METRICS_TOKEN_SHA256": "scrape-token"})
    assert "scrape-token" not in str(info.value)


@pytest.mark.parametrize("addr", ["0.0.0.0:9464", "[::]:9464", "10.1.2.3:9464", "metrics:9464"])
def test_metrics_off_loopback_needs_a_token(addr: str) -> None:
    env = {"IBEX_CONTEXT_METRICS_ADDR": addr}
    with pytest.raises(ConfigError) as info:
        check_bind_policy(load_settings(env))
    assert str(info.value).startswith("IBEX_CONTEXT_METRICS_ADDR: binding ")
    assert "IBEX_CONTEXT_METRICS_TOKEN_SHA256" in str(info.value)
    with_token = load_settings({**env, "IBEX_CONTEXT_METRICS_TOKEN_SHA256": TOKEN_SHA})
    assert check_bind_policy(with_token) is None
    insecure = load_settings({**env, "IBEX_CONTEXT_ALLOW_INSECURE": "1"})
    warning = check_bind_policy(insecure)
    assert warning is not None and "/metrics" in warning


@pytest.mark.parametrize("addr", ["127.0.0.1:9464", "[::1]:9464", "localhost:9464", "9464"])
def test_metrics_on_loopback_needs_no_token(addr: str) -> None:
    assert check_bind_policy(load_settings({"IBEX_CONTEXT_METRICS_ADDR": addr})) is None


def test_both_insecure_binds_are_named_in_the_warning() -> None:
    s = load_settings(
        {
            "IBEX_CONTEXT_GRPC_ADDR": "0.0.0.0:9092",
            "IBEX_CONTEXT_METRICS_ADDR": "0.0.0.0:9464",
            "IBEX_CONTEXT_ALLOW_INSECURE": "1",
        }
    )
    warning = check_bind_policy(s)
    assert warning is not None
    assert "without caller authentication" in warning and "without a scrape token" in warning


# -- the gate ----------------------------------------------------------------------------


async def test_a_peer_over_its_cap_closes_its_own_oldest_idle_connection() -> None:
    gate = _Gate(limit=16, per_peer=2)
    a1, a2 = gate.admit("a"), gate.admit("a")
    assert a1 is not None and a2 is not None
    a3 = gate.admit("a")
    assert a3 is not None
    assert a1.scope.cancel_called and not a2.scope.cancel_called
    assert gate.by_peer == {"a": 2} and gate.open == 2
    gate.release(a1)  # its task ends later: released once only
    assert gate.by_peer == {"a": 2} and gate.open == 2


async def test_connections_being_answered_are_never_closed_to_make_room() -> None:
    gate = _Gate(limit=3, per_peer=2)
    answering = [gate.admit("a"), gate.admit("a"), gate.admit("b")]
    for conn in answering:
        assert conn is not None
        gate.waiting.pop(conn)  # the handler does this once the head is in
    assert gate.admit("a") is None  # its own cap, nothing idle of its own
    assert gate.admit("c") is None  # the process cap, nothing idle at all
    assert not any(c.scope.cancel_called for c in answering if c is not None)
    assert gate.refused == 2


async def test_at_the_process_cap_the_oldest_idle_connection_of_anyone_gives_way() -> None:
    gate = _Gate(limit=3, per_peer=2)
    b1, a1, a2 = gate.admit("b"), gate.admit("a"), gate.admit("a")
    assert b1 is not None and a1 is not None and a2 is not None
    gate.waiting.pop(a1)  # a1 is being answered
    c1 = gate.admit("c")
    assert c1 is not None
    assert b1.scope.cancel_called and not a1.scope.cancel_called and not a2.scope.cancel_called
    assert gate.by_peer == {"a": 2, "c": 1} and gate.open == 3
    for conn in (a1, a2, c1, b1):
        gate.release(conn)
    assert gate.by_peer == {} and gate.open == 0 and not gate.waiting
