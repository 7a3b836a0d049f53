"""Wakeups and loop crossings per answer: where the event loops' share of the CPU goes.

An in-process daemon (real redis-server, the memory stand-in with hot 2 ms and
cold 8 ms, directive versions sent) answers sequential calls from a grpcio
client in a thread; a Trio instrument and counting wrappers report, per answer:

- Trio task steps (each is a scheduler wakeup of some task) and epoll waits;
- asyncio callbacks run by trio-asyncio (grpclib and h2 live there);
- crossings between the loops (`trio_as_aio`: asyncio into Trio; `aio_as_trio`:
  Trio into asyncio, e.g. redis-py).

Counts are deterministic enough to compare one change with the next; they are
not timings. Run: ``python -m benchmarks.wakeups [--calls N] [--no-versions] [--no-cache]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import trio
import trio_asyncio
import trio_asyncio._handles

from benchmarks.load.driver import METHOD, build_requests
from benchmarks.load.stack import ROOT, Stack, free_port
from ibex.config import load_settings
from ibex.service.root import make_daemon
from ibex.testing.grpcio_stubs import context_pb2 as pb

RESULTS = Path(__file__).resolve().parent / "results" / "wakeups.json"


class Counts(trio.abc.Instrument):
    def __init__(self) -> None:
        self.c: Counter[str] = Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.c["trio_task_steps"] += 1

    def before_io_wait(self, timeout: float) -> None:
        self.c["trio_io_waits"] += 1


def counting(counter: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def install(counts: Counts) -> None:
    c = counts.c
    trio_asyncio.trio_as_aio = counting(c, "crossings_into_trio", trio_asyncio.trio_as_aio)
    trio_asyncio.aio_as_trio = counting(c, "crossings_into_asyncio", trio_asyncio.aio_as_trio)
    for cls in (asyncio.Handle, trio_asyncio._handles.AsyncHandle):
        cls._run = counting(c, "asyncio_callbacks", cls._run)  # type: ignore[method-assign]


async def measure(stack: Stack, calls: int, versions: bool, cache: bool) -> dict[str, Any]:
    port = free_port()
    extra = {} if cache else {"IBEX_CONTEXT_DIRECTIVE_CACHE_ENTRIES": "0"}
    env = stack.env(port, ROOT, **extra)
    settings = load_settings({k: v for k, v in env.items() if k.startswith("IBEX_CONTEXT_")})
    daemon = make_daemon(settings)
    counts = Counts()
    install(counts)
    requests = build_requests(stack.tenants, calls + 50, salt=7, versions=versions)

    def client() -> tuple[int, int]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)
            for r in requests[:50]:  # warm-up: connections, caches
                call(r, timeout=1.0)
            start = dict(counts.c)
            ok = sum(
                1
                for r in requests[50:]
                if pb.AssembleContextResponse.FromString(call(r, timeout=1.0)).degradation_level
                == "L0"
            )
            counts.c["_start"] = 0
            for k, v in start.items():
                counts.c[k] -= v
            return ok, calls

    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        trio.lowlevel.add_instrument(counts)
        ok, n = await trio.to_thread.run_sync(client)
        trio.lowlevel.remove_instrument(counts)
        nursery.cancel_scope.cancel()
    per = {k: round(v / n, 2) for k, v in sorted(counts.c.items()) if not k.startswith("_")}
    # `full_quality`: answers with every branch in (counts of failing calls mean little).
    return {"calls": n, "full_quality": ok, "versions": versions, "cache": cache, "per_answer": per}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--no-versions", action="store_true")
    p.add_argument("--no-cache", action="store_true", help="directive cache off (every GET)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with Stack() as stack:
        out = trio.run(measure, stack, args.calls, not args.no_versions, not args.no_cache)
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
