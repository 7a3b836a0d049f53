"""What traces cost: the daemon's CPU per answer with tracing off and with every call sampled.

Three daemons on the standard stack (real Redis, the memory stand-in with hot
2 ms and cold 8 ms), measured alternately in one run so they share the
machine's hour; medians are reported:

- `off`: no `OTEL_*` variable (tracing off: the request path tests one `None`);
- `on`: `OTEL_TRACES_SAMPLER=traceidratio`, `OTEL_TRACES_SAMPLER_ARG=1.0`: every
  call is a sampled root with its branch and stage spans, exported over
  OTLP/HTTP to a sink process that decodes and counts them (its CPU is its own;
  the daemon's includes the SDK's export thread);
- `base` (with `--base REV`): the daemon as of that git revision, to show that
  tracing off costs what the code without tracing did.

Each runs a closed loop of 32 callers (work per answer, least noise) and an
open loop at `--rate` calls a second (default 50, below this shared machine's
saturation; an idle process woken per call, as in production). Spans are
counted at the sink: every call (errors too) exports its RPC span and children.

Run: ``python -m benchmarks.load.tracing [--base REV] [--repeats N] [--rate R]`` (JSON
in ``benchmarks/results/load.tracing.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import aio
from benchmarks.load.driver import Driver, build_requests, fixed_rate, warm_up
from benchmarks.load.report import summarize
from benchmarks.load.speed import reference_cpu_ms, spread
from benchmarks.load.stack import ROOT, Stack, free_port, wait_listening

RESULTS = Path(__file__).resolve().parents[1] / "results" / "load.tracing.json"
CALLERS = 32


def sink(port: int) -> None:
    """An OTLP/HTTP traces endpoint that decodes and counts spans (GET returns the count)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    lock = threading.Lock()
    counts = {"requests": 0, "spans": 0}
    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            req = ExportTraceServiceRequest.FromString(body)
            n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            with lock:
                counts["requests"] += 1
                counts["spans"] += n
            self._send(reply, "application/x-protobuf")

        def do_GET(self) -> None:
            with lock:
                self._send(json.dumps(counts).encode(), "application/json")

        def _send(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


@contextlib.contextmanager
def sink_process() -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.load.tracing", "--sink", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        if not wait_listening(proc, port):
            raise RuntimeError("OTLP sink did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def sink_counts(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url, timeout=5) as r:  # loopback only
        counts: dict[str, int] = json.loads(r.read())
        return counts


def checkout(rev: str, into: Path) -> None:
    """The tree of `rev` (a git revision of this repository) unpacked into `into`."""
    archive = subprocess.run(
        ["git", "archive", rev], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    loads = ("closed", str(args.rate))
    modes = [m for m in args.modes.split(",") if m != "base" or args.base_root]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {m: {r: [] for r in loads} for m in modes}
    speed: list[float] = []
    with contextlib.ExitStack() as stack_exit:
        stack = stack_exit.enter_context(Stack())
        url = stack_exit.enter_context(sink_process())
        on_env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/v1/traces",
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "1.0",
        }
        daemons: dict[str, Any] = {}
        if "off" in modes:
            daemons["off"] = stack_exit.enter_context(stack.daemon(1))
        if "on" in modes:
            daemons["on"] = stack_exit.enter_context(stack.daemon(1, ROOT, **on_env))
        if "base" in modes:
            daemons["base"] = stack_exit.enter_context(stack.daemon(1, args.base_root))
        drivers = {m: Driver(daemons[m].addr, channels=4) for m in modes}
        try:
            salt = await warm_up([drivers[m] for m in modes], stack.tenants, 50)
            await asyncio.sleep(6.0)  # OTEL_BSP_SCHEDULE_DELAY (5 s): warm-up spans arrive
            spans0 = sink_counts(url)["spans"]
            calls_on = 0
            for repeat in range(args.repeats):
                for load in loads:
                    # Alternate the order each repeat: a mode is not always measured right
                    # after the same other one (the `on` daemon's last batch leaves later).
                    for m in modes if repeat % 2 == 0 else modes[::-1]:
                        salt += 1
                        speed.append(reference_cpu_ms())
                        cpu0 = daemons[m].cpu()
                        if load == "closed":
                            reqs = build_requests(stack.tenants, 4096, salt, versions=True)
                            rec = await drivers[m].closed_loop(reqs, CALLERS, args.seconds, 1.0)
                        else:
                            n = int(int(load) * args.seconds)
                            reqs = build_requests(stack.tenants, n, salt, versions=True)
                            rec = await drivers[m].open_loop(
                                reqs, fixed_rate((int(load), args.seconds)), 1.0
                            )
                        await asyncio.sleep(0.3)  # the export thread's last batch is counted
                        row = summarize(rec, daemon_cpu_s=daemons[m].cpu() - cpu0, aux_cpu_s={})
                        rows[m][load].append(row)
                        if m == "on":
                            calls_on += row["calls"]
            await asyncio.sleep(6.0)  # OTEL_BSP_SCHEDULE_DELAY (5 s): the last batch arrives
            spans = sink_counts(url)["spans"] - spans0
        finally:
            for d in drivers.values():
                await d.close()
    out: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.tracing", *sys.argv[1:]])
    }
    out["loads"] = list(loads)
    for m in modes:
        for load in loads:
            rs = rows[m][load]
            out[f"{m}_{_key(load)}"] = {
                "cpu_ms_per_answer": statistics.median(r["daemon_cpu_ms_per_answer"] for r in rs),
                "cpu_ms_per_answer_all": [r["daemon_cpu_ms_per_answer"] for r in rs],
                "answers_per_s": statistics.median(r["achieved_rps"] for r in rs),
                "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                "p50_ms_all": [r["p50_ms"] for r in rs],
                "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                "errors": sum(r["error_count"] for r in rs),
                "samples": len(rs),
            }
    out["spans_per_traced_call"] = round(spans / calls_on, 2) if calls_on else None
    out["machine_speed"] = spread(speed)
    return out


# One process: `n` assemblies of the bundled local sample through `Assembler.assemble`
# (retrieval nursery, pipeline), CPU ms per assembly. `on` hands each a real call trace
# (SDK spans, sampled) whose exporter drops the batches: the event loop's share only.
_INPROC = """
import logging, sys, time, trio
from ibex.assembly.structs import AssemblyRequest
from ibex.config import Settings
from ibex.service.root import open_assembler
from ibex.sources.local_file import SAMPLE_AGENT_ID, SAMPLE_ORG_ID

mode, n = sys.argv[1], int(sys.argv[2])
logging.disable(logging.WARNING)  # the sample's foreign hit is logged on every call

async def main():
    tracing = None
    if mode == "on":
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
        from ibex.ops.otel_sdk import Tracing

        class Drop(SpanExporter):
            def export(self, spans):
                return SpanExportResult.SUCCESS

        tracing = Tracing(exporter=Drop())
    async with open_assembler(Settings()) as assembler:
        async def one(i):
            request = AssemblyRequest(
                agent_id=SAMPLE_AGENT_ID, org_id=SAMPLE_ORG_ID, model="gpt-4o",
                query=f"how do I deploy the billing service, take {i}?", request_id=f"r{i}",
            )
            if tracing is None:
                await assembler.assemble(request)
                return
            call = tracing.call("svc", "AssembleContext", {}, time.perf_counter())
            call.open()
            await assembler.assemble(request, trace=call)
            call.finish("OK")

        for i in range(200):
            await one(-i)
        t0 = time.process_time()
        for i in range(n):
            await one(i)
        print((time.process_time() - t0) * 1000.0 / n)
    if tracing is not None:
        tracing.shutdown()

trio.run(main)
"""


def inproc(args: argparse.Namespace) -> dict[str, Any]:
    """CPU per in-process assembly, base / off / on alternated in fresh processes."""
    trees = {"off": ROOT, "on": ROOT}
    if args.base_root:
        trees["base"] = args.base_root
    modes = [m for m in ("base", "off", "on") if m in trees]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for m in modes if repeat % 2 == 0 else modes[::-1]:
            out = subprocess.run(
                [sys.executable, "-c", _INPROC, m, str(args.inproc)],
                cwd=trees[m],
                env={**os.environ, "PYTHONPATH": str(trees[m])},
                capture_output=True,
                text=True,
                check=True,
            )
            runs[m].append(round(float(out.stdout.split()[-1]), 4))
    result: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.tracing", *sys.argv[1:]])
    }
    for m in modes:
        result[m] = {"cpu_ms_per_assembly": statistics.median(runs[m]), "all": runs[m]}
    return result


