"""The serving stack's floor: CPU per answer and latency before any of ibex's own work.

Issue 10's CPU targets (<= 2.0 ms an answer at 100 rps, <= 1.5 ms at 200) and
its cold-endpoint tail (p99 <= 45 ms with a 40 ms wall) are budgets for the
whole process. This benchmark measures what the chosen stack takes of them by
itself, with the same driver and rates as `benchmarks.load.deadlines`:

- `asyncio`: grpclib on asyncio's own loop; the handler waits 10 ms and answers
  a canned response the size of a real one (30 memories, 12k characters).
- `trio-asyncio`: grpclib on trio-asyncio with ibex's batching loop and h2
  settings, the handler crossing into Trio for its 10 ms wait: ibex's serving
  path with retrieval and the pipeline taken out.
- `ibex`: the daemon itself on the standard stack (real Redis, the memory
  stand-in with hot 2 ms and cold 8 ms, directive versions sent).

The three run alternately in one process tree (4 s at each rate, `--repeats`
times), so the figures share the machine's hour; medians are reported. The
latency columns count from each call's scheduled send, as in the load runs:
the 10 ms wait (the daemon's: its slowest branch, 8 ms) is in them.

Each stack also runs a closed loop of 32 callers (saturation): there calls
share wakeups and warm caches, so an answer costs a fraction of its CPU at
100 rps, where every call wakes an idle process. The ratio says how much of the
open-loop figure is the cost of waking up on this machine rather than work.
The machine's speed during the run (`benchmarks.load.speed`) is printed too.

Run: ``python -m benchmarks.load.floor [--quick]`` (JSON in
``benchmarks/results/load.floor.json``). ``--serve MODE PORT`` is the server
side, started by the benchmark itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.encoding.base import CodecBase

from benchmarks import aio
from benchmarks.load.driver import METHOD, Driver, build_requests, fixed_rate, warm_up
from benchmarks.load.report import summarize
from benchmarks.load.speed import reference_cpu_ms, spread
from benchmarks.load.stack import ROOT, Daemon, Stack, cpu_seconds, free_port, wait_listening

RESULTS = Path(__file__).resolve().parents[1] / "results" / "load.floor.json"
MODES = ("asyncio", "trio-asyncio", "ibex")
PAUSE = 0.010  # the handler's wait: a retrieval of about the stand-in's cold latency
LOADS = ("100", "200", "closed")  # open loop at 100 and 200 rps; a closed loop (saturation)
CALLERS = 32


def canned_response() -> bytes:
    """A real AssembleContextResponse of production size (what the driver parses)."""
    from ibex.testing.grpcio_stubs import context_pb2 as pb

    memories = [
        pb.MemoryUsed(
            memory_id=f"00000000-0000-4000-8000-{i:012x}",
            composite_score=0.5,
            relevance_score=0.5,
            recency_score=0.5,
            usefulness_score=0.5,
            rank=i + 1,
            category="factual",
            exclusion="included",
            similarity=0.5,
            confidence=0.9,
            token_estimate=60,
        )
        for i in range(30)
    ]
    return pb.AssembleContextResponse(
        assembled_context="x" * 12_000,
        tokens_used=3000,
        memories_included=30,
        memories_used=memories,
        degradation_level="L0",
    ).SerializeToString()


class _Bytes(CodecBase):
    """Requests and responses pass through as bytes: the floor has no message work."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> bytes:
        return data


