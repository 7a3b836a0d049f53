"""A deploy under load: SIGHUP to a 2-worker supervisor while a proxy calls at 100 rps.

The proxy is a grpc.aio channel with gRPC's round_robin over the two per-worker
ports (IBEX_CONTEXT_WORKER_PORT_BASE), the caller deadline the proxy uses
(45 ms), requests over the stack's tenants naming their directive versions;
real redis-server and the memory stand-in behind the daemon. Each run:
start the daemon, warm it (connections, caches) for `--warm` seconds, send
calls open-loop at `--rate` for `--before` seconds, SIGHUP the supervisor
without pausing the calls, keep calling until the supervisor logs
`reload_done`, then `--after` seconds more.

Reported per run and as the median over runs (targets, never asserted):
- failed calls (any status but OK), before, during and after the reload: 0;
- degraded share: answers below full quality (level other than L0, or a
  retrieval branch that did not succeed) in the `--before` seconds before the
  SIGHUP versus from the SIGHUP to the end: no higher;
- worker pids before and after: every one replaced;
- directive reads on a call's path (answers whose directive was no cache hit), before
  and since: a new worker whose cache starts cold reads once per agent;
- each failed or degraded call since the SIGHUP, with the reload's state then;
- the reload's duration and the latency percentiles of each phase.

Run: ``python -m benchmarks.load.reload [--runs 3] [--rate 100] [--control 10] [--root DIR]``
(JSON lines on stdout, a summary of the reload runs at the end). On a busy host the 45 ms
deadline fails calls whatever the daemon does: `--control` runs the same calls without
a SIGHUP before each run, so the reload's own failures can be told apart, and `--root`
runs another checkout's daemon (the benchmark's code stays this one's), so two versions
are compared in the same machine state by alternating runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import os
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks import aio
from benchmarks.load.driver import DEADLINE_S, METHOD, build_requests
from benchmarks.load.report import FULL_QUALITY, percentile
from benchmarks.load.stack import ROOT, Daemon, Stack, listeners
from ibex.testing.grpcio_stubs import context_pb2 as pb

ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
SLOW_MS = 30.0  # `--calls-out` lists calls slower than this besides the failed ones
RELOAD_LIMIT_S = 120.0  # a reload not done by then ends the run (reported, not waited for)


def free_port_pair() -> int:
    """The first of two consecutive loopback ports that were both free a moment ago."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Record:
    sent: float  # scheduled send, seconds from the first measured call
    status: str = ""
    degraded: bool = False
    worker: str = ""
    latency_ms: float = 0.0
    misses: tuple[str, ...] = ()  # "source:status" of each branch that did not succeed
    directive_read: bool = False  # its directive was read from Redis on its path (no cache hit)
    detail: str = ""  # a failed call's status message


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    control_s: float | None = None  # a control run: no SIGHUP, this long a "reload" window
    sighup_at: float = 0.0
    done_at: float | None = None
    pids_before: list[int] = field(default_factory=list)
    pids_after: list[int] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)
    wall_start: float = 0.0  # time.time() at the first measured call's schedule origin
    timeline: list[tuple[float, str, object]] = field(default_factory=list)
    niced: set[int] = field(default_factory=set)


def degraded(resp: pb.AssembleContextResponse) -> bool:
    if resp.degradation_level != FULL_QUALITY:
        return True
    return any(b.status != "success" for b in resp.branches)


