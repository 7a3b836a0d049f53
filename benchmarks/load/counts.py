"""Counts before objects: does a caller flooding over-count requests slow another caller?

One caller sends, on its own connection, a 4 MiB AssembleContext request of
about two million empty `recent_messages` every `--interval` seconds (raw bytes,
so the benchmark's own CPU does not build them); another calls at `--rps` and its
latencies are recorded. `--body string` sends instead a request of the same size
holding one 4 MiB unknown field (no element to count): the cost of receiving
4 MiB over HTTP/2 alone, for comparison. Reported, never asserted: the quiet caller's p50, p99 and
worst latency and status counts without the flood and with it (target: p99
within a few ms of the baseline), the flood's status counts, and the load average
(on a shared 2-core box the baseline itself shows what the machine allows).

Run: ``.venv/bin/python -m benchmarks.load.counts [--calls 250] [--rps 50]``
(table on stdout, JSON in ``benchmarks/results/counts.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from ibex.service.handlers import SERVICE
from ibex.testing.grpcio_stubs import context_pb2_grpc
from ibex.testing.memory_server import DEMO_AGENT, DEMO_ORG
from ibex.testing.noisy_tenant import NOISY_AGENT, NOISY_ORG, daemon_with_memory, request

RESULTS = Path(__file__).resolve().parents[1] / "results" / "counts.json"
ELEMENTS = 2_090_000  # empty recent_messages of two bytes each: just under 4 MiB


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def flood_request(body: str) -> bytes:
    ids = b"".join(
        bytes([number << 3 | 2, len(value)]) + value
        for number, value in ((1, NOISY_AGENT.encode()), (2, NOISY_ORG.encode()))
    )
    if body == "string":  # field 99, one length-delimited value of the same size
        size = 2 * ELEMENTS - 7
        return ids + varint(99 << 3 | 2) + varint(size) + b"x" * size
    return ids + b"\x42\x00" * ELEMENTS  # field 8, length 0


class Flood:
    """Sends the over-count request back to back until stopped; counts the answers."""

    def __init__(self, channel: grpc.Channel, body: bytes, interval: float) -> None:
        self.call = channel.unary_unary(
            f"/{SERVICE}/AssembleContext",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        self.body = body
        self.interval = interval
        self.codes: Counter[str] = Counter()
        self.details: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.call(self.body, timeout=10)
                self.codes["OK"] += 1
            except grpc.RpcError as exc:
                self.codes[exc.code().name] += 1
                self.details[exc.details()] += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def timed_probe(stub: Any, calls: int, rps: float, deadline: float) -> dict[str, Any]:
    """`calls` calls of the quiet caller at `rps`, each timed from send to answer."""
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    lock = threading.Lock()
    futures = []
    start = time.monotonic()
    for i in range(calls):
        delay = start + i / rps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        future = stub.AssembleContext.future(request(DEMO_ORG, DEMO_AGENT), timeout=deadline)

        def done(f: Any, sent: float = sent) -> None:
            elapsed = time.perf_counter() - sent
            code = f.code()
            with lock:
                latencies.append(elapsed * 1000)
                codes[code.name if code is not None else "CANCELLED"] += 1

        future.add_done_callback(done)
        futures.append(future)
    for f in futures:
        with contextlib.suppress(grpc.RpcError):
            f.result()
    ordered = sorted(latencies)
    return {
        "codes": dict(codes),
        "p50_ms": round(statistics.median(ordered), 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "max_ms": round(ordered[-1], 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = args.deadline_ms / 1000
    out: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.counts", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "rps": args.rps,
        "calls": args.calls,
        "deadline_ms": args.deadline_ms,
        "body": args.body,
        "interval_s": args.interval,
        "request_bytes": len(flood_request(args.body)),
    }
    with (
        tempfile.TemporaryDirectory() as logs,
        daemon_with_memory(Path(logs)) as daemon,
        grpc.insecure_channel(daemon.target) as flood_channel,
        grpc.insecure_channel(daemon.target) as quiet_channel,
    ):
        quiet = context_pb2_grpc.ContextAssemblyServiceStub(quiet_channel)
        quiet.AssembleContext(request(DEMO_ORG, DEMO_AGENT), timeout=10)
        timed_probe(quiet, 50, args.rps, deadline)  # warm-up, not reported
        out["loadavg_before"] = os.getloadavg()[0]
        out["baseline"] = timed_probe(quiet, args.calls, args.rps, deadline)
        with Flood(flood_channel, flood_request(args.body), args.interval) as flood:
            time.sleep(0.5)
            out["with_flood"] = timed_probe(quiet, args.calls, args.rps, deadline)
        out["flood"] = {"codes": dict(flood.codes), "details": dict(flood.details)}
        out["loadavg_after"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=250, help="quiet calls per phase")
    p.add_argument("--rps", type=float, default=50.0)
    p.add_argument("--deadline-ms", type=float, default=1000.0)
    p.add_argument("--interval", type=float, default=0.25, help="seconds between 4 MiB requests")
    p.add_argument("--body", choices=["elements", "string"], default="elements")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    out = run(args)
    print(f"{'phase':<11} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}  codes")
    for phase in ("baseline", "with_flood"):
        r = out[phase]
        print(f"{phase:<11} {r['p50_ms']:>7} {r['p99_ms']:>7} {r['max_ms']:>7}  {r['codes']}")
    print(f"flood: {out['flood']['codes']} {out['flood']['details']}")
    print(f"load average {out['loadavg_before']:.1f} -> {out['loadavg_after']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
