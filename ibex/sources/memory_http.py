"""Memory service HTTP source (contract section 2) on our own HTTP/1.1 pool, native Trio.

Lifecycle: the pools are created by `open()` (or `async with`) inside the Trio
run and closed by `aclose()` in the same run. One instance per process.

The client is `ibex.sources.http_pool`, not httpx2: the daemon cancels
in-flight calls by design (branch timeouts, the retrieval wall), so the pool
must never leak a slot or reuse a half-read connection when a call is
cancelled (encode/httpcore#1093), and it must be cheap, because it runs twice
per answer. tests/chaos/test_http_cancel_storm.py holds it to the first;
`python -m benchmarks.memory_client` measures the second (docs/performance.md).

Timeouts: the caller's cancel scope is the real timer; the pool's timeout is
only a safety net for callers that set none. No retries, no redirects: a
failed call is a failed branch (the pool's one re-send on a pooled connection
the server had closed is connection housekeeping, not a retry).
"""

from __future__ import annotations

import functools
import ssl
import types
from contextlib import AsyncExitStack
from typing import Final, Literal, Self
from urllib.parse import quote

import msgspec
import sniffio
import trio

from ibex.assembly.feedback_rules import Feedback, ScoreUpdate
from ibex.assembly.structs import MemoryHit
from ibex.sources.base import SourceError
from ibex.sources.cpu import niced
from ibex.sources.feedback_sender import (
    FEEDBACK_MAX_RESPONSE_BYTES,
    FEEDBACK_PATH,
    FeedbackRejected,
    FeedbackRetryable,
    decode_updates,
)
from ibex.sources.http_exchange import split_base_url
from ibex.sources.http_framing import TransportError
from ibex.sources.http_pool import HttpPool, PoolStats
from ibex.sources.memory_config import MemoryServiceConfig as MemoryServiceConfig
from ibex.sources.memory_schema import DEFAULT_MAX_CONTENT_BYTES, DecodedAnswers, decode_hits

HOT_PATH = "/v1/memories/hot"
SEARCH_PATH = "/v1/memories/search"


_DEFAULTS = MemoryServiceConfig()
DEFAULT_MAX_RESPONSE_BYTES = _DEFAULTS.max_response_bytes
USER_AGENT = "ibex-context"
# Answers longer than this are decoded in a worker thread. msgspec holds the GIL
# while it runs, so the thread does not make one decode call interruptible; but a
# large answer is decoded result by result (sources.memory_schema), and between two results
# the loop gets the GIL back (within the switch interval) instead of waiting for
# the whole answer (what that costs the loop: docs/performance.md, the memory client).
OFF_LOOP_BYTES: Final = 64 * 1024
DECODE_THREADS: Final = 2  # large answers decoded at once per process


class _SearchBody(msgspec.Struct):
    agent_id: str
    query: str
    limit: int
    min_confidence: float


class _FeedbackBody(msgspec.Struct):
    org_id: str
    session_id: str
    trace_id: str
    feedback: str
    memory_ids: tuple[str, ...]


_ENCODER = msgspec.json.Encoder()
# Statuses in 4xx that say nothing about the feedback itself: our own credentials
# (UNAVAILABLE: the daemon is misconfigured, the caller cannot fix it) and
# "try again later" (retried like a 5xx).
_NOT_THE_FEEDBACKS_FAULT = frozenset({401, 403, 407})
_TRY_AGAIN = frozenset({408, 425, 429})

Branch = Literal["hot", "cold"]
BRANCHES: tuple[Branch, ...] = ("hot", "cold")


