"""Bounded work on memory answers (issue 11 items 3 and 8), at the decode and selection level.

- at most `limit` results become hits; the rest are never validated;
- content over the cap (UTF-8 bytes) is dropped and the hit flagged, and the
  pipeline excludes it as `failed` without scoring or counting it;
- JSON nested past msgspec's depth limit, from any source, is a source error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ibex.assembly.candidates import SearchFilter, rank_search, select
from ibex.assembly.lru import ENTRY_OVERHEAD
from ibex.assembly.structs import AssemblyOptions, AssemblyRequest, MemoryHit
from ibex.config import Settings, load_settings
from ibex.sources import memory_schema
from ibex.sources.base import SourceError
from ibex.sources.local_file import LocalFileError, LocalFileSource
from ibex.sources.memory_http import DEFAULT_MAX_RESPONSE_BYTES
from ibex.sources.memory_schema import DEFAULT_MAX_CONTENT_BYTES, decode_hits
from ibex.sources.redis_directive import decode_directive
from ibex.testing.samples import AGENT, ORG

NOW = 1_760_000_000.0
NESTED = b"[" * 100_000


def _mid(i: int) -> str:
    """Memory ids are UUIDs (contract section 2); item i gets one that names it."""
    return f"00000000-0000-4000-8000-{i:012d}"


SMALL, BIG = _mid(901), _mid(902)


def _result(i: int, content: str = "text", **memory: Any) -> dict[str, Any]:
    m = {
        "id": _mid(i),
        "org_id": ORG,
        "agent_id": AGENT,
        "content": content,
        "category": "factual",
        "confidence": 0.5,
        **memory,
    }
    return {"memory": m, "similarity": 0.5, "rank": i + 1, "source": "vector"}


def _body(*results: dict[str, Any]) -> bytes:
    return json.dumps({"data": {"results": list(results)}}, ensure_ascii=False).encode()


def test_only_the_requested_number_of_results_become_hits() -> None:
    results = [_result(i) for i in range(50)]
    results[30]["memory"]["confidence"] = 7.0  # invalid, but past the limit: never looked at
    hits = decode_hits(_body(*results), "hot", limit=20)
    assert [h.memory_id for h in hits] == [_mid(i) for i in range(20)]
    assert decode_hits(_body(*results), "hot", limit=0) == []


def test_a_large_answer_is_decoded_only_up_to_the_limit() -> None:
    results = [_result(i, "x" * 100) for i in range(2000)]  # about 400 KiB
    results[1500]["memory"]["confidence"] = 7.0  # past the limit: never looked at
    body = _body(*results)
    assert len(body) > 256 * 1024
    hits = decode_hits(body, "cold", limit=20)
    assert [h.memory_id for h in hits] == [_mid(i) for i in range(20)]
    results[5]["memory"]["confidence"] = 7.0
    with pytest.raises(SourceError, match=r"\$\.data\.results\[5\]\.memory\.confidence"):
        decode_hits(_body(*results), "cold", limit=20)


def test_a_bad_item_within_the_limit_still_fails_the_answer_naming_its_path() -> None:
    results = [_result(i) for i in range(5)]
    results[2]["memory"]["confidence"] = 7.0
    with pytest.raises(SourceError, match=r"\$\.data\.results\[2\]\.memory\.confidence"):
        decode_hits(_body(*results), "cold", limit=5)
    results[2] = _result(2)
    del results[2]["memory"]["id"]
    with pytest.raises(SourceError, match=r"missing required field `id`.*results\[2\]"):
        decode_hits(_body(*results), "cold", limit=5)


@pytest.mark.parametrize(
    ("content", "oversized"),
    [
        ("a" * 100, False),
        ("a" * 101, True),
        ("é" * 50, False),  # 100 bytes in UTF-8
        ("é" * 50 + "a", True),
        ("😀" * 25, False),  # 4 bytes each
        ("😀" * 25 + "a", True),
    ],
)
def test_content_cap_is_in_utf8_bytes(content: str, oversized: bool) -> None:
    (hit,) = decode_hits(_body(_result(0, content)), "hot", limit=1, max_content_bytes=100)
    assert hit.oversized is oversized
    assert hit.content == ("" if oversized else content)
    assert hit.memory_id == _mid(0)


def test_a_huge_memory_is_flagged_and_its_neighbours_kept() -> None:
    body = _body(_result(0), _result(1, "x" * 4_000_000), _result(2))
    hits = decode_hits(body, "hot", limit=20)
    assert [(h.memory_id, h.oversized, len(h.content)) for h in hits] == [
        (_mid(0), False, 4),
        (_mid(1), True, 0),
        (_mid(2), False, 4),
    ]


@pytest.mark.parametrize(
    "body",
    [
        NESTED,
        b'{"data": {"results": []}, "extra": ' + NESTED,
        b'{"data": {"results": [' + NESTED,
        b'{"data": {"results": [{"memory": {"tags": ' + NESTED,
    ],
    ids=["top", "ignored key", "inside results", "inside a memory"],
)
def test_deeply_nested_json_is_a_source_error(body: bytes) -> None:
    with pytest.raises(SourceError, match=r"^hot: (invalid JSON|bad response shape)"):
        decode_hits(body, "hot", limit=20)


@pytest.mark.parametrize(
    "raw",
    [
        NESTED,
        b'{"v": 1, "content": "x", "extra": ' + NESTED,
        b'{"v": ' + NESTED,
        b'{"content": 5, "v": ' + NESTED,
    ],
    ids=["top", "ignored key", "version", "version on the error path"],
)
def test_deeply_nested_directive_is_a_source_error(raw: bytes) -> None:
    with pytest.raises(SourceError, match=r"^directive value: malformed JSON"):
        decode_directive(raw)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("mem.json", NESTED),
        ("mem.json", b'{"version": 1, "agents": [], "x": ' + NESTED),
        ("mem.json", b'{"version": 1, "agents": [{"memories": [{"tags": ' + NESTED),
        ("mem.jsonl", b'{"org_id": "o", "agent_id": "a", "memories": ' + NESTED + b"\n"),
    ],
)
def test_deeply_nested_local_file_is_a_load_error(tmp_path: Path, name: str, data: bytes) -> None:
    # The local file's types are closed (unknown keys refused), so msgspec stops
    # at the first wrong shape; the RecursionError guard is there all the same.
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(LocalFileError, match=name.replace(".", r"\.")):
        LocalFileSource.load(path)


async def test_local_file_applies_the_content_cap(tmp_path: Path) -> None:
    agent = {
        "org_id": ORG,
        "agent_id": AGENT,
        "memories": [
            {"id": SMALL, "content": "deploy billing", "category": "factual", "confidence": 0.9},
            {"id": BIG, "content": "deploy " * 40, "category": "factual", "confidence": 0.8},
        ],
    }
    path = tmp_path / "mem.json"
    path.write_text(json.dumps({"version": 1, "agents": [agent]}))
    source = LocalFileSource.load(path, max_content_bytes=100)
    hot = await source.hot(ORG, AGENT, limit=10, min_confidence=0.0)
    assert [(h.memory_id, h.oversized, h.content) for h in hot] == [
        (SMALL, False, "deploy billing"),
        (BIG, True, ""),
    ]
    cold = await source.cold(ORG, AGENT, "deploy", limit=10, min_confidence=0.0)
    assert {h.memory_id: h.oversized for h in cold} == {SMALL: False, BIG: True}
    assert len(await source.hot(ORG, AGENT, limit=1, min_confidence=0.0)) == 1


def _hit(mid: str, *, oversized: bool = False, branch: str = "hot", org: str = ORG) -> MemoryHit:
    return MemoryHit(
        memory_id=mid,
        org_id=org,
        agent_id=AGENT,
        content="" if oversized else "The billing service deploys from main.",
        category="factual",
        confidence=0.9,
        similarity=0.9,
        rank=1,
        branch=branch,  # type: ignore[arg-type]
        oversized=oversized,
    )


def test_an_oversized_hit_is_excluded_failed_once_and_never_scored() -> None:
    request = AssemblyRequest(
        agent_id=AGENT, org_id=ORG, query="deploy", model="gpt-4o", options=AssemblyOptions()
    )
    hot = [_hit("big", oversized=True), _hit("ok")]
    cold = [_hit("big", oversized=True, branch="cold"), _hit("other", org="someone-else")]
    selection = select(request, hot, cold, NOW)
    ranked, excluded = selection.candidates, selection.excluded
    assert [m.memory_id for m in ranked] == ["ok"]
    # Another tenant's hit is only counted, never named (issue 11 item 7).
    assert sorted((m.memory_id, m.exclusion) for m in excluded) == [("big", "failed")]
    assert selection.tenant_filtered == 1
    big = next(m for m in excluded if m.memory_id == "big")
    assert big.composite_score == 0.0


def test_search_never_returns_an_oversized_hit() -> None:
    flt = SearchFilter(org_id=ORG, agent_id=AGENT, limit=10)
    found = rank_search([_hit("big", oversized=True), _hit("ok")], flt, NOW)
    assert [h.hit.memory_id for h in found.hits] == ["ok"]
    assert found.own_candidates == 2


def test_settings_for_the_caps() -> None:
    assert Settings().memory.max_content_bytes == DEFAULT_MAX_CONTENT_BYTES == 32 * 1024
    assert Settings().memory.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 4 * 1024 * 1024
    s = load_settings(
        {
            "IBEX_CONTEXT_MEMORY_MAX_CONTENT_BYTES": "1000",
            "IBEX_CONTEXT_MEMORY_MAX_RESPONSE_BYTES": "2048",
        }
    )
    assert (s.memory.max_content_bytes, s.memory.max_response_bytes) == (1000, 2048)
    with pytest.raises(Exception, match="IBEX_CONTEXT_MEMORY_MAX_CONTENT_BYTES"):
        load_settings({"IBEX_CONTEXT_MEMORY_MAX_CONTENT_BYTES": "0"})
    with pytest.raises(Exception, match="IBEX_CONTEXT_MEMORY_MAX_RESPONSE_BYTES"):
        load_settings({"IBEX_CONTEXT_MEMORY_MAX_RESPONSE_BYTES": "lots"})


def test_remembered_valid_timestamps_change_no_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid created_at values are remembered (bounded) so repeats skip the parse; an
    invalid one is still refused after valid ones were seen, and the memory stays bounded."""
    monkeypatch.setattr(memory_schema, "_VALID_TIMESTAMPS", set())
    monkeypatch.setattr(memory_schema, "_VALID_TIMESTAMPS_MAX", 3)
    good = "2025-10-26T08:30:00Z"
    for _ in range(2):
        assert decode_hits(_body(_result(0, created_at=good)), "hot")[0].created_at == good
    assert good in memory_schema._VALID_TIMESTAMPS
    with pytest.raises(SourceError):  # matches the pattern, not a real date
        decode_hits(_body(_result(0, created_at="2025-02-30T08:30:00Z")), "hot")
    assert "2025-02-30T08:30:00Z" not in memory_schema._VALID_TIMESTAMPS
    for day in range(1, 10):
        decode_hits(_body(_result(0, created_at=f"2025-10-0{day}T08:30:00Z")), "hot")
    assert len(memory_schema._VALID_TIMESTAMPS) <= 3


