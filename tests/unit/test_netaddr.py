"""`host:port` splitting shared by the settings, the CLI, the client and the supervisor."""

from __future__ import annotations

import pytest

from ibex.netaddr import split_host_port


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