class _Service:
    def __init__(self, mode: str, response: bytes) -> None:
        self.mode = mode
        self.response = response

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            METHOD: grpclib.const.Handler(
                self.handle, grpclib.const.Cardinality.UNARY_UNARY, bytes, bytes
            )
        }

    async def handle(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        await stream.recv_message()
        if self.mode == "trio-asyncio":
            import trio
            import trio_asyncio

            async def in_trio() -> bytes:
                await trio.sleep(PAUSE)
                return self.response

            answer = await trio_asyncio.trio_as_aio(in_trio)()
        else:
            await asyncio.sleep(PAUSE)
            answer = self.response
        await stream.send_message(answer)


async def _serve_asyncio(mode: str, port: int) -> None:
    server = grpclib.server.Server([_Service(mode, canned_response())], codec=_Bytes())
    # reuse_port: several floor processes on one port are the floor at one worker per core.
    await server.start("127.0.0.1", port, reuse_port=True)
    await server.wait_closed()


def serve(mode: str, port: int) -> None:
    """The server side of one mode, until killed."""
    if mode == "asyncio":
        aio.run(_serve_asyncio(mode, port))
        return
    import trio
    import trio_asyncio

    from ibex.patches import batch_ready_callbacks, lighten_h2

    batch_ready_callbacks()
    lighten_h2()

    async def main() -> None:
        async with trio_asyncio.open_loop():
            await trio_asyncio.aio_as_trio(_serve_asyncio)(mode, port)

    trio.run(main)


class _Bare:
    """A floor server as a child process."""

    def __init__(self, mode: str, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.addr = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "benchmarks.load.floor", "--serve", mode, str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
        if not wait_listening(self.proc, self.port):
            self.stop()
            raise RuntimeError(f"floor server {mode} did not start")

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def alternate(
    stack: Stack, daemon: Daemon, repeats: int, seconds: float, speed: list[float]
) -> dict[str, Any]:
    """The three stacks at each load, alternately, `repeats` times: medians per `{mode}_{load}`.

    `daemon` is the `ibex` mode (its CPU is what `cpu()` reads, its `addr` is called);
    the two bare servers are started here. Each row's speed probe is appended to `speed`.
    """
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {m: {r: [] for r in LOADS} for m in MODES}
    bare = {"asyncio": _Bare("asyncio"), "trio-asyncio": _Bare("trio-asyncio")}
    targets: dict[str, Any] = {**bare, "ibex": daemon}
    drivers = {m: Driver(targets[m].addr, channels=4) for m in MODES}
    try:
        salt = await warm_up([drivers[m] for m in MODES], stack.tenants, 100)
        for _ in range(repeats):
            for load in LOADS:
                for m in MODES:
                    salt += 1
                    ref = reference_cpu_ms()
                    speed.append(ref)
                    cpu0 = targets[m].cpu()
                    if load == "closed":
                        reqs = build_requests(stack.tenants, 4096, salt, versions=True)
                        rec = await drivers[m].closed_loop(reqs, CALLERS, seconds, 1.0)
                    else:
                        rate = int(load)
                        n = int(rate * seconds)
                        reqs = build_requests(stack.tenants, n, salt, versions=True)
                        rec = await drivers[m].open_loop(reqs, fixed_rate((rate, seconds)), 1.0)
                    row = summarize(rec, daemon_cpu_s=targets[m].cpu() - cpu0, aux_cpu_s={})
                    row["ref_cpu_ms"] = round(ref, 1)
                    rows[m][load].append(row)
                    await asyncio.sleep(0.2)
    finally:
        for d in drivers.values():
            await d.close()
        for b in bare.values():
            b.stop()
    out: dict[str, Any] = {}
    for m in MODES:
        for load in LOADS:
            rs = rows[m][load]
            out[f"{m}_{_key(load)}"] = {
                "cpu_ms_per_answer": statistics.median(r["daemon_cpu_ms_per_answer"] for r in rs),
                "answers_per_s": statistics.median(r["achieved_rps"] for r in rs),
                "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                "errors": sum(r["error_count"] for r in rs),
                "samples": len(rs),
                "cpu_ms_per_answer_runs": [r["daemon_cpu_ms_per_answer"] for r in rs],
            }
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    speed: list[float] = []
    with Stack() as stack, stack.daemon(1) as daemon:
        medians = await alternate(stack, daemon, args.repeats, args.seconds, speed)
    out: dict[str, Any] = {"command": " ".join(["python -m benchmarks.load.floor", *sys.argv[1:]])}
    out.update(medians)
    out["machine_speed"] = spread(speed)
    return out


def _key(load: str) -> str:
    return "closed" if load == "closed" else f"{load}rps"


def table(out: dict[str, Any]) -> str:
    lines = [
        f"{'stack':<14} {'load':>6} {'CPU ms/answer':>14} {'answers/s':>9} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'errors':>6}  (medians of {out['ibex_100rps']['samples']})"
    ]
    for m in MODES:
        for load in LOADS:
            r = out[f"{m}_{_key(load)}"]
            label = f"{CALLERS} cl." if load == "closed" else f"{load}/s"
            lines.append(
                f"{m:<14} {label:>6} {r['cpu_ms_per_answer']:>14.2f} {r['answers_per_s']:>9.0f} "
                f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['errors']:>6}"
            )
    for rate in (100, 200):
        floor = out[f"trio-asyncio_{rate}rps"]["cpu_ms_per_answer"]
        ibex = out[f"ibex_{rate}rps"]["cpu_ms_per_answer"]
        lines.append(
            f"at {rate} rps the stack's floor is {floor / ibex:.0%} of the daemon's CPU per "
            f"answer; ibex's own work {ibex - floor:.2f} ms"
        )
    for m in MODES:
        sat = out[f"{m}_closed"]["cpu_ms_per_answer"]
        low = out[f"{m}_100rps"]["cpu_ms_per_answer"]
        lines.append(f"{m}: an answer at 100 rps costs {low / sat:.1f}x its CPU at saturation")
    lines.append(f"reference work, ms of CPU (lower is faster): {out['machine_speed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of 3 s per rate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--serve", nargs=2, metavar=("MODE", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    if args.quick:
        args.repeats, args.seconds = 1, 3.0
    out = aio.run(measure(args))
    print(table(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
