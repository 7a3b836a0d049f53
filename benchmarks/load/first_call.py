"""The first calls after a start: does the call right after Health says SERVING get every branch?

The issue's done-when check: 5 starts in a row with Redis and the memory service,
and the first call after Health reports SERVING answered with `success` from all
three branches (directive, hot, cold) every time. Each start runs a fresh
`python -m ibex serve` of checkout `--root` (default: this one) against one Redis
and one memory stand-in shared by all starts; Health is polled until SERVING,
then the first `--calls` AssembleContext calls are sent one after another with
the default branch budgets, each naming the seeded directive version.

Run: ``python -m benchmarks.load.first_call [--starts 5] [--calls 5] [--root DIR]``
(`--root` a worktree of another commit, e.g. `git worktree add /tmp/main-old main`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks import aio
from benchmarks.load.driver import METHOD, build_requests
from benchmarks.load.stack import ROOT, Stack
from ibex.testing.grpcio_stubs import context_pb2 as pb

HEALTH = "/grpc.health.v1.Health/Check"
SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING}
BRANCHES = ("directive", "hot", "cold")


async def wait_serving(channel: grpc.aio.Channel, patience: float = 30.0) -> float:
    """Poll Health (service "") until SERVING; seconds waited."""
    check = channel.unary_unary(HEALTH)
    t0 = time.monotonic()
    while time.monotonic() - t0 < patience:
        try:
            if await check(b"", timeout=1.0) == SERVING:
                return time.monotonic() - t0
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.01)
    raise RuntimeError(f"health not SERVING after {patience}s")


async def one_start(stack: Stack, root: Path, calls: int, salt: int) -> dict[str, Any]:
    """A fresh daemon; its first `calls` calls after SERVING, in order."""
    requests = build_requests(stack.tenants, calls, salt, versions=True)
    rows = []
    with stack.daemon(1, root) as daemon:
        async with grpc.aio.insecure_channel(daemon.addr) as channel:
            waited = await wait_serving(channel)
            call = channel.unary_unary(METHOD)
            for request in requests:
                raw = await call(request, timeout=2.0)
                resp = pb.AssembleContextResponse.FromString(raw)
                rows.append(
                    {
                        b.source: b.status if b.status == "success" else f"{b.status}: {b.detail}"
                        for b in resp.branches
                    }
                )
    full = [all(r.get(s) == "success" for s in BRANCHES) for r in rows]
    return {"waited_s": round(waited, 3), "first_full": full[0], "full": sum(full), "calls": rows}


async def measure(root: Path, starts: int, calls: int) -> list[dict[str, Any]]:
    with Stack() as stack:
        return [await one_start(stack, root, calls, salt) for salt in range(1, starts + 1)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--calls", type=int, default=5, help="calls per start, after SERVING")
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose daemon runs")
    p.add_argument("--json", action="store_true", help="print every call's branches as JSON")
    args = p.parse_args(argv)
    runs = aio.run(measure(args.root.resolve(), args.starts, args.calls))
    if args.json:
        print(json.dumps(runs, indent=1))
    first = sum(r["first_full"] for r in runs)
    total = sum(r["full"] for r in runs)
    print(
        f"daemon from {args.root}: first call after SERVING with 3 successes in "
        f"{first} of {len(runs)} starts; {total} of {len(runs) * args.calls} of the first "
        f"{args.calls} calls per start"
    )
    for i, r in enumerate(runs, 1):
        misses = {
            n: {s: st for s, st in c.items() if st != "success"}
            for n, c in enumerate(r["calls"], 1)
            if any(st != "success" for st in c.values())
        }
        print(f"  start {i}: {r['full']}/{len(r['calls'])} complete; misses by call: {misses}")


if __name__ == "__main__":
    main()
