"""Memory service HTTP source (contract section 2) on httpx2, native Trio.

Lifecycle: the client and its keep-alive pool are created by `open()` (or
`async with`) inside the Trio run and closed by `aclose()` in the same run.
One instance per process; hot and cold calls share its pool.

Why httpx2: the daemon cancels in-flight calls by design (branch timeouts,
the wall). Stock httpcore could leak a pool slot when a request was cancelled
while waiting for or establishing a connection (encode/httpcore#1093), and a
leaked slot is a pool that slowly stops working. httpcore2 fixes that;
tests/chaos/test_http_cancel_storm.py holds it to that.

Timeouts: the caller's cancel scope is the real timer; the transport timeout
is only a safety net for callers that set none. No retries, no redirects: a
failed call is a failed branch.

Trio only: httpcore picks its I/O backend per call from the running library,
so the same pool used from an asyncio task (e.g. under trio-asyncio) fails
with "bad yield". Every call checks and raises RuntimeError instead.
"""

from __future__ import annotations

import types
from typing import Literal, Self

import httpx2
import msgspec
import sniffio
import trio

from ibex.config import Settings
from ibex.sources.base import SourceError
from ibex.sources.wire import decode_hits
from ibex.structs import MemoryHit

HOT_PATH = "/v1/memories/hot"
SEARCH_PATH = "/v1/memories/search"
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
USER_AGENT = "ibex-context"


class _SearchBody(msgspec.Struct):
    agent_id: str
    query: str
    limit: int
    min_confidence: float


_ENCODER = msgspec.json.Encoder()


class MemoryHttpSource:
    """`MemorySource` over the memory service's HTTP read surfaces."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        pool_size: int = 32,
        transport_timeout: float = 2.0,
        keepalive_expiry: float = 5.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("memory base URL must start with http:// or https://")
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
        self._client: httpx2.AsyncClient | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> MemoryHttpSource:
        """Build from settings; call `open()` (or `async with`) inside the Trio run."""
        if not settings.memory_base_url or not settings.memory_api_token:
            raise ValueError("memory_base_url and memory_api_token are required")
        return cls(
            settings.memory_base_url,
            settings.memory_api_token,
            pool_size=settings.memory_pool_size,
        )

    def __repr__(self) -> str:  # never show the token
        state = "open" if self._client is not None else "closed"
        return f"<MemoryHttpSource {self._base_url} pool={self._pool_size} {state}>"

    @property
    def client(self) -> httpx2.AsyncClient:
        """The underlying client, for tests and diagnostics that inspect the pool."""
        if self._client is None:
            raise RuntimeError("MemoryHttpSource is not open")
        return self._client

    async def open(self) -> None:
        """Create the client and its pool. Must run inside Trio."""
        _require_trio()
        if self._client is not None:
            raise RuntimeError("MemoryHttpSource is already open")
        self._client = httpx2.AsyncClient(
            base_url=self._base_url,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Accept": "application/json",
                "User-Agent": USER_AGENT,
            },
            limits=httpx2.Limits(
                max_connections=self._pool_size,
                max_keepalive_connections=self._pool_size,
                keepalive_expiry=self._keepalive_expiry,
            ),
            timeout=httpx2.Timeout(self._transport_timeout),
            follow_redirects=False,
            trust_env=False,  # no proxy or netrc from the environment
        )

    async def aclose(self) -> None:
        """Close every pooled connection. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """GET /v1/memories/hot. org_id is not on the wire; the pipeline filters by it."""
        params = {"agent_id": agent_id, "limit": str(limit), "min_confidence": repr(min_confidence)}
        return await self._call("hot", "GET", HOT_PATH, params=params)

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        """POST /v1/memories/search; the memory service embeds the query."""
        body = _ENCODER.encode(
            _SearchBody(agent_id=agent_id, query=query, limit=limit, min_confidence=min_confidence)
        )
        return await self._call("cold", "POST", SEARCH_PATH, content=body)

    async def _call(
        self,
        branch: Literal["hot", "cold"],
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> list[MemoryHit]:
        _require_trio()
        client = self.client
        headers = {"Content-Type": "application/json"} if content is not None else None
        try:
            async with client.stream(
                method, path, params=params, content=content, headers=headers
            ) as response:
                if not 200 <= response.status_code < 300:
                    raise SourceError(f"{branch}: HTTP {response.status_code}")
                body = await self._read_capped(branch, response)
        except httpx2.TimeoutException as exc:
            raise SourceError(f"{branch}: transport timeout ({type(exc).__name__})") from None
        except (httpx2.HTTPError, OSError) as exc:
            raise SourceError(f"{branch}: transport error ({type(exc).__name__})") from None
        return decode_hits(body, branch)

    async def _read_capped(
        self, branch: Literal["hot", "cold"], response: httpx2.Response
    ) -> bytes:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_response_bytes:
            raise SourceError(f"{branch}: response larger than {self._max_response_bytes} bytes")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > self._max_response_bytes:
                raise SourceError(
                    f"{branch}: response larger than {self._max_response_bytes} bytes"
                )
        return bytes(body)


def _require_trio() -> None:
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library != "trio":
        raise RuntimeError(
            "MemoryHttpSource must be used from Trio tasks only (its pool is bound to Trio)"
        )