async def one(call: Any, request: bytes, rec: Record, due: float, deadline_s: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        c = call(request, timeout=deadline_s)
        raw = await c
        trailers = await c.trailing_metadata()
    except grpc.aio.AioRpcError as exc:
        rec.status = exc.code().name
        rec.detail = (exc.details() or "")[:120]
    else:
        resp = pb.AssembleContextResponse.FromString(raw)
        rec.status = "OK"
        rec.degraded = degraded(resp)
        rec.misses = tuple(f"{b.source}:{b.status}" for b in resp.branches if b.status != "success")
        rec.directive_read = any(
            b.source == "directive" and b.detail != "cache" for b in resp.branches
        )
        rec.worker = dict(trailers or ()).get("x-ibex-worker", "")
    rec.latency_ms = (loop.time() - due) * 1000.0


class DaemonLog:
    """The daemon's JSON log lines, read as they are appended: each read parses only the
    bytes written since the last one. Re-reading the whole log at every checkpoint would
    take the load generator's loop for milliseconds while calls are due."""

    def __init__(self, daemon: Daemon) -> None:
        self._fd = daemon.log.fileno()
        self._offset = 0
        self._partial = b""
        self.lines: list[dict[str, Any]] = []
        self.events: Counter[str] = Counter()

    def read(self) -> Counter[str]:
        """Take in what was appended; the count of each event so far."""
        while chunk := os.pread(self._fd, 1 << 16, self._offset):
            self._offset += len(chunk)
            *complete, self._partial = (self._partial + chunk).split(b"\n")
            for raw in complete:
                if raw.startswith(b"{"):
                    try:
                        entry = json.loads(raw)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(entry, dict):
                        self.lines.append(entry)
                        self.events[str(entry.get("event", ""))] += 1
        return self.events


LIFE = (
    "reload_started",
    "worker_started",
    "warmed",
    "serving",
    "draining",
    "stopped",
    "worker_settled",
    "worker_replaced",
)


def timeline(lines: list[dict[str, Any]], wall_start: float) -> list[tuple[float, str, object]]:
    """The reload's log events, in seconds since the run's start (for reading the buckets)."""
    out = []
    for e in lines:
        if e.get("event") in (*LIFE, "reload_done"):
            ts = datetime.datetime.fromisoformat(str(e["ts"]).replace("Z", "+00:00")).timestamp()
            if ts >= wall_start:
                out.append((round(ts - wall_start, 3), str(e["event"]), e.get("worker")))
    return out


def where(t: float, events: list[tuple[float, str, object]]) -> str:
    """The reload's state at `t` (seconds since the run's start): the last two events
    before it and how long after the last one, e.g. `worker_started 1 +0.31s`."""
    before = [(at, e, w) for at, e, w in events if at <= t]
    if not before:
        return "before the reload"
    last = [f"{e} {w}" for _, e, w in before[-2:]]
    return f"{' / '.join(last)} +{t - before[-1][0]:.2f}s"


def incidents(run: Run, limit: int = 20) -> list[dict[str, Any]]:
    """Failed or degraded calls since the SIGHUP: when (seconds since the SIGHUP), what,
    which worker answered (none for a failed call), its latency and the reload's state.
    Every call that failed otherwise than by its deadline, then the first others."""
    rel = [(at - run.sighup_at, e, w) for at, e, w in run.timeline]
    since = [r for r in run.records if r.sent >= run.sighup_at and (r.status != "OK" or r.degraded)]
    rare = [r for r in since if r.status not in ("OK", "DEADLINE_EXCEEDED")]
    out = []
    for r in rare + [r for r in since if r not in rare][: max(0, limit - len(rare))]:
        t = r.sent - run.sighup_at
        out.append(
            {
                "t": round(t, 3),
                "status": r.status,
                "detail": r.detail,
                "misses": list(r.misses),
                "worker": r.worker,
                "latency_ms": round(r.latency_ms, 1),
                "reload_state": where(t, rel),
            }
        )
    return out


async def measure(
    daemon: Daemon,
    requests: list[bytes],
    args: argparse.Namespace,
    base: int,
    control_s: float | None,
) -> Run:
    """Open-loop calls at args.rate; SIGHUP after args.before s (unless `control_s`: then
    nothing happens for that long); stop args.after s after the reload is done (or
    RELOAD_LIMIT_S after the SIGHUP).

    The generator must not stall while calls are due, or it fails them itself: a call
    whose start waits behind other work loses that time from its deadline. So the
    collector is off during the run (a full pass over the run's records and the
    channel's objects takes tens of milliseconds), the daemon's log is read
    incrementally, and the end waits on the calls still in flight only (a gather over
    every call of the run queues one callback per call ahead of the last call's start).
    """
    target = f"ipv4:127.0.0.1:{base},127.0.0.1:{base + 1}"
    options = [("grpc.service_config", ROUND_ROBIN), ("grpc.enable_retries", 0)]
    run = Run(pids_before=sorted(daemon.worker_pids()), control_s=control_s)
    log = DaemonLog(daemon)
    gc.collect()
    gc.disable()
    try:
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            call = channel.unary_unary(METHOD)
            loop = asyncio.get_running_loop()
            deadline_s = args.deadline_ms / 1000.0

            async def send(seconds: float, measured: bool) -> None:
                start = loop.time() + 0.02
                if measured:
                    run.wall_start = time.time() + 0.02
                in_flight: set[asyncio.Task[None]] = set()
                i = 0
                last_check = 0.0
                while True:
                    due = start + i / args.rate
                    now = loop.time()
                    if measured and now - last_check > 0.2:
                        last_check = now
                        if checkpoint(run, daemon, log, now - start, args):
                            break
                    elif not measured and due - start >= seconds:
                        break
                    if due - now > 0.0005:
                        await asyncio.sleep(due - now)
                    rec = Record(sent=due - start)
                    if measured:
                        run.records.append(rec)
                    request = requests[i % len(requests)]
                    task = loop.create_task(one(call, request, rec, due, deadline_s))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    i += 1
                if in_flight:
                    await asyncio.wait(in_flight)

            await send(args.warm, measured=False)  # warm: connections, caches, first calls
            await send(0.0, measured=True)
    finally:
        gc.enable()
    run.pids_after = sorted(daemon.worker_pids())
    run.events = Counter(log.read())
    run.timeline = timeline(log.lines, run.wall_start)
    return run


def checkpoint(
    run: Run, daemon: Daemon, log: DaemonLog, elapsed: float, args: argparse.Namespace
) -> bool:
    """Send the SIGHUP when due, note when the reload is done; True when the run is over."""
    if not run.sighup_at and elapsed >= args.before:
        run.sighup_at = elapsed
        if run.control_s is None:
            os.kill(daemon.root_pid, signal.SIGHUP)
        return False
    if args.nice_new and run.sighup_at and run.done_at is None:
        for pid in set(daemon.worker_pids()) - set(run.pids_before) - run.niced:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, args.nice_new)
                run.niced.add(pid)
    if run.sighup_at and run.done_at is None and run.control_s is not None:
        if elapsed >= run.sighup_at + run.control_s:
            run.done_at = elapsed
    elif run.sighup_at and run.done_at is None:
        events = log.read()
        if events["reload_done"] or events["reload_failed"] or events["reload_rejected"]:
            run.done_at = elapsed
        elif elapsed - run.sighup_at > RELOAD_LIMIT_S:
            return True
    return run.done_at is not None and elapsed >= run.done_at + args.after


