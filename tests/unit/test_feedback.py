"""RecordMemoryFeedback's pure parts and its sender: validation, the idempotency key,
strict decoding of the memory service's answer, the one same-key retry, and the
embedded sample backend's in-memory usefulness."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any

import pytest
import trio
import trio.testing

from ibex.assembly.feedback_rules import (
    MAX_FEEDBACK_IDS,
    Feedback,
    ScoreUpdate,
    idempotency_key,
    validate_feedback,
)
from ibex.errors import InputError, SourceError
from ibex.sources.feedback_sender import (
    FeedbackRejected,
    FeedbackRetryable,
    _detail,
    decode_updates,
    send_feedback,
)
from ibex.sources.local_file import SAMPLE_AGENT_ID, SAMPLE_ORG_ID, LocalFileSource

ORG = "00000000-0000-4000-8000-000000000001"
OTHER_ORG = "00000000-0000-4000-8000-000000000002"
M1 = "10000000-0000-4000-8000-000000000001"
M2 = "10000000-0000-4000-8000-000000000002"
M3 = "10000000-0000-4000-8000-000000000003"
OTHER_ORGS_MEMORY = "30000000-0000-4000-8000-000000000001"  # the sample's second org


def fb(**kw: Any) -> Feedback:
    fields: dict[str, Any] = dict(
        org_id=ORG, memory_ids=[M1, M2], feedback="positive", session_id="s", trace_id="t"
    )
    return validate_feedback(**{**fields, **kw})


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"org_id": ""}, "org_id"),
        ({"org_id": "acme"}, "org_id"),
        ({"feedback": "POSITIVE"}, "feedback"),
        ({"feedback": ""}, "feedback"),
        ({"feedback": "helpful"}, "feedback"),
        ({"memory_ids": []}, "memory_ids"),
        ({"memory_ids": [M1, "not-a-uuid"]}, "memory_ids[1]"),
        ({"memory_ids": [""]}, "memory_ids[0]"),
        ({"memory_ids": [M1] * (MAX_FEEDBACK_IDS + 1)}, "memory_ids"),
        ({"session_id": "s" * 257}, "session_id"),
        ({"trace_id": "t" * 257}, "trace_id"),
    ],
)
def test_invalid_input_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as info:
        fb(**change)
    assert info.value.status == "INVALID_ARGUMENT"
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_ids_are_canonical_distinct_and_sorted() -> None:
    got = fb(org_id=ORG.upper(), memory_ids=[M2.upper(), M1, "{" + M1 + "}", M2])
    assert got.org_id == ORG
    assert got.memory_ids == (M1, M2)


def test_one_hundred_distinct_ids_are_accepted() -> None:
    ids = [f"10000000-0000-4000-8000-{i:012x}" for i in range(MAX_FEEDBACK_IDS)]
    assert len(fb(memory_ids=ids).memory_ids) == MAX_FEEDBACK_IDS


def test_every_kind_is_accepted() -> None:
    for kind in ("positive", "negative", "neutral"):
        assert fb(feedback=kind).feedback == kind


# --------------------------------------------------------------------------- idempotency key


def test_key_is_sha256_of_the_canonical_encoding() -> None:
    expected = hashlib.sha256(
        b'["ibex-feedback-v1","' + ORG.encode() + b'","s","t","positive",["'
        + M1.encode() + b'","' + M2.encode() + b'"]]'
    ).hexdigest()  # fmt: skip
    assert idempotency_key(fb()) == expected


def test_key_ignores_order_case_and_duplicates() -> None:
    base = idempotency_key(fb(memory_ids=[M1, M2]))
    assert idempotency_key(fb(memory_ids=[M2, M1])) == base
    assert idempotency_key(fb(memory_ids=[M2.upper(), M1, M1])) == base
    assert idempotency_key(fb(org_id=ORG.upper())) == base


@pytest.mark.parametrize(
    "change",
    [
        {"org_id": OTHER_ORG},
        {"feedback": "negative"},
        {"trace_id": "t2"},
        {"session_id": "s2"},
        {"memory_ids": [M1]},
        {"memory_ids": [M1, M2, M3]},
    ],
)
def test_key_differs_for_different_feedback(change: dict[str, Any]) -> None:
    assert idempotency_key(fb(**change)) != idempotency_key(fb())


def test_key_cannot_be_forged_across_fields() -> None:
    # A separator inside one field must not make it read as two fields.
    a = fb(session_id='s","t', trace_id="")
    b = fb(session_id="s", trace_id='","t')
    assert idempotency_key(a) != idempotency_key(b)


# --------------------------------------------------------------------------- decoding


def _body(updates: list[Any]) -> bytes:
    return json.dumps({"data": {"updates": updates}}).encode()


def _u(memory_id: str, prev: Any = 0.5, new: Any = 0.6) -> dict[str, Any]:
    return {"memory_id": memory_id, "previous_score": prev, "new_score": new}


def test_decode_returns_what_the_service_sent() -> None:
    got = decode_updates(_body([_u(M2, 0.2, 0.3), _u(M1)]), (M1, M2))
    assert got == [ScoreUpdate(M2, 0.2, 0.3), ScoreUpdate(M1, 0.5, 0.6)]
    assert decode_updates(_body([]), (M1,)) == []


@pytest.mark.parametrize(
    "body",
    [
        _body([_u(M3)]),  # an id that was not sent
        _body([_u("{" + M1 + "}")]),  # not canonical
        _body([_u(M1), _u(M1)]),  # one id twice
        _body([_u(M1), _u(M2), _u(M3)]),  # more updates than ids
        _body([_u(M1, "0.5")]),  # a string score
        _body([{"memory_id": M1, "previous_score": 0.5}]),  # a missing score
        b'{"data": {"updates": [{"memory_id": ',  # cut short
        b'{"data": {}}',
        b"[]",
        b"<html>",
        b'{"data": {"updates": [{"memory_id": "' + M1.encode() + b'", "previous_score": 1e999, '
        b'"new_score": 0.1}]}}',  # infinite
        b"[" * 100_000,
    ],
)
def test_decode_refuses_a_broken_answer(body: bytes) -> None:
    with pytest.raises(SourceError) as info:
        decode_updates(body, (M1, M2))
    assert str(info.value).startswith("feedback: ")
    assert len(str(info.value)) <= 160


# --------------------------------------------------------------------------- retry


class ScriptedSink:
    """Plays one scripted behaviour per attempt; records the keys it was given."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.keys: list[str] = []

    async def feedback(self, feedback: Feedback, key: str) -> list[ScoreUpdate]:
        assert feedback == fb()  # what was validated is what is sent
        self.keys.append(key)
        step = self.script.pop(0)
        if step == "hang":
            await trio.sleep_forever()
        if isinstance(step, float):
            await trio.sleep(step)
            return [ScoreUpdate(M1, 0.5, 0.6)]
        if isinstance(step, BaseException):
            raise step
        await trio.lowlevel.checkpoint()
        return list(step)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    clock = trio.testing.MockClock(autojump_threshold=0)
    clock.jump(1000.0)  # far from zero: a deadline cannot read like a duration
    return clock


