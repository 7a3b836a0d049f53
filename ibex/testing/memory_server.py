"""A real HTTP/1.1 server on loopback standing in for the memory service.

It serves the read surfaces (hot, search) and the feedback write surface
(`POST /v1/memories/feedback`, contract section 2): feedback is counted once
per `Idempotency-Key` (a repeated key gets the first answer again and changes
nothing; the same key with another body is a 422), ids that are unknown or of
another org are left out of `updates`. Faults on that endpoint model a write
whose answer is lost: with `reset`, `hang` or latency the feedback is recorded
first and then the answer is cut or delayed; an injected status >= 400 (e.g. a
503) records nothing. `Endpoint.then` scripts one request at a time (e.g. a
reset, then normal answers).

Why a thread and not the Trio loop under test: latency, hangs and resets must
happen on the server's own clock; a server on the test's loop would be paused
and cancelled by the very code it is meant to stress. A `ThreadingHTTPServer`
(one thread per connection) in a background thread keeps the counters and the
fault switches plain attributes the test can read and flip, with no IPC. It
shares the GIL with the test, so under heavy client CPU its latency stretches
by up to the interpreter's switch interval: fine for correctness and chaos
tests. Benchmarks should run it as its own process instead:

    python -m ibex.testing.memory_server --port 8089 --hot-latency-ms 2 --cold-latency-ms 8

Usage in tests (fixtures are imported explicitly, no conftest):

    from ibex.testing.memory_server import memory_server_fixture  # noqa: F401

    async def test_x(memory_server: FakeMemoryServer) -> None:
        memory_server.add_memories(ORG, AGENT, make_memories(ORG, AGENT, 10))
        memory_server.hot.latency_ms = 5
        async with memory_server.source() as source:
            hits = await source.hot(ORG, AGENT, limit=10, min_confidence=0.0)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import pytest
import trio

from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.samples import AGENT, ORG

DEFAULT_TOKEN = "test-memory-token-0123456789"
DEMO_ORG = ORG
DEMO_AGENT = AGENT

Fault = Literal["none", "malformed", "hang", "reset"]


@dataclass
class Endpoint:
    """Behaviour of one endpoint; mutate freely while the server runs."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    status: int = 200
    fault: Fault = "none"
    body: bytes | None = None  # raw body override (e.g. a bad shape), sent with `status`
    # A whole HTTP response sent right after the real answer, in the same TCP
    # segment (TCP_CORK): over TLS the client's TLS layer reads it off the
    # socket together with the answer, so it waits above the socket.
    stray: bytes | None = None
    # Behaviours for the next requests, one each, before this endpoint's own.
    then: deque[Endpoint] = field(default_factory=deque)