@pytest.mark.parametrize("branch", ["hot", "cold"])
def test_hits_carry_the_branch_that_fetched_them(branch: str) -> None:
    hits = decode_hits(_body(_result(0), _result(1)), branch, limit=5)  # type: ignore[arg-type]
    assert [h.branch for h in hits] == [branch, branch]


def test_malformed_json_is_named_with_its_branch() -> None:
    with pytest.raises(SourceError, match=r"^hot: invalid JSON: JSON is malformed"):
        decode_hits(b"{nope", "hot", limit=5)


def test_an_item_that_is_no_object_is_named_by_its_position() -> None:
    """msgspec names no path for an error at an item's root; the position is added."""
    body = json.dumps({"data": {"results": [_result(0), 5, _result(2)]}}).encode()
    with pytest.raises(SourceError) as info:
        decode_hits(body, "cold", limit=5)
    assert str(info.value) == (
        "cold: bad response shape: Expected `object`, got `int` - at `$.data.results[1]`"
    )


def test_branch_details_are_cut_to_160_characters() -> None:
    assert memory_schema._detail("x" * 160) == "x" * 160
    assert memory_schema._detail("x" * 161) == "x" * 157 + "..."


def test_content_over_counts_utf8_bytes() -> None:
    assert memory_schema.content_over("a" * 101, 100)
    assert not memory_schema.content_over("é" * 50, 100)  # 100 bytes
    assert memory_schema.content_over("é" * 51, 100)
    assert not memory_schema.content_over("😀" * 25, 100)  # 4 bytes each