async def _send(sink: ScriptedSink, deadline_in: float | None = 1.0, **kw: Any) -> Any:
    deadline = None if deadline_in is None else trio.current_time() + deadline_in
    return await send_feedback(
        sink, fb(), deadline=deadline, default_timeout=2.0, headroom=0.002, **kw
    )


async def test_success_at_first_attempt(autojump_clock: trio.testing.MockClock) -> None:
    sink = ScriptedSink([ScoreUpdate(M1, 0.5, 0.6)])
    sent = await _send(sink)
    assert sent.attempts == 1
    assert sent.updates == [ScoreUpdate(M1, 0.5, 0.6)]
    assert sink.keys == [idempotency_key(fb())]


@pytest.mark.parametrize(
    "first",
    [FeedbackRetryable("feedback: transport error (ReadError)"), "hang"],
)
async def test_one_retry_with_the_same_key(
    autojump_clock: trio.testing.MockClock, first: Any
) -> None:
    sink = ScriptedSink(first, [ScoreUpdate(M1, 0.5, 0.6)])
    start = trio.current_time()
    retries: list[int] = []
    sent = await _send(sink, on_retry=lambda: retries.append(1))
    assert sent.attempts == 2 and retries == [1]
    assert sink.keys == [idempotency_key(fb())] * 2
    if first == "hang":  # the first attempt had half the time, so the retry had room
        assert trio.current_time() - start == pytest.approx((1.0 - 0.002) / 2)


