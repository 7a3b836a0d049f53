"""Sending memory feedback (contract section 2, the write surface), with one retry.

A backend that records feedback is a `FeedbackSink`: one attempt per call,
which raises `FeedbackRejected` when the memory service refused the feedback
itself (a 4xx: the same request would be refused again), `FeedbackRetryable`
when the attempt may well succeed if repeated (reset, connection refused, 5xx)
and `SourceError` when the answer broke the contract (repeating would not
help and must not widen anything).

`send_feedback` makes at most two attempts, both with the same idempotency key
(`ibex.assembly.feedback_rules.idempotency_key`), so a first attempt the memory
service did record but whose answer was lost is not counted twice. While a
retry is still possible the first attempt gets half the time left: a hung
first attempt would otherwise use up the whole deadline and leave the retry
none. An attempt cut by its time is retried like a reset.

Every answer is decoded strictly: each update names one of the ids sent
(canonical UUID, at most once) with finite scores; anything else fails the
whole answer. The memory service leaves out ids it does not know or that
belong to another org, so the updates are never more than what was sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import ClassVar, Final, NamedTuple, Protocol

import msgspec
import trio

from ibex.assembly.feedback_rules import Feedback, ScoreUpdate, idempotency_key
from ibex.errors import InputError, SourceError

log = logging.getLogger(__name__)

FEEDBACK_PATH: Final = "/v1/memories/feedback"
# 100 updates of about 100 bytes each; anything much longer is not an answer to us.
FEEDBACK_MAX_RESPONSE_BYTES: Final = 64 * 1024
_DETAIL_MAX: Final = 160
# Less time than this left is not worth an attempt (a loopback round trip is ~0.1 ms).
MIN_ATTEMPT: Final = 0.001


class FeedbackRejected(InputError):
    """The memory service refused the feedback (4xx): INVALID_ARGUMENT, never retried.

    The message carries the HTTP status only: the service's body could name
    a memory or tenant the caller must not learn about.
    """

    status: ClassVar[str] = "INVALID_ARGUMENT"

    def __init__(self, http_status: int) -> None:
        super().__init__("feedback", f"refused by the memory service (HTTP {http_status})")
        self.http_status = http_status


class FeedbackRetryable(SourceError):
    """An attempt failed in a way another attempt may not (reset, refused, 5xx)."""


class FeedbackSink(Protocol):
    async def feedback(self, fb: Feedback, key: str) -> list[ScoreUpdate]:
        """Record `fb` once under `key` (the Idempotency-Key); one attempt, no retry."""
        ...


class Sent(NamedTuple):
    updates: list[ScoreUpdate]
    attempts: int


class _Update(msgspec.Struct, frozen=True):
    memory_id: str
    previous_score: float
    new_score: float


class _Data(msgspec.Struct, frozen=True):
    updates: list[_Update]


class _Body(msgspec.Struct, frozen=True):
    data: _Data


_DECODER = msgspec.json.Decoder(_Body)


def decode_updates(body: bytes, sent: tuple[str, ...]) -> list[ScoreUpdate]:
    """The answer's updates, or SourceError; never partial.

    `sent` are the canonical ids the request carried: an update for any other
    id (or one id twice) means the answer is not about this request.
    """
    try:
        updates = _DECODER.decode(body).data.updates
    except msgspec.ValidationError as exc:
        raise SourceError(_detail(f"feedback: bad response shape: {exc}")) from None
    except msgspec.DecodeError as exc:
        raise SourceError(_detail(f"feedback: invalid JSON: {exc}")) from None
    except RecursionError:
        raise SourceError("feedback: invalid JSON: nested too deeply") from None
    if len(updates) > len(sent):
        raise SourceError(f"feedback: {len(updates)} updates for {len(sent)} ids")
    allowed = set(sent)
    out: list[ScoreUpdate] = []
    for i, u in enumerate(updates):
        if u.memory_id not in allowed:  # canonical form only: sent ids are canonical
            raise SourceError(f"feedback: updates[{i}].memory_id is not an id that was sent")
        allowed.discard(u.memory_id)
        if not (math.isfinite(u.previous_score) and math.isfinite(u.new_score)):
            raise SourceError(f"feedback: updates[{i}]: scores must be finite")
        out.append(ScoreUpdate(u.memory_id, u.previous_score, u.new_score))
    return out


async def send_feedback(
    sink: FeedbackSink,
    fb: Feedback,
    *,
    deadline: float | None,
    default_timeout: float,
    headroom: float,
    on_retry: Callable[[], object] | None = None,
) -> Sent:
    """Record `fb` within `deadline` (Trio clock; None: `default_timeout` from now).

    `headroom` is kept back from the deadline for sending the answer;
    `on_retry` is called when a second attempt starts (e.g. to count it).
    Raises FeedbackRejected (4xx) or SourceError (anything else: UNAVAILABLE).
    """
    key = idempotency_key(fb)
    now = trio.current_time()
    end = (now + default_timeout if deadline is None else deadline) - headroom
    last = "feedback: no time left for an attempt"
    for attempt in (1, 2):
        left = end - trio.current_time()
        if left < MIN_ATTEMPT:
            break
        # Half for the first attempt while the other half still allows a retry.
        budget = left / 2 if attempt == 1 and left >= 2 * MIN_ATTEMPT else left
        if attempt == 2:
            log.info("feedback_retry", extra={"key": key[:16], "reason": last, "org_id": fb.org_id})
            if on_retry is not None:
                on_retry()
        with trio.move_on_after(budget) as scope:
            try:
                return Sent(await sink.feedback(fb, key), attempt)
            except FeedbackRetryable as exc:
                last = str(exc)
        if scope.cancelled_caught:
            last = f"feedback: no answer within {budget * 1000:.0f}ms"
    raise SourceError(last)


def _detail(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."
