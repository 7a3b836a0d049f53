"""Directive misses in a burst: five agents' calls together, after the cache expired.

A warm daemon (one worker, real redis-server, the memory stand-in at hot 2 ms,
cold 8 ms). Each round waits past the directive cache's TTL (1 s by default;
the requests name no directive version, so the TTL is what serves them), then
sends `--burst` AssembleContext calls for as many different agents at once:
every one misses the cache, and each call's directive branch must read Redis
within its 5 ms. Then the same number of rounds of one call at a time, for
comparison. Per round: each call's directive status and branch latency (ms);
in all: how many directive branches succeeded, and the Redis commands the
daemon sent per round (INFO commandstats).

With `--root` (repeatable), another checkout's daemon (e.g. a worktree of main)
is measured the same way, the checkouts alternating per repeat, for before/after
figures.

Target: at least 49 of 50 bursts' directives `success`; single calls 10 of 10.

With `--probe`, `burst_probe/sitecustomize.py` marks each step of each call's
directive read in the daemon: each burst's timeline (ms and Trio scheduler passes)
and the passes from a call's decode, and from its branch's start, to its
directive branch's end are printed.

Run: ``python -m benchmarks.load.bursts [--rounds 10] [--burst 5] [--repeats 1] [--root DIR]
[--probe]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks import aio
from benchmarks.load.deadlines import warmed_run
from benchmarks.load.stack import ROOT, Stack
from ibex.testing.grpcio_stubs import context_pb2 as pb

PROBE = Path(__file__).resolve().parent / "burst_probe"
PAUSE = 1.2  # past the directive cache's 1 s TTL
DEADLINE = 1.0  # the caller's; the directive branch's own 5 ms is what is measured


def request(org: str, agent: str, n: int) -> bytes:
    """A small AssembleContext for one agent, naming no directive version (the TTL serves)."""
    return pb.AssembleContextRequest(
        org_id=org,
        agent_id=agent,
        session_id=f"burst-{n}",
        query="why did checkout return 502 after the pool change",
        model="gpt-4o",
        recent_messages=[pb.Message(role="user", content=f"what happened? ({n})")],
        request_id=str(uuid.UUID(int=n, version=4)),
    ).SerializeToString()


async def one(call: Any, raw: bytes) -> tuple[str, float]:
    """(directive status, its branch latency in ms) of one call; the gRPC code if it failed."""
    try:
        reply = await call(raw, timeout=DEADLINE)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, -1.0
    resp = pb.AssembleContextResponse.FromString(reply)
    for b in resp.branches:
        if b.source == "directive":
            return b.status, b.latency_ms
    return "missing", -1.0


def redis_commands(stack: Stack) -> int:
    """Commands the Redis server has run but INFO (which this asks with), from INFO
    commandstats: a round's difference is the round trips' commands the daemon sent."""
    total = 0
    for line in stack.redis.command("INFO", "commandstats").decode().splitlines():
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info:"):
            total += int(line.split("calls=", 1)[1].split(",", 1)[0])
    return total


async def rounds(
    stack: Stack, root: Path, n_rounds: int, burst: int, probe: bool = False
) -> dict[str, Any]:
    """`n_rounds` bursts of `burst` calls, then `n_rounds` single calls, on a warm daemon."""
    out: dict[str, Any] = {"root": str(root), "bursts": [], "singles": []}
    env: dict[str, str] = {}
    trace: Path | None = None
    if probe:
        trace = Path(tempfile.mkdtemp(prefix="ibex-bursts-")) / "probe.json"
        env = {"PYTHONPATH": f"{PROBE}:{root}", "IBEX_BURST_PROBE_OUT": str(trace)}
    with stack.daemon(1, root, **env) as daemon:
        async with warmed_run(stack, daemon, 1.5) as run:
            calls = run.driver.calls
            n = 0
            for _ in range(n_rounds):
                await asyncio.sleep(PAUSE)
                raws = []
                for org, agent in stack.tenants[:burst]:
                    n += 1
                    raws.append(request(org, agent, n))
                before = redis_commands(stack)
                t0 = time.perf_counter() * 1000.0
                got = await asyncio.gather(
                    *(one(calls[i % len(calls)], r) for i, r in enumerate(raws))
                )
                t1 = time.perf_counter() * 1000.0
                out["bursts"].append(
                    {"calls": got, "redis": redis_commands(stack) - before, "window": (t0, t1)}
                )
            for i in range(n_rounds):
                await asyncio.sleep(PAUSE)
                org, agent = stack.tenants[i % burst]
                n += 1
                out["singles"].append(await one(calls[0], request(org, agent, n)))
    if trace is not None and trace.exists():
        out["probe"] = json.loads(trace.read_text())
    return out


def passes_per_read(res: dict[str, Any]) -> dict[str, list[int]]:
    """Per burst call: the Trio scheduler passes from its decode, and from its directive
    branch's start, to that branch's end (a branch answered from the cache has none)."""
    out: dict[str, list[int]] = {"decoded": [], "branch": []}
    for b in res["bursts"]:
        t0, t1 = b["window"]
        marks: dict[tuple[str, str], int] = {}
        for t, agent, step, n in res["probe"]["events"]:
            if t0 <= t <= t1 and (agent, step) not in marks:
                marks[agent, step] = n
        for (agent, step), n in marks.items():
            if step == "landed directive" or step == "branch end":
                continue
            if step == "decoded":
                end = marks.get((agent, "branch end"), marks.get((agent, "landed directive")))
                if end is not None:
                    out["decoded"].append(end - n)
            if step == "branch start" and (agent, "branch end") in marks:
                out["branch"].append(marks[agent, "branch end"] - n)
    return out


def timelines(res: dict[str, Any]) -> str:
    """Per burst and agent, each probed step's time (ms) from the burst's first decode,
    and the Trio task steps longer than 0.2 ms within the burst."""
    probe = res.get("probe")
    if not probe:
        return ""
    lines = [f"  task steps in all: {probe['task_steps']}"]
    spans = passes_per_read(res)
    if spans:
        lines.append(
            "  scheduler passes per call, median (max): decode -> directive branch ends "
            f"{statistics.median(spans['decoded']):g} ({max(spans['decoded'])}), "
            f"branch start -> end {statistics.median(spans['branch']):g} "
            f"({max(spans['branch'])})"
        )
    for i, b in enumerate(res["bursts"], 1):
        t0, t1 = b["window"]
        mine = [e for e in probe["events"] if t0 <= e[0] <= t1]
        if not mine:
            continue
        start = min(e[0] for e in mine if e[2] == "decoded")
        lines.append(f"  burst {i} (step ms/scheduler pass, from the first decode):")
        first = min(e[3] for e in mine)
        for agent in dict.fromkeys(e[1] for e in mine):
            cells = " | ".join(
                f"{step} {t - start:.2f}/{n - first}" for t, a, step, n in mine if a == agent
            )
            lines.append(f"    {agent}: {cells}")
        long_steps = [s for s in probe["steps"] if t0 <= s[0] <= t1]
        cells = ", ".join(
            f"{s[0] - start:.2f}+{s[1]:.2f} (CPU {s[2]:.2f}) {s[3]}" for s in long_steps
        )
        lines.append(f"    long task steps (start+ms): {cells}")
    return "\n".join(lines)


def report(res: dict[str, Any]) -> str:
    lines = [f"daemon from {res['root']}"]
    latencies = []
    for i, b in enumerate(res["bursts"], 1):
        cells = ", ".join(f"{s} {ms:.1f}" for s, ms in b["calls"])
        lines.append(f"  burst {i:2d}: {cells}  (redis commands {b['redis']})")
        latencies += [ms for s, ms in b["calls"] if ms >= 0]
    statuses = Counter(s for b in res["bursts"] for s, _ in b["calls"])
    total = sum(statuses.values())
    med = statistics.median(latencies) if latencies else float("nan")
    lines.append(
        f"  bursts: directive success {statuses.get('success', 0)} of {total} "
        f"{dict(statuses)}; median branch latency {med:.1f} ms"
    )
    singles = Counter(s for s, _ in res["singles"])
    cells = ", ".join(f"{s} {ms:.1f}" for s, ms in res["singles"])
    lines.append(f"  singles: {cells}")
    lines.append(
        f"  singles: directive success {singles.get('success', 0)} of {len(res['singles'])}"
    )
    return "\n".join(lines)


async def measure_all(
    roots: Sequence[Path], repeats: int, n_rounds: int, burst: int, probe: bool = False
) -> list[dict[str, Any]]:
    out = []
    with Stack(n_tenants=burst) as stack:
        for i in range(repeats):
            for root in roots if i % 2 == 0 else list(reversed(roots)):
                res = await rounds(stack, root, n_rounds, burst, probe)
                print(report(res), flush=True)
                if probe:
                    print(timelines(res), flush=True)
                out.append(res)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--burst", type=int, default=5, help="calls (and agents) per burst")
    p.add_argument("--repeats", type=int, default=1, help="runs per checkout, alternated")
    p.add_argument(
        "--root", type=Path, action="append", default=[], help="another checkout (repeatable)"
    )
    p.add_argument("--probe", action="store_true", help="time each step (burst_probe)")
    args = p.parse_args(argv)
    roots = [ROOT, *(root.resolve() for root in args.root)]
    aio.run(measure_all(roots, args.repeats, args.rounds, args.burst, args.probe))


if __name__ == "__main__":
    main()