async def test_never_a_third_attempt(autojump_clock: trio.testing.MockClock) -> None:
    sink = ScriptedSink(
        FeedbackRetryable("feedback: HTTP 503"),
        FeedbackRetryable("feedback: HTTP 502"),
        [ScoreUpdate(M1, 0.5, 0.6)],
    )
    with pytest.raises(SourceError, match="HTTP 502"):
        await _send(sink)
    assert len(sink.keys) == 2


async def test_both_attempts_timing_out_is_unavailable_before_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sink = ScriptedSink("hang", "hang")
    start = trio.current_time()
    with pytest.raises(SourceError, match="no answer within") as info:
        await _send(sink, 0.5)
    assert info.value.status == "UNAVAILABLE"
    assert trio.current_time() - start == pytest.approx(0.5 - 0.002)
    assert len(sink.keys) == 2


@pytest.mark.parametrize("error", [FeedbackRejected(404), SourceError("feedback: bad response")])
async def test_no_retry_for_a_refusal_or_a_broken_answer(
    autojump_clock: trio.testing.MockClock, error: Exception
) -> None:
    sink = ScriptedSink(error, [ScoreUpdate(M1, 0.5, 0.6)])
    with pytest.raises(type(error)):
        await _send(sink)
    assert len(sink.keys) == 1


async def test_no_attempt_without_time(autojump_clock: trio.testing.MockClock) -> None:
    sink = ScriptedSink([ScoreUpdate(M1, 0.5, 0.6)])
    with pytest.raises(SourceError, match="no time left"):
        await _send(sink, 0.002)
    assert sink.keys == []


async def test_too_little_time_for_two_attempts_gives_the_one_all_of_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sink = ScriptedSink("hang", [ScoreUpdate(M1, 0.5, 0.6)])
    start = trio.current_time()
    with pytest.raises(SourceError, match="no answer within"):
        await _send(sink, 0.0035)  # 1.5 ms after the headroom: one attempt's worth
    assert trio.current_time() - start == pytest.approx(0.0015)
    assert len(sink.keys) == 1


async def test_no_deadline_uses_the_default_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sink = ScriptedSink("hang", "hang")
    start = trio.current_time()
    with pytest.raises(SourceError):
        await _send(sink, None)
    assert trio.current_time() - start == pytest.approx(2.0 - 0.002)


def test_rejection_names_no_tenant_and_is_invalid_argument() -> None:
    err = FeedbackRejected(403)
    assert err.status == "INVALID_ARGUMENT"
    assert str(err) == "feedback: refused by the memory service (HTTP 403)"


# --------------------------------------------------------------------------- local backend


async def _usefulness(source: LocalFileSource, memory_id: str) -> float | None:
    hits = await source.hot(SAMPLE_ORG_ID, SAMPLE_AGENT_ID, limit=100, min_confidence=0.0)
    return next(h.usefulness for h in hits if h.memory_id == memory_id)


async def test_local_feedback_moves_usefulness_once_per_key() -> None:
    source = LocalFileSource.load(None)
    assert await _usefulness(source, M1) == 0.5  # the sample's value
    positive = fb(memory_ids=[M1, M2])
    got = await source.feedback(positive, idempotency_key(positive))
    assert got == [ScoreUpdate(M1, 0.5, 0.6), ScoreUpdate(M2, 0.6, 0.7)]
    assert await _usefulness(source, M1) == 0.6
    # The same key again: the first answer, nothing applied twice.
    assert await source.feedback(positive, idempotency_key(positive)) == got
    assert await _usefulness(source, M1) == 0.6
    cold = await source.cold(
        SAMPLE_ORG_ID, SAMPLE_AGENT_ID, "deploy the billing service", limit=5, min_confidence=0
    )
    assert next(h.usefulness for h in cold if h.memory_id == M1) == 0.6
    negative = fb(memory_ids=[M1], feedback="negative")
    assert await source.feedback(negative, idempotency_key(negative)) == [ScoreUpdate(M1, 0.6, 0.5)]
    neutral = fb(memory_ids=[M1], feedback="neutral")
    assert await source.feedback(neutral, idempotency_key(neutral)) == [ScoreUpdate(M1, 0.5, 0.5)]
    assert await _usefulness(source, M2) == 0.7


