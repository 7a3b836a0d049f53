"""`host:port` splitting shared by the settings, the CLI, the client and the supervisor."""

from __future__ import annotations

import pytest

from ibex.config import ConfigError, load_settings
from ibex.netaddr import parse_allowed_san, split_host_port


def test_splits_host_ipv6_and_bare_port() -> None:
    assert split_host_port("10.0.0.5:9100") == ("10.0.0.5", 9100)
    assert split_host_port("[::1]:9100") == ("::1", 9100)
    assert split_host_port(":9100") == ("", 9100)
    assert split_host_port("h:0") == ("h", 0)
    assert split_host_port("h:65535") == ("h", 65535)


@pytest.mark.parametrize("bad", ["h", "h:", "h:x", "h:-1", "h:65536", ""])
def test_rejects_a_missing_or_out_of_range_port(bad: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(bad)


def test_san_entries_parse_to_the_names_getpeercert_reports() -> None:
    assert parse_allowed_san("DNS:Client.Example.") == ("DNS", "client.example")
    assert parse_allowed_san("client.example") == ("DNS", "client.example")
    assert parse_allowed_san("ip:0:0::1") == ("IP Address", "::1")
    assert parse_allowed_san("email:Me@Example.COM") == ("email", "Me@example.com")
    assert parse_allowed_san("URI:spiffe://a/b") == ("URI", "spiffe://a/b")


@pytest.mark.parametrize("bad", ["otherName:x", "IP:not-an-ip", "DNS: "])
def test_the_settings_refuse_what_the_authenticator_could_not_match(bad: str) -> None:
    """The settings check and the authenticator share one parser, so an entry the daemon
    would fail on at start is a ConfigError naming the variable."""
    with pytest.raises(ValueError):
        parse_allowed_san(bad)
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_TLS_ALLOWED_SANS"):
        load_settings({"IBEX_CONTEXT_TLS_ALLOWED_SANS": bad})
