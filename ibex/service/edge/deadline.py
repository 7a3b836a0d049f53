"""The caller's deadline, read once from a call's HEADERS.

A call's deadline is the `grpc-timeout` header counted from when its HEADERS were
read off the connection, on `time.monotonic()`. grpclib keeps a deadline of its
own that counts from when the handler task starts (later under load); it uses
that one only to cancel the handler. Everything ibex decides from the deadline
(the HEADERS gate, admission, the retrieval wall, the feedback sender) reads
this one value, and the Trio side gets it through `CallDeadline.on_trio_clock`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
import trio

__all__ = ["MAX_TIMEOUT_DIGITS", "CallDeadline", "parse_timeout"]

#: The gRPC spec's TimeoutValue: "positive integer as ASCII string of at most 8 digits".
MAX_TIMEOUT_DIGITS = 8
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str | bytes) -> float:
    """A `grpc-timeout` value in seconds (`TimeoutValue TimeoutUnit`, units H M S m u n).

    Raises ValueError for anything else: no unit, an unknown unit, a sign, spaces,
    non-ASCII digits, or more than `MAX_TIMEOUT_DIGITS` digits.
    """
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    digits, unit = text[:-1], text[-1:]
    scale = _UNITS.get(unit)
    if (
        scale is None
        or not 0 < len(digits) <= MAX_TIMEOUT_DIGITS
        or not digits.isascii()
        or not digits.isdigit()
    ):
        raise ValueError(f"invalid grpc-timeout: {text[:16]!r}")
    return int(digits) * scale


class CallDeadline(msgspec.Struct, frozen=True, gc=False):
    """When a call arrived and by when it must be answered, both on `time.monotonic()`.

    `at` is None when the caller set no deadline. One is built for every call: a
    frozen msgspec struct, untracked by the cyclic collector (it holds two floats).
    """

    arrived: float
    at: float | None = None

    @classmethod
    def after(cls, timeout: float | None, now: float | None = None) -> CallDeadline:
        """A call arriving at `now` (default: this moment) with `timeout` seconds to go."""
        arrived = time.monotonic() if now is None else now
        return cls(arrived, None if timeout is None else arrived + timeout)

    @classmethod
    def from_headers(
        cls, headers: Iterable[tuple[str | bytes, str | bytes]], arrived: float
    ) -> CallDeadline:
        """The deadline the call's headers ask for, counted from `arrived`.

        With several `grpc-timeout` headers the shortest wins (as grpclib reads them).
        Raises ValueError for a malformed value (`parse_timeout`).
        """
        timeout: float | None = None
        for name, value in headers:
            if name in (b"grpc-timeout", "grpc-timeout"):
                seconds = parse_timeout(value)
                if timeout is None or seconds < timeout:
                    timeout = seconds
        return cls.after(timeout, arrived)

    @property
    def timeout(self) -> float | None:
        """The seconds the caller gave the call, from its arrival (None: no deadline)."""
        return None if self.at is None else self.at - self.arrived

    def remaining(self, now: float) -> float | None:
        """Seconds left at `now` (`time.monotonic()`; negative once past), or None."""
        return None if self.at is None else self.at - now

    def expired(self, now: float) -> bool:
        """True once the deadline has passed (never without one)."""
        return self.at is not None and self.at <= now

    def on_trio_clock(self) -> tuple[float, float | None]:
        """(arrived, deadline) on `trio.current_time()`, for the Trio side of the call.

        The only conversion between the two clocks: both are read once, here.
        """
        shift = trio.current_time() - time.monotonic()
        return self.arrived + shift, None if self.at is None else self.at + shift
