"""The load generator: grpc.aio with pre-serialized requests, open- and closed-loop.

The driver shares two cores with the daemon, so a call costs it as little as
possible: requests are serialized before the clock starts, the channel passes
bytes through (no serializer), and only the two response fields the report
needs are read. Its own CPU is measured and reported next to the daemon's.

Open-loop latency counts from each call's *scheduled* send time, so a driver
or daemon that falls behind shows up as latency (no coordinated omission);
the send lag (actual minus scheduled send) is reported apart so a slow driver
is told from a slow daemon.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from dataclasses import dataclass, field

import grpc

from ibex.testing.grpcio_stubs import context_pb2 as pb

METHOD = "/ibex.context.v1.ContextAssemblyService/AssembleContext"
MODELS = ("gpt-4o", "claude-sonnet-4-5")
DEADLINE_S = 0.045

_HISTORY = (
    (
        "user",
        "Our checkout service started returning 502s around 02:10 UTC. The on-call "
        "engineer rolled back at 02:40. Can you help me understand what happened?",
    ),
    (
        "assistant",
        "Sure. Please share the error-rate graph and the deploy log. 一般的には、"
        "接続プールの設定変更かデータベースのフェイルオーバーが原因です。",
    ),
    (
        "user",
        "Here is the pool config we shipped:\n```yaml\npool:\n  max_size: 64\n  "
        "idle_timeout: 30s\n  health_check: 5s\n```\nThe DB failover happened at 02:08 🔥.",
    ),
)
_QUERIES = (
    "why did checkout return 502 after the pool change",
    "데이터베이스 장애 조치 이후 연결 풀 동작",
    "rollback procedure for the payments deploy",
    "how do we escalate refunds above 500 EUR",
)


def build_requests(
    tenants: list[tuple[str, str]], n: int, salt: int, *, versions: bool = False
) -> list[bytes]:
    """n serialized requests: tenants and models alternating, 4 history turns, the last unique.

    The last turn differs per request (as a new user turn does), so the daemon's
    token cache cannot turn every count into a hit. With `versions`, each request
    names the directive version the proxy expects (what the stack seeded).
    """
    out = []
    for i in range(n):
        t = i % len(tenants)
        org, agent = tenants[t]
        query = _QUERIES[(i // 2) % len(_QUERIES)]
        msg = pb.AssembleContextRequest(
            agent_id=agent,
            org_id=org,
            session_id=f"bench-{salt}-{i % 97}",
            query=query,
            model=MODELS[i % 2],
            recent_messages=[pb.Message(role=r, content=c) for r, c in _HISTORY]
            + [pb.Message(role="user", content=f"{query}? (turn {salt}-{i})")],
            request_id=str(uuid.UUID(int=(salt << 32) + i, version=4)),
            directive_version_id=directive_version(t) if versions else "",
        )
        out.append(msg.SerializeToString())
    return out


def directive_version(tenant: int) -> str:
    """The version_id the stack seeds for tenant i's directive."""
    return f"00000000-0000-4000-8000-{tenant:012x}"


def fixed_rate(*phases: tuple[float, float]) -> list[float]:
    """Send times (s from start) for consecutive (rate, duration) phases."""
    out: list[float] = []
    t0 = 0.0
    for rate, duration in phases:
        out += [t0 + i / rate for i in range(int(rate * duration))]
        t0 += duration
    return out


@dataclass
class Calls:
    """Per-call records of one run, in schedule order."""

    scheduled: list[float] = field(default_factory=list)  # seconds since run start
    lag: list[float] = field(default_factory=list)  # actual send - scheduled
    latency: list[float] = field(default_factory=list)  # done - scheduled
    status: list[str] = field(default_factory=list)
    memories: list[int] = field(default_factory=list)  # -1 when not OK
    level: list[str] = field(default_factory=list)
    driver_cpu_s: float = 0.0
    wall_s: float = 0.0