async def test_local_feedback_leaves_out_other_orgs_and_unknown_ids() -> None:
    source = LocalFileSource.load(None)
    unknown = "10000000-0000-4000-8000-0000000000ff"
    got = await source.feedback(
        fb(memory_ids=[M1, OTHER_ORGS_MEMORY, unknown]), "k1"
    )  # ORG asks about the second org's memory
    assert [u.memory_id for u in got] == [M1]
    other = fb(org_id=OTHER_ORG, memory_ids=[M1, OTHER_ORGS_MEMORY])
    assert [u.memory_id for u in await source.feedback(other, "k2")] == [OTHER_ORGS_MEMORY]
    assert await _usefulness(source, M1) == 0.6  # only ORG's own feedback moved it


async def test_local_feedback_stays_within_unit_interval() -> None:
    source = LocalFileSource.load(None)
    for i in range(12):
        await source.feedback(fb(memory_ids=[M1], trace_id=str(i)), str(i))
    assert await _usefulness(source, M1) == 1.0
    for i in range(12):
        await source.feedback(fb(memory_ids=[M1], feedback="negative"), f"n{i}")
    usefulness = await _usefulness(source, M1)
    assert usefulness is not None and math.isclose(usefulness, 0.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"feedback": "helpful"}, "feedback: must be one of positive, negative, neutral"),
        ({"memory_ids": []}, "memory_ids: at least one memory id is required"),
        (
            {"memory_ids": [M1] * (MAX_FEEDBACK_IDS + 1)},
            f"memory_ids: more than {MAX_FEEDBACK_IDS} ids",
        ),
        ({"session_id": "s" * 257}, "session_id: longer than 256 characters"),
        ({"trace_id": "t" * 257}, "trace_id: longer than 256 characters"),
    ],
)
def test_feedback_refusals_name_the_field_and_the_rule(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError) as info:
        fb(**change)
    assert str(info.value) == message


def test_ids_of_exactly_the_length_limit_and_absent_ones_are_accepted() -> None:
    assert fb(session_id="s" * 256, trace_id="t" * 256).session_id == "s" * 256
    bare = validate_feedback(org_id=ORG, memory_ids=[M1], feedback="neutral")
    assert (bare.session_id, bare.trace_id) == ("", "")


def test_the_idempotency_key_takes_any_session_text() -> None:
    """The canonical encoding is ASCII JSON (non-ASCII escaped), so any session id keys."""
    key = idempotency_key(fb(session_id="café ☕"))
    assert key != idempotency_key(fb(session_id="cafe"))
    canonical = json.dumps(
        ["ibex-feedback-v1", ORG, "café ☕", "t", "positive", sorted([M1, M2])],
        ensure_ascii=True,
        separators=(",", ":"),
    )
    assert key == hashlib.sha256(canonical.encode("ascii")).hexdigest()


async def test_a_retry_is_logged_with_its_reason_and_a_key_prefix_only(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two 1 s halves of 2 s: the first hangs; the log names why the second attempt runs,
    the org and 16 characters of the key (enough to correlate, not the whole key)."""
    sink = ScriptedSink("hang", [ScoreUpdate(M1, 0.5, 0.6)])
    with caplog.at_level(logging.INFO, logger="ibex.sources.feedback_sender"):
        sent = await _send(sink, 2.002)
    assert sent.attempts == 2
    (record,) = [r for r in caplog.records if r.getMessage() == "feedback_retry"]
    assert record.reason == "feedback: no answer within 1000ms"  # type: ignore[attr-defined]
    assert record.key == idempotency_key(fb())[:16]  # type: ignore[attr-defined]
    assert record.org_id == ORG  # type: ignore[attr-defined]


async def test_no_time_for_an_attempt_says_so(autojump_clock: trio.testing.MockClock) -> None:
    with pytest.raises(SourceError) as info:
        await _send(ScriptedSink(), 0.002)
    assert str(info.value) == "feedback: no time left for an attempt"


def test_an_answer_nested_too_deeply_is_a_source_error_naming_it() -> None:
    """Unknown keys are skipped, however deep: their nesting ends in the stated error."""
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"data": {"updates": [], "x": ' + deep + b"}}"
    with pytest.raises(SourceError) as info:
        decode_updates(body, (M1,))
    assert str(info.value) == "feedback: invalid JSON: nested too deeply"


def test_a_source_error_detail_is_cut_to_160_characters() -> None:
    """The detail a branch or RPC carries is bounded: at most 160 characters, '...' marking
    a cut (the same bound as the retrieval branches' details)."""
    assert _detail("a" * 160) == "a" * 160
    assert _detail("a" * 161) == "a" * 157 + "..."
    assert len(_detail("b" * 10_000)) == 160
