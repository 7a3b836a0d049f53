"""Per-connection budgets of HTTP/2 frames that do no useful work (sans-IO).

The known HTTP/2 floods cost the attacker a few bytes per frame and the
server a frame's worth of h2 and grpclib work (and often a reply queued for a
peer that never reads): rapid reset (CVE-2023-44487: HEADERS then RST_STREAM),
ping flood (CVE-2019-9512), reset flood (9514), settings flood (9515),
zero-length headers (9516), unread replies (9517), empty frames (9518), and
PRIORITY / unknown-type frames. None of those frames serves a call, so each
connection gets a budget of them per kind, as nghttp2, Envoy and Go's
x/net/http2 keep one: a token bucket that starts small, grows once the
connection has made an authenticated call, refills at a steady rate and with
every answered call, and when a bucket is empty the connection is closed with
GOAWAY(ENHANCE_YOUR_CALM) (PROTOCOL_ERROR for malformed header blocks). A
CONTINUATION flood is closed by h2 itself (64 frames per header block).

`FrameGuard` reads the raw bytes before h2 parses them (a 9-byte frame header
scan, payloads skipped), so an offending frame is counted however h2 would
treat it, and the connection closes before h2 spends anything on the frame
that emptied the bucket. `ibex.service.edge.protocol` owns the socket side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

# Frame types (RFC 9113 6) and flags read by the scan.
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PING, _CONTINUATION = 0, 1, 2, 3, 4, 6, 9
_LAST_KNOWN_TYPE = 9
_PLAIN = frozenset({_DATA, 5, 7, 8})  # DATA (unless empty), PUSH_PROMISE, GOAWAY, WINDOW_UPDATE
_ACK = 0x1
_END_STREAM = 0x1
_END_HEADERS = 0x4
PREFACE_BYTES = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", read before any frame

ENHANCE_YOUR_CALM: Final = 0xB
PROTOCOL_ERROR: Final = 0x1

#: A request header block with more fields than this is not a gRPC client's
#: (grpcio sends about ten): CVE-2019-9516 sends thousands of empty ones.
MAX_REQUEST_HEADER_FIELDS = 100


class Budget(msgspec.Struct, frozen=True):
    """One kind's bucket: `unauthenticated` offending frames before the connection has made
    an authenticated call, `authenticated` after; refilled `per_second` and by one for
    every answered call (up to the current size)."""

    unauthenticated: int
    authenticated: int
    per_second: float


#: Kinds of offence, their budgets and the GOAWAY error code each closes with.
#: The sizes leave room for honest clients: grpcio sends a PING per data burst it
#: measures (each follows an answer, which refills the bucket), SETTINGS once or
#: twice, and RST_STREAM when a call is cancelled or its deadline passes (a burst
#: of up to `authenticated` cancelled calls at once is tolerated).
BUDGETS: Final[dict[str, Budget]] = {
    "rapid_reset": Budget(8, 1000, 33.0),
    "reset_flood": Budget(16, 64, 10.0),
    "ping_flood": Budget(16, 64, 10.0),
    "settings_flood": Budget(8, 32, 5.0),
    "empty_frames": Budget(8, 32, 10.0),
    "empty_headers": Budget(1, 4, 1.0),
    "priority_flood": Budget(32, 128, 10.0),
    "unknown_frames": Budget(16, 64, 10.0),
    "unread_output": Budget(32, 1024, 10.0),
}
CLOSE_CODES: Final[dict[str, int]] = {kind: ENHANCE_YOUR_CALM for kind in BUDGETS} | {
    "empty_headers": PROTOCOL_ERROR
}
#: Every reason `ibex_connections_closed_total` carries for a flood, plus the HTTP/2
#: errors h2 closes on by itself (a CONTINUATION flood among them).
FLOOD_REASONS: Final = (*BUDGETS, "continuation_flood", "too_many_streams", "protocol_error")


class _Bucket:
    __slots__ = ("at", "budget", "size", "tokens")

    def __init__(self, budget: Budget, now: float) -> None:
        self.budget = budget
        self.size = float(budget.unauthenticated)
        self.tokens = self.size
        self.at = now

    def take(self, n: int, now: float, authenticated: bool) -> bool:
        """Spend `n` tokens; False when the bucket ran dry."""
        budget = self.budget
        if authenticated and self.size < budget.authenticated:
            self.tokens += budget.authenticated - self.size
            self.size = float(budget.authenticated)
        elapsed = now - self.at
        self.at = now
        self.tokens = min(self.size, self.tokens + elapsed * budget.per_second) - n
        return self.tokens >= 0

    def earn(self, n: int) -> None:
        self.tokens = min(self.size, self.tokens + n)


class FrameGuard:
    """Counts one connection's offending frames; `scan` and the others return the reason
    to close it (a key of `BUDGETS`), or None."""

    __slots__ = ("_buckets", "_clock", "_head", "_owed", "_skip", "authenticated")

    def __init__(
        self,
        budgets: dict[str, Budget] = BUDGETS,
        *,
        clock: Callable[[], float] = time.monotonic,
        preface: int = PREFACE_BYTES,
    ) -> None:
        now = clock()
        self._clock = clock
        self._buckets = {kind: _Bucket(b, now) for kind, b in budgets.items()}
        self._skip = preface  # bytes still to pass over: the preface, then a frame's payload
        self._head = b""  # a frame header split across two reads
        self._owed = 0  # answered calls not yet paid into the buckets (`earned`)
        self.authenticated: Callable[[], bool] = lambda: False

    def _spend(self, counts: dict[str, int]) -> str | None:
        if self._owed:
            # Earnings and time refills only add, each capped at the bucket's size, and
            # the size changes only in `take`: paid in one sum before it, they leave the
            # tokens exactly where paying each at once would.
            owed, self._owed = self._owed, 0
            for earner in self._buckets.values():
                earner.earn(owed)
        now = self._clock()
        authenticated = self.authenticated()
        for kind, n in counts.items():
            bucket = self._buckets.get(kind)
            if bucket is not None and not bucket.take(n, now, authenticated):
                return kind
        return None

    def earned(self) -> None:
        """A call was answered: useful work, which buys back one frame of every kind.

        Counted here and paid into the buckets when a frame is next spent: once per
        answer, where offending frames are rare."""
        self._owed += 1

    def scan(self, data: bytes | bytearray | memoryview) -> str | None:
        """Read the frame headers in `data` (the next bytes from the peer).

        One pass of plain indexing: it runs on every read of every connection."""
        n = len(data)
        pos = 0
        counts: dict[str, int] | None = None
        while pos < n:
            if self._skip:
                step = min(self._skip, n - pos)
                pos += step
                self._skip -= step
                continue
            if self._head or n - pos < 9:
                need = 9 - len(self._head)
                self._head += bytes(data[pos : pos + need])
                pos += min(need, n - pos)
                if len(self._head) < 9:
                    break
                header: bytes | bytearray | memoryview = self._head
                self._head = b""
                at = 0
            else:
                header, at = data, pos
                pos += 9
            length = (header[at] << 16) | (header[at + 1] << 8) | header[at + 2]
            self._skip = length
            kind = header[at + 3]
            if kind in _PLAIN and (kind != _DATA or length):
                continue  # DATA with a payload, WINDOW_UPDATE, GOAWAY: never counted
            offence = _offence(kind, header[at + 4], length)
            if offence is not None:
                if counts is None:
                    counts = {}
                counts[offence] = counts.get(offence, 0) + 1
        return self._spend(counts) if counts else None

    def offend(self, kind: str, n: int = 1) -> str | None:
        """`n` offending frames of `kind` seen after h2 parsed them (`malformed`, or a
        reply requested while the peer is not reading: "unread_output")."""
        return self._spend({kind: n}) if n else None


def malformed(headers: Sequence[tuple[bytes | str, bytes | str]] | None) -> bool:
    """A request header block with an empty field name, or more fields than any gRPC
    client sends (CVE-2019-9516 sends thousands of empty ones): never served."""
    fields = headers or ()
    return (
        not fields or len(fields) > MAX_REQUEST_HEADER_FIELDS or any(not name for name, _ in fields)
    )


def resets_in(frames: bytes | bytearray) -> int:
    """RST_STREAM frames in `frames`, whole frames as h2 queues them to send: the resets h2
    answers a peer's frames with by itself (DATA on a closed stream, say: CVE-2019-9514)."""
    count = 0
    pos = 0
    n = len(frames)
    while pos + 9 <= n:
        length = (frames[pos] << 16) | (frames[pos + 1] << 8) | frames[pos + 2]
        if frames[pos + 3] == _RST_STREAM:
            count += 1
        pos += 9 + length
    return count


def _offence(kind: int, flags: int, length: int) -> str | None:
    if kind == _RST_STREAM:
        return "rapid_reset"
    if kind == _PING:
        return None if flags & _ACK else "ping_flood"
    if kind == _SETTINGS:
        return None if flags & _ACK else "settings_flood"
    if kind == _DATA:
        return "empty_frames" if length == 0 and not flags & _END_STREAM else None
    if kind in (_HEADERS, _CONTINUATION):
        ends = _END_STREAM if kind == _HEADERS else _END_HEADERS
        return "empty_frames" if length == 0 and not flags & ends else None
    if kind == _PRIORITY:
        return "priority_flood"
    if kind > _LAST_KNOWN_TYPE:
        return "unknown_frames"
    return None
