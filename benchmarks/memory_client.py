"""CPU per memory-service call: the daemon's own HTTP pool against httpx2, both on Trio.

Every answer makes two memory calls (hot GET, cold POST), so the client's CPU
per call is paid twice per answer. Both clients talk to the same loopback
memory stand-in (a child process, so its CPU is not counted here) with 20
memories per answer, decode the body with the same msgspec decoder, and are
driven by 1 caller (pure per-call cost) and by 8 concurrent callers (the
pool under contention). The figure is this process's CPU time (user + system)
per completed call, the median of the repeats; "decode only" is the msgspec
decode of the same body, included in both.

Run: ``.venv/bin/python -m benchmarks.memory_client`` (prints a table, writes
``benchmarks/results/memory_client.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import httpx2
import msgspec
import trio

from ibex.assembly.structs import MemoryHit
from ibex.sources.memory_http import MemoryHttpSource
from ibex.sources.memory_schema import decode_hits
from ibex.testing.memory_server import DEFAULT_TOKEN, DEMO_AGENT, DEMO_ORG, memory_server_process

RESULTS = Path(__file__).resolve().parent / "results" / "memory_client.json"
Call = Callable[[int], Awaitable[list[MemoryHit]]]


class _SearchBody(msgspec.Struct):
    agent_id: str
    query: str
    limit: int
    min_confidence: float


class Httpx2Memory:
    """The source's former httpx2 call path, kept here only to be measured against."""

    def __init__(self, url: str, token: str, pool_size: int) -> None:
        self.client = httpx2.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            limits=httpx2.Limits(
                max_connections=pool_size,
                max_keepalive_connections=pool_size,
                keepalive_expiry=5.0,
            ),
            timeout=httpx2.Timeout(2.0),
            follow_redirects=False,
            trust_env=False,
        )
        self.encoder = msgspec.json.Encoder()

    async def call(self, branch: Literal["hot", "cold"]) -> list[MemoryHit]:
        if branch == "hot":
            params = {"agent_id": DEMO_AGENT, "limit": "20", "min_confidence": "0.0"}
            kw: dict[str, Any] = {"params": params}
            method, path = "GET", "/v1/memories/hot"
        else:
            body = _SearchBody(agent_id=DEMO_AGENT, query="deploy", limit=20, min_confidence=0.0)
            kw = {
                "content": self.encoder.encode(body),
                "headers": {"Content-Type": "application/json"},
            }
            method, path = "POST", "/v1/memories/search"
        async with self.client.stream(method, path, **kw) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
        return decode_hits(bytes(data), branch, limit=20)


async def _drive(call: Call, calls: int, callers: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for `calls` calls spread over `callers` tasks."""
    per_caller = calls // callers

    async def caller(offset: int) -> None:
        for i in range(per_caller):
            hits = await call(i + offset)
            if len(hits) != 20:
                raise RuntimeError(f"expected 20 hits, got {len(hits)}")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for c in range(callers):
            nursery.start_soon(caller, c)
    return time.process_time() - cpu0, time.perf_counter() - wall0


async def _measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for callers in args.callers:
        for name in ("httpx2", "http_pool"):
            pool_size = max(1, callers)
            if name == "httpx2":
                h = Httpx2Memory(url, DEFAULT_TOKEN, pool_size)

                async def hx(i: int, h: Httpx2Memory = h) -> list[MemoryHit]:
                    return await h.call("hot" if i % 2 == 0 else "cold")

                call: Call = hx
                close: Callable[[], Awaitable[None]] = h.client.aclose
            else:
                src = MemoryHttpSource(url, DEFAULT_TOKEN, pool_size=pool_size)
                await src.open()

                async def ours(i: int, src: MemoryHttpSource = src) -> list[MemoryHit]:
                    if i % 2 == 0:
                        return await src.hot(DEMO_ORG, DEMO_AGENT, limit=20, min_confidence=0.0)
                    return await src.cold(
                        DEMO_ORG, DEMO_AGENT, "deploy", limit=20, min_confidence=0.0
                    )

                call, close = ours, src.aclose
            try:
                await _drive(call, args.calls // 4, callers)  # warm-up, connections opened
                runs = [await _drive(call, args.calls, callers) for _ in range(args.repeats)]
            finally:
                await close()
            done = (args.calls // callers) * callers
            cpu_us = statistics.median(cpu for cpu, _ in runs) / done * 1e6
            wall_us = statistics.median(wall for _, wall in runs) / done * 1e6
            rows.append(
                {
                    "client": name,
                    "callers": callers,
                    "calls": done,
                    "cpu_us_per_call": round(cpu_us, 1),
                    "wall_us_per_call": round(wall_us, 1),
                }
            )
            print(
                f"{name:>10} {callers:>7} {cpu_us:>16.1f} {wall_us:>17.1f}",
                flush=True,
            )
    return rows


def _decode_us(url: str) -> float:
    """The msgspec decode of one 20-memory answer, which both clients include."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/v1/memories/hot?agent_id={DEMO_AGENT}&limit=20&min_confidence=0.0",
        headers={"Authorization": f"Bearer {DEFAULT_TOKEN}"},
    )
    with urllib.request.urlopen(req) as resp:
        body = resp.read()
    n = 2000
    t0 = time.process_time()
    for _ in range(n):
        decode_hits(body, "hot")
    return (time.process_time() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--callers", type=int, nargs="+", default=[1, 8])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with memory_server_process(memories=20) as server:
        print(f"{'client':>10} {'callers':>7} {'CPU us per call':>16} {'wall us per call':>17}")
        rows = trio.run(_measure, server.url, args)
        decode = _decode_us(server.url)
    print(f"decode only (msgspec, 20 memories): {decode:.1f} us per call")
    out = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "command": " ".join(["python -m benchmarks.memory_client", *sys.argv[1:]]),
        "rows": rows,
        "decode_us_per_call": round(decode, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