def phase(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.status == "OK"]
    lat = sorted(r.latency_ms for r in records)
    return {
        "calls": len(records),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.status for r in records if r.status != "OK")),
        "degraded": sum(r.degraded for r in ok),
        "degraded_share": round(sum(r.degraded for r in ok) / len(ok), 4) if ok else None,
        "p50_ms": round(percentile(lat, 50), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "max_ms": round(lat[-1], 2) if lat else 0.0,
        "by_worker": dict(sorted(Counter(r.worker for r in ok).items())),
        "branch_misses": dict(Counter(m for r in ok for m in r.misses).most_common()),
        # Answers whose directive was not a cache hit: a Redis read (or its timeout) inside
        # the 5 ms branch. A warm worker has none; a new worker's cold cache has one per agent.
        "directive_reads": sum(r.directive_read for r in ok),
    }


def buckets(records: list[Record], origin: float, width: float = 1.0) -> list[list[float]]:
    """[seconds since the SIGHUP, calls, failed, degraded] per `width` seconds."""
    out: dict[int, list[float]] = {}
    for r in records:
        k = int((r.sent - origin) // width)
        row = out.setdefault(k, [k * width, 0, 0, 0])
        row[1] += 1
        row[2] += r.status != "OK"
        row[3] += r.status == "OK" and r.degraded
    return [out[k] for k in sorted(out)]


def write_calls(path: Path, run: Run, salt: int) -> None:
    """Append every failed call and every call slower than SLOW_MS, with its wall-clock
    send time, to `path` (JSON lines): to line them up with other processes' logs."""
    with path.open("a") as f:
        for r in run.records:
            if r.status != "OK" or r.latency_ms > SLOW_MS:
                row = {
                    "salt": salt,
                    "kind": "reload" if run.control_s is None else "control",
                    "wall": round(run.wall_start + r.sent, 4),
                    "t": round(r.sent, 3),
                    "since_sighup": round(r.sent - run.sighup_at, 3),
                    "status": r.status,
                    "detail": r.detail,
                    "worker": r.worker,
                    "latency_ms": round(r.latency_ms, 1),
                }
                f.write(json.dumps(row) + "\n")


def summarize(run: Run, before_s: float) -> dict[str, Any]:
    t0 = run.sighup_at - before_s
    done = run.done_at if run.done_at is not None else float("inf")
    before = [r for r in run.records if t0 <= r.sent < run.sighup_at]
    during = [r for r in run.records if run.sighup_at <= r.sent <= done]
    after = [r for r in run.records if r.sent > done]
    since = during + after
    b, s = phase(before), phase(since)
    return {
        "kind": "reload" if run.control_s is None else "control",
        "failed": sum(1 for r in run.records if r.status != "OK"),
        "failed_since_sighup": s["failed"],
        "calls": len(run.records),
        "reload_s": None if run.done_at is None else round(run.done_at - run.sighup_at, 2),
        "reload_done": run.events["reload_done"] == 1,
        "workers_replaced": run.events["worker_replaced"],
        "pids_before": run.pids_before,
        "pids_after": run.pids_after,
        "every_pid_replaced": len(run.pids_after) == len(run.pids_before)
        and not set(run.pids_after) & set(run.pids_before),
        "degraded_share_before": b["degraded_share"],
        "degraded_share_since_sighup": s["degraded_share"],
        "not_more_degraded": (s["degraded_share"] or 0.0) <= (b["degraded_share"] or 0.0),
        "directive_reads_before": b["directive_reads"],
        "directive_reads_since_sighup": s["directive_reads"],
        "before": b,
        "during": phase(during),
        "after": phase(after),
        "events_since_sighup_s": [(round(t - run.sighup_at, 2), e, w) for t, e, w in run.timeline],
        "buckets_since_sighup": buckets(run.records, run.sighup_at),
        "incidents_since_sighup": incidents(run),
    }


async def one_run(
    stack: Stack, args: argparse.Namespace, salt: int, control_s: float | None = None
) -> dict[str, Any]:
    base = free_port_pair()
    extra = {
        "IBEX_CONTEXT_WORKER_PORT_BASE": str(base),
        "IBEX_CONTEXT_LOG_LEVEL": "info",  # reload_started / worker_replaced / reload_done
        **dict(kv.split("=", 1) for kv in args.daemon_env),
    }
    with stack.daemon(2, args.root, **extra) as daemon:
        end = time.monotonic() + 60
        while listeners(base) < 1 or listeners(base + 1) < 1:
            if time.monotonic() > end:
                raise RuntimeError("worker ports not listening:\n" + daemon.output()[-3000:])
            await asyncio.sleep(0.05)
        requests = build_requests(stack.tenants, 4096, salt, versions=True)
        run = await measure(daemon, requests, args, base, control_s)
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            (args.logs / f"daemon-{salt}.log").write_text(daemon.output())
        if daemon.proc.poll() is not None:
            raise RuntimeError("supervisor exited:\n" + daemon.output()[-3000:])
    if args.calls_out is not None:
        write_calls(args.calls_out, run, salt)
    return summarize(run, args.before)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with Stack() as stack:
        for i in range(args.runs):
            if args.control:  # the same calls on the same machine a moment before, no SIGHUP
                row = await one_run(stack, args, salt=200 + i, control_s=args.control)
                print(json.dumps({"run": i + 1, **row}), flush=True)
            row = await one_run(stack, args, salt=100 + i)
            print(json.dumps({"run": i + 1, **row}), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rate", type=float, default=100.0, help="calls per second")
    p.add_argument("--warm", type=float, default=3.0, help="seconds of calls before measuring")
    p.add_argument("--before", type=float, default=10.0, help="seconds measured before SIGHUP")
    p.add_argument("--after", type=float, default=5.0, help="seconds after reload_done")
    p.add_argument("--deadline-ms", type=float, default=DEADLINE_S * 1000.0)
    p.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the checkout whose daemon runs (default: this one); compare two checkouts "
        "in the same machine state",
    )
    p.add_argument(
        "--control",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, a control run without SIGHUP whose 'since' window is this long "
        "(tells the machine's own failures from the reload's on a busy host)",
    )
    p.add_argument(
        "--nice-new",
        type=int,
        default=0,
        metavar="N",
        help="experiment: renice each new worker to N as soon as it is seen (within 0.2 s), "
        "to tell its start-up's CPU from the handover",
    )
    p.add_argument(
        "--calls-out",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"append each failed call and each slower than {SLOW_MS:.0f} ms, with its "
        "wall-clock send time, to PATH (JSON lines), to line up with other processes' logs",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each run's daemon log (supervisor and workers) in DIR",
    )
    args = p.parse_args(argv)
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C: the daemon runs in a session of
    # its own, which only `Stack`'s exit stops; a default SIGTERM would leave it serving.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rows = aio.run(main_async(args))  # a plain asyncio loop (see benchmarks.aio)
    med = {
        key: statistics.median(float(r[key] or 0.0) for r in rows)
        for key in (
            "failed",
            "failed_since_sighup",
            "reload_s",
            "degraded_share_before",
            "degraded_share_since_sighup",
            "directive_reads_since_sighup",
        )
    }
    print(
        json.dumps(
            {
                "runs": len(rows),
                "rate": args.rate,
                "median": med,
                "failed_per_run": [r["failed"] for r in rows],
                "failed_since_sighup_per_run": [r["failed_since_sighup"] for r in rows],
                "directive_reads_since_sighup_per_run": [
                    r["directive_reads_since_sighup"] for r in rows
                ],
                "every_pid_replaced": [r["every_pid_replaced"] for r in rows],
                "not_more_degraded": [r["not_more_degraded"] for r in rows],
            }
        )
    )


if __name__ == "__main__":
    main()
