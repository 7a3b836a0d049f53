"""Connections opened, and client CPU, per cold call cut at the wall: drained or closed.

The daemon cuts a slow cold call at the retrieval wall. Without a drain its
connection is closed (its state is unknown to a pool that does not read on),
so the next call connects anew; with the pool's drain (`ibex.sources.http_pool`)
the rest of the answer is read in a pool-owned task and the connection is
reused. This drives cold calls at a fixed rate (open loop) against the memory
stand-in in a child process (its CPU is not counted here), each cut by a cancel
scope at `--cut-ms` while the stand-in sleeps `--cold-ms` before answering, and
counts the connections the stand-in accepted per 100 calls after a warm-up
(each run starts a fresh source), and this process's CPU (user + system) per
call. The modes alternate, `--repeats` times each, and
the medians are printed (the machine is shared and noisy).

Run: ``.venv/bin/python -m benchmarks.memory_cut`` (defaults: 100 calls/s,
cold +100 ms, cut at 40 ms, 300 calls per run, 5 repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio

from ibex.sources.memory_http import MemoryHttpSource
from ibex.testing.memory_server import DEFAULT_TOKEN, DEMO_AGENT, DEMO_ORG, memory_server_process

MODES = ("close", "drain")


async def _run(url: str, stats: Any, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One run: `args.calls` cut cold calls at `args.rate` per second."""
    source = MemoryHttpSource(url, DEFAULT_TOKEN, pool_size=args.pool)
    cut = 0
    errors = 0

    async def one() -> None:
        nonlocal cut, errors
        with trio.move_on_after(args.cut_ms / 1000) as scope:
            try:
                await source.cold(DEMO_ORG, DEMO_AGENT, "deploy", limit=20, min_confidence=0.0)
            except Exception:  # a refused or failed call is counted, not fatal
                errors += 1
        cut += scope.cancelled_caught

    async def rate(calls: int) -> None:
        interval = 1.0 / args.rate
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(calls):
                await trio.sleep_until(start + i * interval)
                nursery.start_soon(one)

    async def drive() -> tuple[float, int]:
        await rate(args.warmup)  # the pool grows to its working size: not counted
        before = (await stats())["accepted_connections"]
        cpu0 = time.process_time()
        await rate(args.calls)
        cpu = time.process_time() - cpu0
        return cpu, (await stats())["accepted_connections"] - before

    if mode == "drain":
        async with source:  # opens the nursery the drains run in
            cpu, opened = await drive()
    else:
        await source.open()  # no nursery: a cut call's connection is closed
        try:
            cpu, opened = await drive()
        finally:
            await source.aclose()
    return {
        "opened_per_100": opened * 100 / args.calls,
        "cpu_us_per_call": cpu / args.calls * 1e6,
        "cut": cut - args.warmup,
        "errors": errors,
    }


async def _measure(server: Any, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]  # alternate which goes first
        for mode in order:
            row = await _run(server.url, server.astats, mode, args)
            runs[mode].append(row)
            print(
                f"  {mode:>5}: {row['opened_per_100']:6.1f} connections per 100 calls, "
                f"{row['cpu_us_per_call']:7.1f} us CPU per call, "
                f"{int(row['cut'])} cut, {int(row['errors'])} errors",
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0, help="calls per second")
    p.add_argument("--calls", type=int, default=300, help="calls per run")
    p.add_argument("--warmup", type=int, default=100, help="calls before each run, not counted")
    p.add_argument("--cold-ms", type=float, default=100.0, help="the stand-in's cold latency")
    p.add_argument("--cut-ms", type=float, default=40.0, help="each call's cancel scope")
    p.add_argument("--pool", type=int, default=32, help="pool size (the daemon's default)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    with memory_server_process(cold_latency_ms=args.cold_ms, memories=20) as server:
        print(
            f"{args.calls} cold calls at {args.rate:g}/s, cold +{args.cold_ms:g} ms, "
            f"cut at {args.cut_ms:g} ms, pool {args.pool}; modes alternate"
        )
        runs = trio.run(_measure, server, args)
    print("medians:")
    for mode in MODES:
        opened = statistics.median(r["opened_per_100"] for r in runs[mode])
        cpu = statistics.median(r["cpu_us_per_call"] for r in runs[mode])
        print(f"  {mode:>5}: {opened:6.1f} connections per 100 cut calls, {cpu:7.1f} us CPU/call")


if __name__ == "__main__":
    main()