class Driver:
    """A pool of channels (separate HTTP/2 connections, so SO_REUSEPORT spreads them)."""

    def __init__(self, addr: str, channels: int = 4, token: str | None = None) -> None:
        # `token`: sent as `authorization: Bearer ...` on every call (a daemon with auth on).
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.channels = [
            grpc.aio.insecure_channel(
                addr, options=[("grpc.use_local_subchannel_pool", 1), ("bench.channel", i)]
            )
            for i in range(channels)
        ]
        self.calls = [c.unary_unary(METHOD) for c in self.channels]
        self._rr = itertools.cycle(self.calls)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    async def ready(self) -> None:
        for c in self.channels:
            await asyncio.wait_for(c.channel_ready(), 10)

    async def one(self, request: bytes, deadline_s: float = DEADLINE_S) -> tuple[str, int, str]:
        """(status name, memories_included, degradation_level) of one call."""
        try:
            raw = await next(self._rr)(request, timeout=deadline_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, -1, ""
        resp = pb.AssembleContextResponse.FromString(raw)
        return "OK", resp.memories_included, resp.degradation_level

    async def open_loop(
        self, requests: list[bytes], schedule: list[float], deadline_s: float = DEADLINE_S
    ) -> Calls:
        """Send call i at `schedule[i]` s after start; latency counts from that time."""
        loop = asyncio.get_running_loop()
        n = len(schedule)
        rec = Calls(
            scheduled=schedule,
            lag=[0.0] * n,
            latency=[0.0] * n,
            status=[""] * n,
            memories=[-1] * n,
            level=[""] * n,
        )

        async def call(i: int, due: float) -> None:
            rec.lag[i] = loop.time() - due
            st, mem, lvl = await self.one(requests[i % len(requests)], deadline_s)
            rec.latency[i] = loop.time() - due
            rec.status[i], rec.memories[i], rec.level[i] = st, mem, lvl

        cpu0 = os.times()
        start = loop.time() + 0.02
        tasks = []
        for i in range(n):
            due = start + schedule[i]
            delay = due - loop.time()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(call(i, due)))
        await asyncio.gather(*tasks)
        rec.wall_s = loop.time() - start
        cpu1 = os.times()
        rec.driver_cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        return rec

    async def closed_loop(
        self, requests: list[bytes], callers: int, duration: float, deadline_s: float = DEADLINE_S
    ) -> Calls:
        """`callers` concurrent callers, each sending its next call when the last returns."""
        loop = asyncio.get_running_loop()
        rec = Calls()
        counter = itertools.count()
        start = loop.time()
        stop = start + duration

        async def caller() -> None:
            while (t0 := loop.time()) < stop:
                i = next(counter)
                st, mem, lvl = await self.one(requests[i % len(requests)], deadline_s)
                rec.scheduled.append(t0 - start)
                rec.lag.append(0.0)
                rec.latency.append(loop.time() - t0)
                rec.status.append(st)
                rec.memories.append(mem)
                rec.level.append(lvl)

        cpu0 = os.times()
        await asyncio.gather(*(caller() for _ in range(callers)))
        rec.wall_s = loop.time() - start
        cpu1 = os.times()
        rec.driver_cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        return rec


async def warm_up(drivers: list[Driver], tenants: list[tuple[str, str]], rate: float) -> int:
    """Connect every driver, then send each a second of calls at `rate` (connections, caches,
    first-call imports) before anything is measured. Returns the last request salt used."""
    for d in drivers:
        await d.ready()
    salt = 0
    for d in drivers:
        salt += 1
        await d.open_loop(
            build_requests(tenants, 400, salt, versions=True), fixed_rate((rate, 1.0)), 1.0
        )
    return salt


async def health(driver: Driver, request: bytes) -> dict[str, object]:
    """One normal call with a generous deadline: does the daemon still return memories?"""
    t0 = time.perf_counter()
    st, mem, lvl = await driver.one(request, deadline_s=2.0)
    return {
        "status": st,
        "memories_included": mem,
        "degradation_level": lvl,
        "latency_ms": round((time.perf_counter() - t0) * 1000, 2),
        "ok": st == "OK" and mem > 0,
    }