@dataclass
class Seen:
    """One request as the server saw it (bounded log; for assertions)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass
class _Stats:
    requests: dict[str, int] = field(
        default_factory=lambda: {"hot": 0, "cold": 0, "feedback": 0, "other": 0}
    )
    unauthorized: int = 0
    open_connections: int = 0
    accepted_connections: int = 0


class FakeMemoryServer:
    """The memory service's read surfaces with fault injection and counters."""

    def __init__(
        self,
        *,
        token: str = DEFAULT_TOKEN,
        host: str = "127.0.0.1",
        port: int = 0,
        log_size: int = 1000,
        seed: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context` (server side) serves https, e.g. with a trustme certificate."""
        self.token = token
        self.ssl_context = ssl_context
        self.hot = Endpoint()
        self.cold = Endpoint()
        self.feedback = Endpoint()
        # Milliseconds a new connection waits before it is served (before its TLS
        # handshake): a slow accept or a distant TLS terminator. Only a connection's
        # first exchange pays it, so it shows what a client pays to connect.
        self.connect_latency_ms = 0.0
        # Feedback state: key -> (request body, answer); (org, id) -> usefulness;
        # memory id -> times feedback was applied to it.
        self._feedback_keys: dict[str, tuple[bytes, bytes]] = {}
        self._usefulness: dict[tuple[str, str], float] = {}
        self.feedback_applied: dict[str, int] = {}
        self.seen: deque[Seen] = deque(maxlen=log_size)
        self._items: dict[str, list[dict[str, Any]]] = {}
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._rng = random.Random(seed)
        self._httpd = _Server((host, port), _Handler, self)
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, wake hung handlers, drop live sockets, join every thread."""
        self._stopping.set()
        self._httpd.shutdown()
        with self._lock:
            live = list(self._sockets)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._httpd.server_close()  # joins the per-connection threads
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeMemoryServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def source(
        self,
        *,
        token: str | None = None,
        pool_size: int = 8,
        client_ssl_context: ssl.SSLContext | None = None,
        **kw: Any,
    ) -> MemoryHttpSource:
        """An unopened source aimed at this server; use as `async with`."""
        return MemoryHttpSource(
            self.url, token or self.token, pool_size=pool_size, ssl_context=client_ssl_context, **kw
        )

    # -- dataset ---------------------------------------------------------
    def add_memories(
        self,
        org_id: str,
        agent_id: str,
        memories: list[dict[str, Any]],
        *,
        similarities: list[float] | None = None,
        source: str = "vector",
        served_to: str | None = None,
    ) -> None:
        """Serve `memories` (memory objects) when `served_to` (default agent_id) asks.

        A memory's own org_id/agent_id are kept as given, so serving another
        tenant's memories to an agent (a confused retrieval) is
        `add_memories(OTHER_ORG, OTHER_AGENT, ms, served_to=AGENT)`.
        """
        sims = similarities or [round(self._rng.uniform(0.5, 0.99), 4) for _ in memories]
        items = [
            {
                "memory": {"org_id": org_id, "agent_id": agent_id, **m},
                "similarity": s,
                "source": source,
            }
            for m, s in zip(memories, sims, strict=True)
        ]
        with self._lock:
            self._items.setdefault(served_to or agent_id, []).extend(items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    # -- feedback --------------------------------------------------------
    @property
    def feedback_keys(self) -> int:
        """Distinct idempotency keys recorded."""
        with self._lock:
            return len(self._feedback_keys)

    def usefulness(self, org_id: str, memory_id: str) -> float | None:
        """A memory's usefulness now (after feedback), or None if this org has no such memory."""
        with self._lock:
            return self._usefulness_of(org_id, memory_id)

    def _usefulness_of(self, org_id: str, memory_id: str) -> float | None:
        if (org_id, memory_id) in self._usefulness:
            return self._usefulness[org_id, memory_id]
        for items in self._items.values():
            for item in items:
                m = item["memory"]
                if m.get("id") == memory_id and m.get("org_id") == org_id:
                    value = m.get("usefulness")
                    return float(value) if isinstance(value, int | float) else 0.5
        return None

    def _record_feedback(self, key: str | None, body: bytes) -> tuple[int, bytes]:
        """Apply one feedback request once per key; (status, answer)."""
        if not key or len(key) > 255:
            return 400, b'{"error": "Idempotency-Key required"}'
        try:
            req = json.loads(body)
            org, kind, ids = req["org_id"], req["feedback"], req["memory_ids"]
            if kind not in ("positive", "negative", "neutral") or not isinstance(ids, list):
                raise ValueError(kind)
            for name in ("session_id", "trace_id"):
                if not isinstance(req.get(name, ""), str):
                    raise TypeError(name)
        except (KeyError, ValueError, TypeError):
            return 400, b'{"error": "bad feedback"}'
        step = {"positive": 0.1, "negative": -0.1, "neutral": 0.0}[kind]
        with self._lock:
            if key in self._feedback_keys:
                first_body, answer = self._feedback_keys[key]
                if first_body != body:
                    return 422, b'{"error": "idempotency key reused with another body"}'
                return 200, answer
            updates = []
            for memory_id in dict.fromkeys(str(i) for i in ids):
                previous = self._usefulness_of(org, memory_id)
                if previous is None:  # unknown, or another org's: left out, never named
                    continue
                new = round(min(1.0, max(0.0, previous + step)), 6)
                self._usefulness[org, memory_id] = new
                self.feedback_applied[memory_id] = self.feedback_applied.get(memory_id, 0) + 1
                updates.append(
                    {"memory_id": memory_id, "previous_score": previous, "new_score": new}
                )
            answer = json.dumps({"data": {"updates": updates}}).encode()
            self._feedback_keys[key] = (body, answer)
        return 200, answer

    def _step(self, ep: Endpoint) -> Endpoint:
        """This request's behaviour: the next scripted one, else the endpoint's own."""
        with self._lock:
            return ep.then.popleft() if ep.then else ep

    # -- counters --------------------------------------------------------
    @property
    def requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats.requests)

    @property
    def unauthorized(self) -> int:
        with self._lock:
            return self._stats.unauthorized

    @property
    def open_connections(self) -> int:
        """Client connections currently open from the server's side."""
        with self._lock:
            return self._stats.open_connections

    @property
    def accepted_connections(self) -> int:
        with self._lock:
            return self._stats.accepted_connections

    def wait_open_connections(self, at_most: int, timeout: float = 5.0) -> int:
        """Poll until at most `at_most` connections are open; returns the last count.

        The server learns of a client-side close only when its read sees EOF,
        so counts settle a few milliseconds after the client acts.
        """
        deadline = time.monotonic() + timeout
        while True:
            n = self.open_connections
            if n <= at_most or time.monotonic() >= deadline:
                return n
            time.sleep(0.01)

    async def settle_open_connections(self, at_most: int, patience: float = 5.0) -> int:
        """`wait_open_connections` for Trio tests: polls without blocking the loop.

        Polling, not a trio.Event: the count changes in server threads.
        """
        with trio.move_on_after(patience):
            while self.open_connections > at_most:  # noqa: ASYNC110
                await trio.sleep(0.01)
        return self.open_connections

    # -- request handling (server threads) -------------------------------
    def _connection_opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
            self._stats.open_connections += 1
            self._stats.accepted_connections += 1

    def _connection_closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
            self._stats.open_connections -= 1

    def _results(self, name: str, agent_id: str, limit: int, min_conf: float) -> bytes:
        with self._lock:
            items = list(self._items.get(agent_id, ()))
        items = [i for i in items if _num(i["memory"].get("confidence")) >= min_conf]
        if name == "hot":
            items.sort(key=lambda i: (-_num(i["memory"].get("confidence")), str(i["memory"]["id"])))
        else:
            items.sort(key=lambda i: (-_num(i.get("similarity")), str(i["memory"]["id"])))
        results = [{**item, "rank": n} for n, item in enumerate(items[:limit], start=1)]
        return json.dumps({"data": {"results": results}}, ensure_ascii=False).encode()

    def results_body(
        self,
        endpoint: Literal["hot", "cold"],
        agent_id: str,
        *,
        limit: int,
        min_confidence: float = 0.0,
    ) -> bytes:
        """The answer the endpoint would give now, encoded once up front.

        For megabyte answers: set it as `Endpoint.body` so the server thread does
        not hold the GIL in json.dumps while the test's event loop waits.
        """
        return self._results(endpoint, agent_id, limit, min_confidence)

    def _delay(self, ep: Endpoint) -> float:
        with self._lock:
            jitter = self._rng.uniform(-ep.jitter_ms, ep.jitter_ms) if ep.jitter_ms else 0.0
        return max(0.0, ep.latency_ms + jitter) / 1000.0


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # connection churn in the storm must not hit SYN drops

    def __init__(
        self, addr: tuple[str, int], handler: type[_Handler], owner: FakeMemoryServer
    ) -> None:
        self.owner = owner
        super().__init__(addr, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that vanish mid-response are the point of these tests

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        ctx = self.owner.ssl_context
        if ctx is None:
            return sock, addr
        # The handshake runs in the connection's own thread (_Handler.setup), never here.
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        delay = self.server.owner.connect_latency_ms
        if delay > 0:
            self.server.owner._stopping.wait(delay / 1000)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(5.0)
            self.request.do_handshake()
            self.request.settimeout(None)
        super().setup()
        # Otherwise Nagle plus the client's delayed ACK adds ~40 ms to small responses.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.owner._connection_opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._connection_closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        owner = self.server.owner
        split = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        query = parse_qs(split.query)
        owner.seen.append(
            Seen(method, split.path, query, {k.lower(): v for k, v in self.headers.items()}, body)
        )
        name = {
            ("GET", "/v1/memories/hot"): "hot",
            ("POST", "/v1/memories/search"): "cold",
            ("POST", "/v1/memories/feedback"): "feedback",
        }.get((method, split.path), "other")
        with owner._lock:
            owner._stats.requests[name] += 1
        if self.headers.get("Authorization") != f"Bearer {owner.token}":
            with owner._lock:
                owner._stats.unauthorized += 1
            self._send(401, b'{"error": "unauthorized"}')
            return
        if name == "other":
            self._send(404, b'{"error": "not found"}')
            return
        if name == "feedback":
            self._serve_feedback(owner, body)
            return
        ep = owner._step(owner.hot if name == "hot" else owner.cold)
        if not self._delayed(owner, ep):
            return
        payload = self._injected(ep, b'{"data": {"results": [{"memory": ')
        if payload is None:
            try:
                if name == "hot":
                    agent = query["agent_id"][0]
                    limit = int(query["limit"][0])
                    min_conf = float(query["min_confidence"][0])
                else:
                    req = json.loads(body)
                    agent, limit, min_conf = req["agent_id"], req["limit"], req["min_confidence"]
            except (KeyError, IndexError, ValueError, TypeError):
                self._send(400, b'{"error": "bad request"}')
                return
            payload = owner._results(name, agent, int(limit), float(min_conf))
        self._reply(ep, ep.status, payload)

    def _serve_feedback(self, owner: FakeMemoryServer, body: bytes) -> None:
        """Record first, then the fault: a reset or a hang loses an answer, not the write."""
        ep = owner._step(owner.feedback)
        if ep.status >= 400:  # failed before recording anything
            if self._wait(owner._delay(ep)):
                self._send(ep.status, ep.body or b'{"error": "injected"}')
            return
        status, recorded = owner._record_feedback(self.headers.get("Idempotency-Key"), body)
        if not self._delayed(owner, ep):
            return
        payload = self._injected(ep, b'{"data": {"updates": [{"memory_id": ')
        self._reply(ep, status, recorded if payload is None else payload)

    def _delayed(self, owner: FakeMemoryServer, ep: Endpoint) -> bool:
        """Wait the endpoint's delay, then hang if told to: False when no answer follows."""
        if not self._wait(owner._delay(ep)):
            return False
        if ep.fault == "hang":
            self._wait(None)
            return False
        return True

    @staticmethod
    def _injected(ep: Endpoint, malformed: bytes) -> bytes | None:
        """The endpoint's own body, or a truncated JSON answer for `malformed`, else None."""
        if ep.body is not None:
            return ep.body
        return malformed if ep.fault == "malformed" else None

    def _reply(self, ep: Endpoint, status: int, payload: bytes) -> None:
        """Send the answer, or reset the connection after part of it, as the endpoint says."""
        if ep.fault == "reset":
            self._reset(payload)
        elif ep.stray is not None:
            self._send_with_stray(status, payload, ep.stray)
        else:
            self._send(status, payload)

    def _head(self, status: int, length: int) -> bytes:
        reason = self.responses.get(status, ("",))[0]
        return (
            f"HTTP/1.1 {status} {reason}\r\nServer: fake-memory\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        ).encode("latin-1")

    def _send(self, status: int, payload: bytes) -> None:
        """Status, headers and body in one write, as a real server would."""
        self.wfile.write(self._head(status, len(payload)) + payload)

    def _send_with_stray(self, status: int, payload: bytes, stray: bytes) -> None:
        """The answer, then `stray` as a second write (a second TLS record), one TCP segment."""
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        try:
            self.wfile.write(self._head(status, len(payload)) + payload)
            self.wfile.write(stray)
        finally:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)

    def _reset(self, payload: bytes) -> None:
        """Headers and half the body, then an RST (SO_LINGER 0) instead of the rest."""
        self.wfile.write(self._head(200, len(payload) + 64) + payload[: len(payload) // 2])
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _wait(self, seconds: float | None) -> bool:
        """Sleep (None: forever) unless the client hangs up or the server stops.

        Watching the socket means a client that cancels mid-wait is seen as
        closed at once, so `open_connections` reflects the client promptly.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        stopping = self.server.owner._stopping
        while not stopping.is_set():
            remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if remaining <= 0:
                return True
            readable, _, _ = select.select([self.connection], [], [], remaining)
            if readable:
                try:
                    gone = self.connection.recv(1, socket.MSG_PEEK) == b""
                except ValueError:  # TLS: no MSG_PEEK; record bytes are not a hang-up
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.close_connection = True
                    return False
                # pipelined bytes: not a hang-up; keep waiting without spinning
                time.sleep(min(remaining, 0.001))
        self.close_connection = True
        return False


# -- fixtures ------------------------------------------------------------------
@contextlib.contextmanager
def running_memory_server(**kwargs: Any) -> Iterator[FakeMemoryServer]:
    """Start a FakeMemoryServer for the duration of the block."""
    server = FakeMemoryServer(**kwargs)
    with server:
        yield server


@pytest.fixture(name="memory_server")
def memory_server_fixture() -> Iterator[FakeMemoryServer]:
    """Fixture `memory_server`: a fresh server per test.

    Import `memory_server_fixture` (with `# noqa: F401`) into a test module and
    ask for `memory_server`; the distinct names keep ruff's F811 quiet.
    """
    with running_memory_server() as server:
        yield server


# -- realistic data ------------------------------------------------------------
_ENGLISH = [
    "The customer prefers concise answers and dislikes marketing language.",
    "Deployments to production happen on Tuesdays and Thursdays after the 10:00 UTC standup.",
    "When a refund exceeds 500 EUR, escalate to the billing team and attach the invoice id.",
    "The user is migrating from PostgreSQL 13 to 16 and worries about logical replication lag.",
    "Last week the on-call engineer traced the latency spike to a missing index on orders.sku.",
    "Always answer in British English unless the user writes in another language.",
    "Their staging cluster runs in eu-west-1 with three availability zones.",
]
_CJK = [
    "用户更喜欢简洁的回答，并且希望所有时间都使用北京时间表示。",
    "このプロジェクトでは、レビューの前に必ずユニットテストを実行してください。",
    "고객은 주말에는 연락을 원하지 않으며, 긴급한 경우에만 전화를 허용합니다.",
    "上次部署失败是因为配置文件中的缩进错误，已经在流水线中加入了校验。",
]
_CODE = [
    "Use `retry(max_attempts=3, backoff=0.2)` around calls to the ledger API:\n"
    "```python\nasync with trio.move_on_after(0.2):\n    await ledger.post(entry)\n```",
    "The team's lint config: `ruff check --select E,F,I --line-length 100`.",
    "SQL for the weekly report: SELECT org_id, count(*) FROM events WHERE ts > now() - "
    "interval '7 days' GROUP BY 1 ORDER BY 2 DESC;",
    "fn parse(input: &str) -> Result<Config, Error> { toml::from_str(input).map_err(Error::from) }",
]
_EMOJI = [
    "The user signs off with 🚀 and appreciates a friendly tone 😊.",
    "Status emoji convention: ✅ done, 🚧 in progress, ❌ blocked, 🔥 incident.",
    "Celebrated the v2 launch 🎉🎉 — remember to mention the changelog.",
]
CATEGORIES = ("procedural", "factual", "preference", "behavioral", "episodic")


def make_memories(
    org_id: str, agent_id: str, n: int, *, seed: int = 0, with_optional: bool = True
) -> list[dict[str, Any]]:
    """`n` realistic memory objects (50-800 chars) mixing English, CJK, code and emoji.

    Deterministic for a seed; ids are UUIDv4-shaped. Pass the result to
    `FakeMemoryServer.add_memories`.
    """
    rng = random.Random(seed)
    pools = [_ENGLISH, _CJK, _CODE, _EMOJI]
    out: list[dict[str, Any]] = []
    for _ in range(n):
        target = rng.randint(50, 800)
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < target:
            parts.append(rng.choice(rng.choice(pools)))
        text = " ".join(parts)[:target].strip()
        if len(text) < 50:
            text = (text + " " + _ENGLISH[0])[:target]
        memory: dict[str, Any] = {
            "id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "org_id": org_id,
            "agent_id": agent_id,
            "content": text,
            "category": rng.choice(CATEGORIES),
            "confidence": round(rng.uniform(0.3, 1.0), 3),
        }
        if with_optional:
            day = rng.randint(1, 28)
            memory["created_at"] = f"2025-{rng.randint(1, 12):02d}-{day:02d}T08:30:00Z"
            memory["usefulness"] = round(rng.random(), 3)
            memory["access_count"] = rng.randint(0, 500)
        out.append(memory)
    return out


# -- separate process ----------------------------------------------------------
class MemoryServerProcess:
    """The same server in a child process, for load where sharing the GIL would skew it.

    A thread server in a busy test process only gets the GIL at the
    interpreter's switch interval (5 ms), which swamps millisecond latencies
    and deadlines; a child process keeps its own clock. Control is a line
    protocol on the child's stdin/stdout (`stats` -> one JSON line), so no
    control connection ever shows up in the connection counts; closing stdin
    stops the child, so it cannot outlive the test.
    """

    def __init__(self, proc: subprocess.Popen[str], url: str, token: str) -> None:
        self._proc = proc
        self.url = url
        self.token = token
        self._lock = threading.Lock()

    def source(self, *, pool_size: int = 8) -> MemoryHttpSource:
        return MemoryHttpSource(self.url, self.token, pool_size=pool_size)

    def stats(self) -> dict[str, Any]:
        """Counters: requests (per endpoint), unauthorized, open/accepted connections."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write("stats\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("memory server process exited")
        result: dict[str, Any] = json.loads(line)
        return result

    async def astats(self) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.stats)

    async def settle_open_connections(self, at_most: int, patience: float = 5.0) -> int:
        """Poll until at most `at_most` connections are open; returns the last count."""
        with trio.move_on_after(patience):
            while (await self.astats())["open_connections"] > at_most:  # noqa: ASYNC110
                await trio.sleep(0.01)
        return int((await self.astats())["open_connections"])

    def stop(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@contextlib.contextmanager
def memory_server_process(
    *,
    token: str = DEFAULT_TOKEN,
    hot_latency_ms: float = 0.0,
    cold_latency_ms: float = 0.0,
    jitter_ms: float = 0.0,
    memories: int = 20,
    seed: int = 0,
) -> Iterator[MemoryServerProcess]:
    """Run `python -m ibex.testing.memory_server --control-stdio` for the duration of the block."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable, "-m", "ibex.testing.memory_server", "--port", "0", "--control-stdio",
        "--token", token, "--hot-latency-ms", str(hot_latency_ms),
        "--cold-latency-ms", str(cold_latency_ms), "--jitter-ms", str(jitter_ms),
        "--memories", str(memories), "--seed", str(seed),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if not first.startswith("memory server listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"memory server process did not start: {first!r}")
    server = MemoryServerProcess(proc, first.rsplit(" ", 1)[1].strip(), token)
    try:
        yield server
    finally:
        server.stop()


# -- standalone ----------------------------------------------------------------
def freeze_heap() -> None:
    """For a stand-in run as its own process, once it is built: move its start-up objects
    (modules, the memories, cached answers) out of the cyclic collector's reach. A full
    pass would otherwise scan them all, holding the GIL for tens of milliseconds with
    every request thread waiting: a stall of the stand-in, counted against the daemon's
    branch budgets as a slow memory service."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake memory service on loopback.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--token", default=DEFAULT_TOKEN)
    parser.add_argument("--hot-latency-ms", type=float, default=0.0)
    parser.add_argument("--cold-latency-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--memories", type=int, default=200, help="per demo agent")
    parser.add_argument("--org", default=DEMO_ORG)
    parser.add_argument("--agent", default=DEMO_AGENT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--control-stdio",
        action="store_true",
        help="answer `stats` lines on stdin with JSON on stdout; stop at stdin EOF",
    )
    args = parser.parse_args(argv)

    server = FakeMemoryServer(token=args.token, host=args.host, port=args.port, seed=args.seed)
    server.hot.latency_ms, server.cold.latency_ms = args.hot_latency_ms, args.cold_latency_ms
    server.hot.jitter_ms = server.cold.jitter_ms = args.jitter_ms
    server.add_memories(
        args.org, args.agent, make_memories(args.org, args.agent, args.memories, seed=args.seed)
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with server:
        freeze_heap()
        print(f"memory server listening on http://{args.host}:{server.port}", flush=True)
        if args.control_stdio:
            for line in sys.stdin:
                if line.strip() == "stats":
                    stats = {
                        "requests": server.requests,
                        "unauthorized": server.unauthorized,
                        "open_connections": server.open_connections,
                        "accepted_connections": server.accepted_connections,
                    }
                    print(json.dumps(stats), flush=True)
        else:
            done.wait()


if __name__ == "__main__":
    main()
