"""`host:port` strings, split one way everywhere.

Settings, the CLI flags and the client all take `host:port`, `[v6]:port` and
(for the CLI) `:port`. The port is the text after the last colon, so an IPv6
literal must be bracketed; the brackets are dropped from the host because
socket and resolver calls take the bare address. A leaf module with no
imports, so every layer may use it.
"""

from __future__ import annotations


def split_host_port(addr: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; the host may be empty (`:port`).

    ValueError when there is no colon or the port is not a number in 0..65535.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)
