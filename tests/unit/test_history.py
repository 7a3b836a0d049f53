"""ibex.assembly.history: the newest run that fits, body_tokens' exact-or-bound contract, staging
for the cache, and dropped_tokens (exact while the left-out messages fit the ceiling, a bound
past it)."""

from __future__ import annotations

import pytest

from ibex.assembly import xml_format as fmt
from ibex.assembly.history import (
    DeferredCache,
    HistoryFit,
    body_tokens,
    dropped_tokens,
    fit_history,
)
from ibex.assembly.structs import Message
from ibex.assembly.tokens import TokenCounter, Tokenizers

NONCE = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
MESSAGES = [
    Message("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "wait for green CI. " * 20)
    for i in range(5)
]


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    return Tokenizers(None, 4096)


@pytest.fixture(scope="module")
def counter(tokenizers: Tokenizers) -> TokenCounter:
    return tokenizers.counter("o200k_base", "o200k_base")


@pytest.fixture(scope="module")
def exact(tokenizers: Tokenizers) -> int:
    """tiktoken's count of the messages as the history section renders them."""
    pieces = fmt.history_section(MESSAGES, NONCE)[1:-1]  # without the section's tags
    return len(tokenizers.encoding("o200k_base").encode_ordinary("".join(pieces)))


def test_exact_when_the_messages_fit(counter: TokenCounter, exact: int) -> None:
    assert dropped_tokens(counter, MESSAGES, 10**9, fmt.XML_TAGS) == exact
    assert dropped_tokens(counter, MESSAGES, exact, fmt.XML_TAGS) == exact  # exactly at the ceiling


@pytest.mark.parametrize("short", [1, 40, 200])
def test_a_bound_above_the_ceiling_when_they_do_not(
    counter: TokenCounter, exact: int, short: int
) -> None:
    ceiling = exact - short
    n = dropped_tokens(counter, MESSAGES, ceiling, fmt.XML_TAGS)
    assert ceiling < n <= exact


def test_nothing_dropped_costs_nothing(counter: TokenCounter) -> None:
    assert dropped_tokens(counter, [], 100, fmt.XML_TAGS) == 0


class Tally:
    """A counter that adds up the tokens it is asked to count: the work done."""

    def __init__(self, inner: TokenCounter) -> None:
        self.inner = inner
        self.estimate_kind = inner.estimate_kind
        self.max_token_bytes = inner.max_token_bytes
        self.counted = 0

    def count_uncached(self, text: str) -> int:
        n = self.inner.count_uncached(text)
        self.counted += n
        return n

    def count(self, text: str) -> int:
        return self.count_uncached(text)

    def peek(self, text: str) -> int | None:
        return None

    def remember(self, items: object) -> None:
        pass

    def additive_cut(self, text: str) -> int:
        return self.inner.additive_cut(text)


def test_counting_stops_past_the_ceiling(counter: TokenCounter) -> None:
    """docs/assembly.md: past the ceiling a lower bound, "counting stops there". A newest
    message of 3/4 of the ceiling and an older one of 1 MB cost about one ceiling of
    counting, not the older message's size nor the ceiling again."""
    ceiling = 1000
    newest = Message("user", "wait for green CI. " * 150)  # 751 tokens
    oldest = Message("assistant", "wait for green CI. " * 55_000)  # 1 MB, ~275,000 tokens
    tally = Tally(counter)
    n = dropped_tokens(tally, [oldest, newest], ceiling, fmt.XML_TAGS)
    assert n > ceiling
    assert tally.counted <= 1.5 * ceiling


def test_a_message_with_an_empty_body_is_exact_at_the_ceiling_and_bounded_below_it(
    counter: TokenCounter,
) -> None:
    """Only its markup: exact when the ceiling holds just that, and never more than that
    (a lower bound, not a guess) when the ceiling is below it."""
    empty = [Message("user", "")]
    markup = counter.count_uncached(fmt.XML_TAGS.message_open("user")) + counter.count_uncached(
        fmt.XML_TAGS.message_close
    )
    assert dropped_tokens(counter, empty, markup, fmt.XML_TAGS) == markup
    assert dropped_tokens(counter, empty, 0, fmt.XML_TAGS) == markup


@pytest.mark.parametrize("limit", [3, 9])
def test_a_short_body_within_a_small_limit_is_counted_exactly(
    counter: TokenCounter, limit: int
) -> None:
    """body_tokens' contract: a piece that fits is its exact count, whatever the limit."""
    piece = fmt.XML_TAGS.body_piece_uncached("ok")
    assert counter.count_uncached(piece) <= 3
    n, exact = body_tokens(counter, fmt.XML_TAGS, "ok", limit)
    assert exact and n == counter.count_uncached(piece)


class ByteRule:
    """A counter with a simple exact rule: ceil(UTF-8 bytes / `per`) tokens. It never falls
    as a text grows (any cut is additive), and no token holds more than `max_token_bytes`
    when that is at least `per` (0: no byte bound). Small enough to compare body_tokens
    with the true count everywhere."""

    estimate_kind = "byte_rule"

    def __init__(self, per: int, max_token_bytes: int) -> None:
        self.per = per
        self.max_token_bytes = max_token_bytes

    def count_uncached(self, text: str) -> int:
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.per)

    count = count_uncached

    def peek(self, text: str) -> int | None:
        return None

    def remember(self, items: object) -> None:
        pass

    def additive_cut(self, text: str) -> int:
        return len(text)


