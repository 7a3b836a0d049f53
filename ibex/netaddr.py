"""Addresses and peer names as the settings spell them, parsed one way everywhere.

Settings, the CLI flags and the client all take `host:port`, `[v6]:port` and
(for the CLI) `:port`. The port is the text after the last colon, so an IPv6
literal must be bracketed; the brackets are dropped from the host because
socket and resolver calls take the bare address. A leaf module with no
imports, so every layer may use it.

Client-certificate SAN entries (IBEX_CONTEXT_TLS_ALLOWED_SANS) are checked by
the settings parser and matched by the authenticator through the same rules.
"""

from __future__ import annotations

import errno
import ipaddress


def split_host_port(addr: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; the host may be empty (`:port`).

    ValueError when there is no colon or the port is not a number in 0..65535.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal bracketed (the inverse of `split_host_port`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_problem(exc: OSError) -> str:
    """A failed bind in an operator's words (the daemon and `ibex check` say the same)."""
    if exc.errno == errno.EADDRINUSE:
        return "address in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "not an address of this host"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (a port below 1024 needs privileges)"
    return exc.strerror or str(exc)


# Entry prefixes of IBEX_CONTEXT_TLS_ALLOWED_SANS -> the type names `ssl.getpeercert` reports.
SAN_TYPES = {"dns": "DNS", "uri": "URI", "email": "email", "ip": "IP Address"}


def parse_allowed_san(entry: str) -> tuple[str, str]:
    """`DNS:name`, `URI:...`, `email:...`, `IP:addr` or a bare DNS name -> (type, key)."""
    kind, sep, value = entry.partition(":")
    if sep and kind.strip().lower() in SAN_TYPES:
        san_type = SAN_TYPES[kind.strip().lower()]
    elif not sep:
        san_type, value = "DNS", entry
    else:
        raise ValueError(
            f"unknown SAN type {kind!r}: prefix the type (DNS:, URI:, email: or IP:); "
            "a bare entry is a DNS name"
        )
    value = value.strip()
    if not value:
        raise ValueError(f"empty SAN value in {entry!r}")
    return san_type, san_key(san_type, value)


def san_key(san_type: str, value: str) -> str:
    """The comparable form of a SAN value of this type."""
    if san_type == "DNS":
        return value.strip().rstrip(".").lower()
    if san_type == "IP Address":
        try:
            return str(ipaddress.ip_address(value.strip()))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address") from None
    if san_type == "email":
        local, at, domain = value.partition("@")
        return f"{local}{at}{domain.lower()}"
    return value
