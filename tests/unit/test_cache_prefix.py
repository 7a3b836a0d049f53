"""A context the provider can cache: each turn starts with the previous turn's stable part.

A short replay of the cache benchmark (benchmarks/cache_prefix.py): one
conversation through two workers in round robin. With a shared nonce key and
a session id, every turn's context starts, byte for byte, with the previous
turn's directive, safety sentence and history, and the provider-counted
cached prefix (from 1,024 tokens, in 128-token steps) covers at least 90 % of
those tokens. In the `cache` section order (IBEX_CONTEXT_SECTION_ORDER) the
tools come before the history and are part of that prefix too, so more of
every turn is cached and the input costs less than in the `seed` order on the
same conversation. Without the key every assembly draws its own nonce and
nothing is shared past the directive's opening tag.
"""

from __future__ import annotations

import itertools
import re

import pytest

from benchmarks import cache_prefix as bench
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.tokens import Tokenizers

TURNS = 5


@pytest.fixture(scope="module")
def static() -> tuple[Catalog, Tokenizers]:
    tokenizers = Tokenizers(None, 65536)
    tokenizers.preload([bench.ENCODING])
    return load_catalog(), tokenizers


def _stable(text: str) -> str:
    """Directive, safety sentence and the history messages (the history section still open)."""
    ends = [i for i in (text.find("</history>\n"), text.find("<memories ")) if i >= 0]
    return text[: min(ends)]


def _nonces(text: str) -> set[str]:
    return set(re.findall(r'nonce="([0-9]+)"', text))


def test_cached_prefix_numbers_follow_the_provider_rule() -> None:
    assert [bench.cached_tokens(n) for n in (0, 1023, 1024, 1151, 1152, 5000)] == [
        0,
        0,
        1024,
        1024,
        1152,
        4992,
    ]
    assert bench.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert bench.common_prefix([], [1]) == 0


async def test_with_the_key_each_turn_starts_with_the_previous_turns_stable_part(
    static: tuple[Catalog, Tokenizers],
) -> None:
    catalog, tokenizers = static
    source = bench.StandIn(seed=7)
    pool = bench.workers(catalog, tokenizers, source, bench.BENCH_KEY)
    turns, texts = await bench.replay_conversation(pool, tokenizers, seed=7, turns=TURNS)
    # Both workers wrote the same nonce on every turn of the session.
    assert len(set().union(*map(_nonces, texts))) == 1
    for prev, cur in itertools.pairwise(texts):
        stable = _stable(prev)
        assert "<safety" in stable and "<directive" in stable
        assert cur.startswith(stable)
    for t in turns[1:]:
        assert t.coverage_without_tools >= 0.9, t
        assert t.cached_tokens >= bench.CACHE_MIN_TOKENS
    # Later turns carry the earlier history: the stable part grows.
    assert turns[-1].stable_tokens > turns[1].stable_tokens


async def test_without_the_key_no_prefix_is_shared(static: tuple[Catalog, Tokenizers]) -> None:
    catalog, tokenizers = static
    source = bench.StandIn(seed=7)
    pool = bench.workers(catalog, tokenizers, source, None)
    turns, texts = await bench.replay_conversation(pool, tokenizers, seed=7, turns=3)
    assert len(set().union(*map(_nonces, texts))) == 3  # a fresh nonce per assembly
    for prev, cur in itertools.pairwise(texts):
        assert not cur.startswith(_stable(prev))
    assert all(t.cached_tokens == 0 and t.coverage == 0.0 for t in turns)
    assert all(t.common_prefix_tokens < 10 for t in turns)


async def test_the_cache_order_also_caches_the_tools_and_costs_less(
    static: tuple[Catalog, Tokenizers],
) -> None:
    catalog, tokenizers = static
    replays = {}
    for order in ("seed", "cache"):
        pool = bench.workers(catalog, tokenizers, bench.StandIn(seed=7), bench.BENCH_KEY, order)
        replays[order] = await bench.replay_conversation(pool, tokenizers, seed=7, turns=TURNS)
    (seed, seed_texts), (cache, texts) = replays["seed"], replays["cache"]
    for prev, cur in itertools.pairwise(texts):
        stable = _stable(prev)
        assert stable.index("<directive") < stable.index("<tools") < stable.index("<safety")
        assert cur.startswith(stable)
    for text in seed_texts:
        assert "<tools" not in _stable(text)  # the seed order's tools follow the memories
    # The same sections, so the same size; the cache order's prefix reaches the tools.
    assert [t.context_tokens for t in cache] == [t.context_tokens for t in seed]
    for s, c in zip(seed[1:], cache[1:], strict=True):
        assert c.cached_tokens > s.cached_tokens, (s, c)
        assert c.prefix_coverage >= 0.99, c  # all of the stable part but the history's close
        assert c.coverage_without_tools == 1.0, c
        assert c.coverage >= 0.9, c  # the provider's 128-token step leaves 0-127 tokens out
    price = {
        order: bench.summarise([turns], bench.PRICE_INPUT, bench.PRICE_CACHED)
        for order, (turns, _) in replays.items()
    }
    assert price["cache"]["cost_usd_with_cache"] < price["seed"]["cost_usd_with_cache"]  # type: ignore[operator]


async def test_in_the_cache_order_only_the_step_and_the_history_close_are_left_out(
    static: tuple[Catalog, Tokenizers],
) -> None:
    """What the cache order misses of the previous turn's stable part is not the assembly's.

    The assembly leaves out only the previous turn's `</history>` line (the next
    turn's new messages come before it; turn 2 follows a turn without history);
    the rest of the miss is the provider's 128-token step, 0-127 tokens. So the
    coverage is at least (S - close - 127) / S for a stable part of S tokens,
    and `step_bound_tokens` is the S from which that is 95 % or more.
    """
    catalog, tokenizers = static
    close = len(tokenizers.encoding(bench.ENCODING).encode_ordinary("</history>\n"))
    pool = bench.workers(catalog, tokenizers, bench.StandIn(seed=7), bench.BENCH_KEY, "cache")
    turns, _ = await bench.replay_conversation(pool, tokenizers, seed=7, turns=TURNS)
    assert turns[1].left_by_order == 0
    assert {t.left_by_order for t in turns[2:]} == {close}
    for prev, t in itertools.pairwise(turns):
        assert 0 <= t.left_by_step < bench.CACHE_STEP_TOKENS, t
        assert prev.stable_tokens - t.left_by_order - t.left_by_step == t.cached_tokens, t
        assert t.coverage >= (prev.stable_tokens - close - 127) / prev.stable_tokens, t
        assert t.prev_stable_tokens == prev.stable_tokens, t
    # Over the conversation: every previous stable token served, over all of them.
    summary = bench.summarise([turns], bench.PRICE_INPUT, bench.PRICE_CACHED)
    served = sum(t.cached_tokens for t in turns[1:])
    assert summary["coverage_all_from_turn_2"] == round(
        served / sum(p.stable_tokens for p in turns[:-1]), 4
    )
    assert bench.step_bound_tokens(close, 0.95) == (close + 127) * 20
    assert bench.step_bound_tokens(0, 0.5) == 254