def test_a_hit_keeps_every_optional_field_of_its_memory() -> None:
    (hit,) = decode_hits(
        _body(_result(0, usefulness=0.25, access_count=7, tags=["ops", "deploy"])), "hot", limit=1
    )
    assert (hit.usefulness, hit.access_count, hit.tags) == (0.25, 7, ("ops", "deploy"))
    (bare,) = decode_hits(_body(_result(0)), "hot", limit=1)
    assert (bare.usefulness, bare.access_count, bare.tags) == (None, None, ())


@pytest.mark.parametrize(
    ("created_at", "why"),
    [
        ("yesterday", "created_at must be an RFC 3339 timestamp"),
        ("2025-02-30T08:30:00Z", "created_at is not a valid date-time"),
    ],
)
def test_a_bad_timestamp_says_what_is_wrong(created_at: str, why: str) -> None:
    with pytest.raises(SourceError) as info:
        decode_hits(_body(_result(0), _result(1, created_at=created_at)), "cold", limit=5)
    assert f"bad response shape: {why} - at `$.data.results[1].memory`" in str(info.value)


def test_the_timestamp_memo_keeps_short_values_and_empties_when_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_schema, "_VALID_TIMESTAMPS", set())
    monkeypatch.setattr(memory_schema, "_VALID_TIMESTAMPS_MAX", 3)
    longest = "2025-01-01T00:00:00." + "1" * 43 + "Z"  # 64 characters: remembered
    too_long = "2025-01-01T00:00:00." + "1" * 44 + "Z"  # 65: valid, never remembered
    for value in (longest, too_long):
        decode_hits(_body(_result(0, created_at=value)), "hot", limit=1)
    assert {longest} == memory_schema._VALID_TIMESTAMPS
    days = [f"2025-10-0{d}T08:30:00Z" for d in (1, 2, 3)]
    for value in days:
        decode_hits(_body(_result(0, created_at=value)), "hot", limit=1)
    # Full at 3 (the longest and two days): the third day emptied it first.
    assert {days[2]} == memory_schema._VALID_TIMESTAMPS