@pytest.mark.parametrize(
    ("per", "max_token_bytes"),
    [(2, 2), (2, 0), (2, 128), (7, 128)],  # 0: no byte bound, prefixes only
)
def test_body_tokens_is_the_exact_count_when_it_fits_else_a_bound_above_the_limit(
    per: int, max_token_bytes: int
) -> None:
    """body_tokens' contract, against the true count: a piece that fits is its exact count;
    one that does not is n > limit, an int, never above the true count, and exact only if
    it is the true count. Lengths cross the first probe (6 x (limit + 1) + 64), and the
    limits reach where one probe's bound can equal the limit."""
    counter = ByteRule(per, max_token_bytes)
    for text in ("ab <c> & d", "é中😀x", "plain words "):
        for length in range(0, 640, 9):
            content = (text * (length // len(text) + 1))[:length]
            true = counter.count_uncached(fmt.XML_TAGS.body_piece_uncached(content))
            for limit in (*range(0, 24), *range(68, 78)):
                n, exact = body_tokens(counter, fmt.XML_TAGS, content, limit)
                assert isinstance(n, int)
                if true <= limit:
                    assert (n, exact) == (true, True), (content, limit)
                else:
                    assert limit < n <= true, (content, limit)
                    assert n == true or not exact, (content, limit)


def test_what_fits_is_staged_once_and_what_is_cached_is_not_staged_again(
    tokenizers: Tokenizers,
) -> None:
    """The module's rule: counts and bodies computed during a request are deferred, cached
    when it fits (`commit`), and a later request finds them cached and stages nothing."""
    counter = Tokenizers(None, 4096).counter("o200k_base", "o200k_base")  # a fresh cache
    xml = fmt.XmlTagFormat()
    content = "a history turn that fits exactly"
    piece = xml.body_piece_uncached(content)
    n = counter.count_uncached(piece)
    deferred = DeferredCache(counter, xml)
    assert body_tokens(counter, xml, content, n, deferred) == (n, True)  # fits exactly
    assert deferred.bodies == [(content, piece)] and deferred.counts == [(piece, n)]
    assert deferred.body(content) == piece and deferred.count(piece) == n  # uncached still
    deferred.commit()
    again = DeferredCache(counter, xml)
    assert body_tokens(counter, xml, content, n, again) == (n, True)
    assert again.body(content) == piece and again.count(piece) == n
    assert again.bodies == [] and again.counts == []
    over = DeferredCache(counter, xml)
    assert body_tokens(counter, xml, content + " and then some", n, over)[0] > n
    assert over.bodies == [] and over.counts == []  # what does not fit is not deferred


def test_fit_history_keeps_the_newest_run_that_fits_the_room_exactly() -> None:
    """The longest run of newest messages whose section fits `room`: at the section's exact
    size all are kept (overflow 0), one token less drops the oldest and reports at least
    what it needs; the bodies of what was counted are deferred for the cache."""
    counter = Tokenizers(None, 4096).counter("o200k_base", "o200k_base")  # a fresh cache
    xml = fmt.XmlTagFormat()
    assert fit_history(counter, [], NONCE, 100, DeferredCache(counter, xml)) == HistoryFit((), 0, 0)
    section = len(
        Tokenizers(None, 4096)
        .encoding("o200k_base")
        .encode_ordinary("".join(fmt.XmlTagFormat().history_section(MESSAGES, NONCE)))
    )
    deferred = DeferredCache(counter, xml)
    fit = fit_history(counter, MESSAGES, NONCE, section, deferred)
    assert fit == HistoryFit(tuple(MESSAGES), section, 0)
    assert {text for text, _ in deferred.bodies} == {m.content for m in MESSAGES}
    short = fit_history(counter, MESSAGES, NONCE, section - 1, DeferredCache(counter, xml))
    assert short.kept == tuple(MESSAGES[1:])
    assert short.tokens <= section - 1 and short.overflow > 0
    none = fit_history(counter, MESSAGES, NONCE, 20, DeferredCache(counter, xml))
    assert none.kept == () and none.tokens == 0 and none.overflow > 0