class MemoryHttpSource:
    """`MemorySource` over the memory service's HTTP read surfaces."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        pool_size: int = _DEFAULTS.pool_size,
        transport_timeout: float = 2.0,
        keepalive_expiry: float = 5.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`max_response_bytes` bounds a whole answer (over it the branch fails);
        `max_content_bytes` one memory's content (over it that memory is dropped
        and excluded as `failed`; the branch succeeds)."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("memory base URL must start with http:// or https://")
        split_base_url(base_url)  # refuse credentials, queries or bad ports now, not at open()
        if not token:
            raise ValueError("memory API token must not be empty")
        if pool_size < 1:
            raise ValueError("pool_size must be >= 1")
        self._base_url = base_url.rstrip("/")
        self._token = token
        self._pool_size = pool_size
        self._transport_timeout = transport_timeout
        self._keepalive_expiry = keepalive_expiry
        self._max_response_bytes = max_response_bytes
        self._max_content_bytes = max_content_bytes
        self._ssl_context = ssl_context
        self._pools: dict[Branch, HttpPool] = {}
        self._feedback_pool: HttpPool | None = None
        self._decode_limiter = trio.CapacityLimiter(DECODE_THREADS)
        self._decoded = DecodedAnswers()  # answers decoded on the loop, by their bytes
        self._background: AsyncExitStack | None = None  # the nursery `async with` opened

    def __repr__(self) -> str:  # never show the token
        state = "open" if self._pools else "closed"
        return f"<MemoryHttpSource {self._base_url} pool={self._pool_size} per branch {state}>"

    def pool_stats(self, branch: Branch | None = None) -> PoolStats:
        """Connections (total, idle, in use), held slots and waiters, for tests and diagnostics:
        one branch's pool, or both summed."""
        if branch is not None:
            return self._open_pool(branch).stats()
        stats = [self._open_pool(b).stats() for b in BRANCHES]
        return PoolStats(*(sum(column) for column in zip(*stats, strict=True)))

    async def open(self, nursery: trio.Nursery | None = None) -> None:
        """Create the connection pools. Must run inside Trio.

        `nursery` (which must outlive `aclose()`) runs the drains that keep a
        cancelled read's connection open; without it every cut call costs a new
        connection. `async with` opens one for the block.
        """
        _require_trio()
        if self._pools:
            raise RuntimeError("MemoryHttpSource is already open")
        # A pool per branch: a cold call cut at the wall (the common case when the
        # search is slow) leaves its connection busy until its drain ends, and with
        # one shared pool the hot calls then find no idle connection and pay a new
        # connection against their shorter timeout (docs/performance.md).
        self._pools = {
            branch: self._new_pool(self._max_response_bytes, nursery) for branch in BRANCHES
        }
        # Feedback has a pool of its own: a slow write never holds a read's connection.
        # It makes one attempt per call (`feedback_sender.send_feedback` decides on the
        # one retry) and is not drained: its calls are cut only when the write itself is late.
        self._feedback_pool = self._new_pool(FEEDBACK_MAX_RESPONSE_BYTES, None)

    def _new_pool(self, max_response_bytes: int, nursery: trio.Nursery | None) -> HttpPool:
        return HttpPool(
            self._base_url,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Accept": "application/json",
                "User-Agent": USER_AGENT,
            },
            max_connections=self._pool_size,
            keepalive_expiry=self._keepalive_expiry,
            timeout=self._transport_timeout,
            max_response_bytes=max_response_bytes,
            ssl_context=self._ssl_context,
            background=nursery,
        )

    async def aclose(self) -> None:
        """Close every pooled connection. Idempotent."""
        pools, self._pools = self._pools, {}
        feedback, self._feedback_pool = self._feedback_pool, None
        for pool in (*pools.values(), *([feedback] if feedback else [])):
            await pool.aclose()

    async def __aenter__(self) -> Self:
        """Open with a nursery of its own for the block, so cut calls keep their connections."""
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            await self.open(nursery)
        except BaseException:
            await stack.aclose()
            raise
        self._background = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        """Close the pools (cancelling their drains), then wait for the drains to end.

        The block's exception is not passed into the nursery: it leaves as it
        was raised, not wrapped in an exception group.
        """
        stack, self._background = self._background, None
        with trio.CancelScope(shield=True):
            await self.aclose()
        if stack is not None:
            await stack.aclose()

    async def warm(self, min_idle: int = 1, fresh_for: float = 0.0) -> None:
        """Give the hot and cold pools `min_idle` idle connections each, usable for
        `fresh_for` more seconds (`HttpPool.warm`): connected, TLS handshake done.

        Before the first call, and periodically while idle (idle connections expire
        after `keepalive_expiry`). SourceError naming the branch when a connect
        fails; the caller bounds the time. The feedback pool is left cold: its
        calls have seconds, not a branch's milliseconds.
        """
        _require_trio()
        failed: list[str] = []

        async def one(branch: Branch) -> None:
            try:
                await self._open_pool(branch).warm(min_idle, fresh_for)
            except TransportError as exc:  # fixed, safe text
                failed.append(f"{branch}: {exc}")

        async with trio.open_nursery() as nursery:
            for branch in BRANCHES:
                nursery.start_soon(one, branch)
        if failed:
            raise SourceError("; ".join(sorted(failed)))

    @property
    def keepalive_expiry(self) -> float:
        """Seconds an idle pooled connection is kept."""
        return self._keepalive_expiry

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """GET /v1/memories/hot. org_id is not on the wire; the pipeline filters by it."""
        target = (
            f"{HOT_PATH}?agent_id={quote(agent_id, safe='')}&limit={int(limit)}"
            f"&min_confidence={quote(repr(float(min_confidence)), safe='')}"
        )
        return await self._call("hot", "GET", target, None, limit)

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """POST /v1/memories/search; the memory service embeds the query."""
        body = _ENCODER.encode(
            _SearchBody(agent_id=agent_id, query=query, limit=limit, min_confidence=min_confidence)
        )
        return await self._call("cold", "POST", SEARCH_PATH, body, limit)

    async def feedback(self, fb: Feedback, key: str) -> list[ScoreUpdate]:
        """POST /v1/memories/feedback once, with `key` as its Idempotency-Key.

        4xx: FeedbackRejected (the caller's feedback is wrong), except our own
        credentials refused (SourceError) and 408/425/429 (retryable). 5xx and
        transport failures: FeedbackRetryable. A 2xx is decoded strictly.
        """
        _require_trio()
        pool = self._feedback_pool
        if pool is None:
            raise RuntimeError("MemoryHttpSource is not open")
        # The body is exactly the validated feedback's fields, in the wire's order.
        body = _ENCODER.encode(_FeedbackBody(**msgspec.structs.asdict(fb)))
        try:
            response = await pool.request(
                "POST", FEEDBACK_PATH, body, "application/json", {"Idempotency-Key": key}
            )
        except TransportError as exc:  # fixed, safe text
            raise FeedbackRetryable(f"feedback: {exc}") from None
        status = response.status
        if 200 <= status < 300:
            return decode_updates(response.body, fb.memory_ids)
        if status >= 500 or status in _TRY_AGAIN:
            raise FeedbackRetryable(f"feedback: HTTP {status}")
        if 400 <= status < 500 and status not in _NOT_THE_FEEDBACKS_FAULT:
            raise FeedbackRejected(status)
        raise SourceError(f"feedback: HTTP {status}")

    def feedback_pool_stats(self) -> PoolStats:
        """The feedback pool's connections and slots, for tests and diagnostics."""
        if self._feedback_pool is None:
            raise RuntimeError("MemoryHttpSource is not open")
        return self._feedback_pool.stats()

    async def _call(
        self,
        branch: Branch,
        method: str,
        target: str,
        body: bytes | None,
        limit: int,
    ) -> list[MemoryHit]:
        """One call; at most `limit` hits (the number asked for), extra results dropped."""
        _require_trio()
        pool = self._open_pool(branch)
        try:
            response = await pool.request(method, target, body, "application/json")
        except TransportError as exc:  # its text is fixed and safe: no URL, token or body
            raise SourceError(f"{branch}: {exc}") from None
        if not 200 <= response.status < 300:
            raise SourceError(f"{branch}: HTTP {response.status}")
        if len(response.body) <= OFF_LOOP_BYTES:
            return self._decoded.decode(
                response.body, branch, limit=limit, max_content_bytes=self._max_content_bytes
            )
        decode = functools.partial(
            decode_hits,
            response.body,
            branch,
            limit=limit,
            max_content_bytes=self._max_content_bytes,
        )
        # Abandoned on cancel: a branch cut at its timeout ends then, not when the
        # decode does; the limiter stays held until the thread has finished, so
        # abandoned decodes are bounded too.
        return await trio.to_thread.run_sync(
            functools.partial(niced, decode),
            limiter=self._decode_limiter,
            abandon_on_cancel=True,
        )

    def _open_pool(self, branch: Branch) -> HttpPool:
        pool = self._pools.get(branch)
        if pool is None:
            raise RuntimeError("MemoryHttpSource is not open")
        return pool


def _require_trio() -> None:
    """The pools' sockets belong to the Trio run: used from an asyncio task (e.g. under
    trio-asyncio) a call would fail deep inside Trio, so it raises RuntimeError here."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library != "trio":
        raise RuntimeError(
            "MemoryHttpSource must be used from Trio tasks only (its pool is bound to Trio)"
        )
