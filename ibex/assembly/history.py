"""History that does not fit: keep the newest messages, count no more than the window.

What OpenAI's ``truncation: "auto"`` does: the oldest whole messages are left
out until directive, history, tools and reserves fit; the newest message is
always kept (when it cannot fit alone, the request is refused). Messages are
counted newest first and counting stops once the room is used up, so a 4 MiB
history costs about one window of counting, not 4 MiB.

A single long message is not counted whole either: `body_tokens` proves that
it cannot fit from a prefix. The escaped body of a prefix of a text is a
prefix of the text's escaped body, and the counter knows a cut in such a
prefix before which no continuation can count fewer tokens
(`TokenCounter.additive_cut`: a pre-tokeniser split for exact encodings; any
point for estimate_v1, which never decreases as a text grows), and the most
bytes one token can hold (`max_token_bytes`, 128 for cl100k_base and
o200k_base). A prefix of about six characters per token of room proves
natural text too long in one probe; the prefix doubles until proof or the
whole text, and the byte bound caps the whole at room x max_token_bytes.

Counts and escaped bodies computed here are not cached yet: they come back in
`HistoryFit` so the pipeline can cache them once the request is known to fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import msgspec

from ibex.assembly.output_format import Format
from ibex.assembly.structs import Message

#: First probe, in characters per token of room: above natural text's 3-5.
PROBE_CHARS_PER_TOKEN = 6
_PROBE_SLACK = 64

_V = TypeVar("_V")


class Counter(Protocol):
    """What the pipeline needs from a token counter (see ibex.assembly.tokens)."""

    estimate_kind: str
    max_token_bytes: int

    def count(self, text: str) -> int: ...

    def count_uncached(self, text: str) -> int: ...

    def peek(self, text: str) -> int | None: ...

    def remember(self, items: Sequence[tuple[str, int]]) -> None: ...

    def additive_cut(self, text: str) -> int: ...


class Uncached:
    """The cache half of `Counter` for a counter that keeps none: nothing is found or kept."""

    def peek(self, text: str) -> int | None:
        return None

    def remember(self, items: Sequence[tuple[str, int]]) -> None:
        pass


class _HeldMisses(Generic[_V]):
    """Reads of one cache by text: a miss is computed uncached and held in `held`."""

    __slots__ = ("compute", "held", "peek")

    def __init__(
        self,
        peek: Callable[[str], _V | None],
        compute: Callable[[str], _V],
        held: list[tuple[str, _V]],
    ) -> None:
        self.peek = peek
        self.compute = compute
        self.held = held

    def get(self, text: str) -> _V:
        value = self.peek(text)
        if value is None:
            value = self.compute(text)
            self.held.append((text, value))
        return value


class DeferredCache:
    """One request's reads of the token-count and escaped-body caches.

    What is not cached yet is computed here and held (`counts`, `bodies`); the
    entries reach the shared caches only at `commit`, once the request is known
    to fit, so a refused request leaves every cache as it was.
    """

    __slots__ = ("bodies", "body", "count", "counter", "counts", "fmt")

    def __init__(self, counter: Counter, fmt: Format) -> None:
        self.counter = counter
        self.fmt = fmt
        self.counts: list[tuple[str, int]] = []
        self.bodies: list[tuple[str, str]] = []
        #: The count of a text, held for the count cache when it was not cached.
        self.count = _HeldMisses(counter.peek, counter.count_uncached, self.counts).get
        #: The escaped body piece, held for the body cache when it was not cached.
        self.body = _HeldMisses(fmt.cached_body_piece, fmt.body_piece_uncached, self.bodies).get

    def with_nonce(self, piece: Callable[[str], str], nonce: str) -> int:
        """The count of `piece(nonce)`, a piece that carries the per-request nonce.

        A decimal nonce (what `formatter.new_nonce` makes) costs exactly what
        zeros of its width cost, in every family: digits pre-tokenise in runs of
        three from the start of the run, every 1- to 3-digit string is one token
        of cl100k_base and o200k_base, and estimate_v1 sees only the digit class
        (every nonce piece has a non-digit on both sides of the nonce). So the
        zeros' piece is counted once and cached. Any other nonce is new every
        request and is counted uncached, never cached.
        """
        if nonce.isdigit():
            return self.count(piece("0" * len(nonce)))
        return self.counter.count_uncached(piece(nonce))

    def commit(self) -> None:
        self.counter.remember(self.counts)
        self.fmt.remember_body_pieces(self.bodies)


class HistoryFit(msgspec.Struct, frozen=True, gc=False):
    """The newest messages that fit, and what the first left-out one needs at least."""

    kept: tuple[Message, ...]  # oldest first, as they are emitted
    tokens: int  # the history section as formatted (0 when nothing is kept)
    overflow: int  # 0 when all fit; else a lower bound of the first left-out message


def body_tokens(
    counter: Counter, fmt: Format, content: str, limit: int, deferred: DeferredCache | None = None
) -> tuple[int, bool]:
    """(n, exact) for `fmt`'s body piece of `content`: its count when it is at most `limit`.

    When the piece cannot fit, n > limit is its exact count or a proven lower
    bound (exact is False). The work is bounded by `limit`, not by the text:
    at most about 2 x limit x max_token_bytes characters are escaped and
    counted, typically 6 x limit. A piece that fits is held in `deferred` for the caches.
    """
    if limit < 0:
        return 0, False
    probe = PROBE_CHARS_PER_TOKEN * (limit + 1) + _PROBE_SLACK
    per_token = counter.max_token_bytes
    bound = 0
    while probe < len(content):
        head = fmt.escape_body(content[:probe])  # a prefix of the whole escaped body
        if per_token:
            bound = max(bound, -(-len(head.encode("utf-8", "surrogatepass")) // per_token))
            if bound > limit:
                return bound, False
        cut = counter.additive_cut(head)
        if cut:
            bound = max(bound, counter.count_uncached(head[:cut]))
            if bound > limit:
                return bound, False
        probe *= 2
    piece = fmt.cached_body_piece(content)
    cached_piece = piece is not None
    if piece is None:
        piece = fmt.body_piece_uncached(content)
    if per_token and len(piece) > limit:  # fewer characters than tokens? cheap to rule out
        bound = -(-len(piece.encode("utf-8", "surrogatepass")) // per_token)
        if bound > limit:
            return bound, False
    n = counter.peek(piece)
    cached_count = n is not None
    if n is None:
        n = counter.count_uncached(piece)
    if deferred is not None and n <= limit:
        if not cached_piece:
            deferred.bodies.append((content, piece))
        if not cached_count:
            deferred.counts.append((piece, n))
    return n, True


def _empty(m: Message) -> bool:
    # Whitespace-only content renders as an empty body (the formatter trims it).
    return not m.role and not m.content.strip()


def without_empty(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """The history without messages that have neither role nor content.

    Such a message says nothing, yet its markup would cost tokens: it is left
    out before counting, so it is neither rendered, nor counted, nor reported
    as dropped for budget. A message with only one of the two is kept.
    """
    for m in messages:
        if _empty(m):
            return tuple(m for m in messages if not _empty(m))
    return messages


def fit_history(
    counter: Counter, messages: Sequence[Message], nonce: str, room: int, deferred: DeferredCache
) -> HistoryFit:
    """The longest run of newest messages whose section (in `deferred.fmt`) fits `room` tokens.

    Counts newest first and stops at the first message that does not fit, so
    nothing older is ever counted. `kept` is empty when not even the newest
    message fits (the caller refuses the request).
    """
    if not messages:
        return HistoryFit((), 0, 0)
    fmt = deferred.fmt
    section = deferred.with_nonce(fmt.history_open, nonce) + deferred.count(fmt.history_close)
    close = deferred.count(fmt.message_close)
    message_open = fmt.message_open
    left = room - section
    used = 0
    first_kept = len(messages)
    overflow = 0
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        markup = deferred.count(message_open(msg.role)) + close
        limit = left - used - markup
        n, _ = body_tokens(counter, fmt, msg.content, limit, deferred)
        if n > limit:
            overflow = markup + n
            break
        used += markup + n
        first_kept = i
    kept = tuple(messages[first_kept:])
    return HistoryFit(kept, section + used if kept else 0, overflow)


def dropped_tokens(counter: Counter, dropped: Sequence[Message], ceiling: int, fmt: Format) -> int:
    """Tokens of the left-out messages in `fmt`, newest first: exact while the total stays
    within `ceiling`, else a lower bound above it (counting stops there). Nothing is cached."""
    total = 0
    close = counter.count_uncached(fmt.message_close)
    for msg in reversed(dropped):
        markup = counter.count_uncached(fmt.message_open(msg.role)) + close
        limit = ceiling - total - markup
        n, exact = body_tokens(counter, fmt, msg.content, limit)
        total += markup + n
        if not exact or total > ceiling:
            return max(total, ceiling + 1)
    return total