@pytest.mark.parametrize(
    "bad_id",
    [
        "not-a-uuid",
        "m1",
        "1" * 32,  # the right digits without hyphens
        "{" + _mid(1) + "}",
        "urn:uuid:" + _mid(1),
        _mid(1) + "\n",
        " " + _mid(1),
        _mid(1)[:-1] + "g",
        _mid(1)[:-1] + "\u0661",  # ARABIC-INDIC DIGIT ONE: a digit, not a hex digit
        _mid(1).replace("-", "_"),
    ],
)
def test_a_memory_id_that_is_not_a_canonical_uuid_fails_the_answer(bad_id: str) -> None:
    results = [_result(0), _result(1, id=bad_id), _result(2)]
    with pytest.raises(SourceError, match=r"canonical UUID - at `\$\.data\.results\[1\]\.memory`"):
        decode_hits(_body(*results), "hot", limit=20)
    # Past the limit the item is never looked at, as for any other malformed item.
    assert len(decode_hits(_body(*results), "hot", limit=1)) == 1


def test_canonical_uuid_ids_of_either_case_are_kept_verbatim() -> None:
    ids = ["6ba7b810-9dad-11d1-80b4-00c04fd430c8", "6BA7B811-9DAD-11D1-80B4-00C04FD430C8"]
    body = _body(_result(0, id=ids[0]), _result(1, id=ids[1]))
    assert [h.memory_id for h in decode_hits(body, "cold", limit=20)] == ids