def _key(load: str) -> str:
    return "closed" if load == "closed" else f"{load}rps"


def table(out: dict[str, Any]) -> str:
    modes = [m for m in ("base", "off", "on") if f"{m}_closed" in out]
    lines = [
        f"{'tracing':<8} {'load':>7} {'CPU ms/answer':>14} {'answers/s':>9} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'errors':>6}  (medians of {out[f'{modes[0]}_closed']['samples']})"
    ]
    loads = out["loads"]
    for load in loads:
        for m in modes:
            r = out[f"{m}_{_key(load)}"]
            label = f"{CALLERS} cl." if load == "closed" else f"{load}/s"
            lines.append(
                f"{m:<8} {label:>7} {r['cpu_ms_per_answer']:>14.3f} {r['answers_per_s']:>9.0f} "
                f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['errors']:>6}"
            )
    for load in loads:
        cpu = {m: out[f"{m}_{_key(load)}"]["cpu_ms_per_answer"] for m in modes}
        if "off" in cpu and "on" in cpu:
            lines.append(
                f"{_key(load)}: sampling every call adds {cpu['on'] - cpu['off']:.3f} ms CPU "
                "per answer"
            )
        if "off" in cpu and "base" in cpu:
            lines.append(f"{_key(load)}: off - base = {cpu['off'] - cpu['base']:+.3f} ms")
    lines.append(f"spans exported per traced call: {out['spans_per_traced_call']}")
    lines.append(f"reference work, ms of CPU (lower is faster): {out['machine_speed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of 3 s per load")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rate", type=int, default=50, help="open-loop calls per second")
    p.add_argument("--modes", default="off,on,base", help="which daemons (base needs --base)")
    p.add_argument(
        "--inproc",
        type=int,
        metavar="N",
        help="instead: N in-process assemblies per run (no gRPC, no export), base/off/on",
    )
    p.add_argument("--base", metavar="REV", help="also measure the daemon at this git revision")
    p.add_argument("--sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.sink:
        sink(args.sink)
        return
    if args.quick:
        args.repeats, args.seconds = 1, 3.0
    with tempfile.TemporaryDirectory() as tmp:
        args.base_root = None
        if args.base:
            args.base_root = Path(tmp)
            checkout(args.base, args.base_root)
        if args.inproc:
            out = inproc(args)
            print(json.dumps(out, indent=1))
            args.out = args.out.with_name("load.tracing.inproc.json")
        else:
            out = aio.run(measure(args))
            print(table(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