def test_the_memory_id_memo_is_bounded_and_holds_only_valid_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_schema, "_VALID_IDS", set())
    monkeypatch.setattr(memory_schema, "_VALID_IDS_MAX", 3)
    memory_schema.check_memory_id(_mid(1))
    assert _mid(1) in memory_schema._VALID_IDS
    with pytest.raises(ValueError, match="canonical UUID"):
        memory_schema.check_memory_id("not-a-uuid")
    assert "not-a-uuid" not in memory_schema._VALID_IDS
    for i in range(10):
        memory_schema.check_memory_id(_mid(100 + i))
        assert len(memory_schema._VALID_IDS) <= 3
    with pytest.raises(ValueError, match="canonical UUID"):  # a memo never lets one through
        memory_schema.check_memory_id(_mid(1) + "0")


# -- decoded answers cache ---------------------------------------------------------------------


def test_a_byte_identical_answer_is_decoded_once_and_gives_the_same_hits() -> None:
    cache = memory_schema.DecodedAnswers()
    body = _body(*(_result(i) for i in range(5)))
    first = cache.decode(body, "hot", limit=20)
    again = cache.decode(bytes(bytearray(body)), "hot", limit=20)  # a new bytes object
    assert again == first == decode_hits(body, "hot", limit=20)
    info = cache.info()
    assert (info.hits, info.misses, info.entries) == (1, 1, 1)
    # The branch and the limit are part of what an answer decodes to.
    assert [h.branch for h in cache.decode(body, "cold", limit=20)] == ["cold"] * 5
    assert len(cache.decode(body, "hot", limit=2)) == 2
    assert cache.info().entries == 3
    # Another answer (one byte differs) is decoded afresh.
    other = body.replace(b'"confidence": 0.5', b'"confidence": 0.6', 1)
    assert cache.decode(other, "hot", limit=20)[0].confidence == 0.6


def test_a_bad_answer_is_never_stored_and_fails_every_time() -> None:
    cache = memory_schema.DecodedAnswers()
    bad = _body(_result(0, confidence=7.0))
    for _ in range(2):
        with pytest.raises(SourceError, match="bad response shape"):
            cache.decode(bad, "hot", limit=20)
    assert cache.info().entries == 0


def test_the_decoded_answers_cache_is_bounded_in_bytes() -> None:
    """Each entry counts its body, its hits' contents and `HIT_BYTES` per hit; the least
    recently used answers go first, and one answer never takes more than 1/16 of it."""
    cache = memory_schema.DecodedAnswers(max_bytes=256 * 1024)
    bodies = [_body(*(_result(i, "x" * 400) for i in range(k, k + 4))) for k in range(100)]
    for body in bodies:
        cache.decode(body, "hot", limit=20)
    info = cache.info()
    one = memory_schema._answer_size((bodies[0], "hot", 20), tuple(decode_hits(bodies[0], "hot")))
    assert one > len(bodies[0]) + 4 * (400 + memory_schema.HIT_BYTES)
    # What CPython holds for the body and each content, plus the map's node (ByteLRU's rule).
    assert one == (
        sys.getsizeof(bodies[0])
        + 4 * (sys.getsizeof("x" * 400) + memory_schema.HIT_BYTES)
        + ENTRY_OVERHEAD
    )
    assert info.entries == (256 * 1024) // one and info.bytes <= 256 * 1024
    cache.decode(bodies[-1], "hot", limit=20)  # the newest is still there
    cache.decode(bodies[0], "hot", limit=20)  # the oldest is gone
    assert (cache.info().hits, cache.info().misses) == (1, 101)
    big = _body(*(_result(i, "y" * 4000) for i in range(4)))  # over 16 KiB counted
    cache.decode(big, "hot", limit=20)
    assert cache.decode(big, "hot", limit=20) and cache.info().hits == 1


def test_the_cache_decodes_with_the_sources_content_cap() -> None:
    """A content over the source's `max_content_bytes` is flagged, cached or not."""
    cache = memory_schema.DecodedAnswers()
    body = _body(_result(0, "a" * 101), _result(1, "a" * 100))
    for _ in range(2):
        hits = cache.decode(body, "hot", limit=20, max_content_bytes=100)
        assert [(h.oversized, len(h.content)) for h in hits] == [(True, 0), (False, 100)]
