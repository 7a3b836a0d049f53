"""Where the time after the wall goes: a call whose cold branch hangs, step by step.

The daemon runs with the cold endpoint 100 ms slower than usual and 1 s caller
deadlines, so every call is cut by its retrieval wall (40 ms from arrival) and
answers L1. `wall_probe/sitecustomize.py` (put on the daemon's PYTHONPATH) times
each step from the wall instant: the loop's first wake after it (and the task
steps that run between it and the hand-over of an answer made before the wall),
the cold branch's cancellation, retrieval's return, the pipeline, the reply made
on the Trio side (or the crossing back to asyncio, where the handler sends it),
the send. Medians and p90 per step, in milliseconds; the steps are cumulative up
to "retrieval returns", then each its own.

`ibex_answer_seconds` (`/metrics`) shows the total in production; this shows
its parts. `--root` runs another checkout's daemon (e.g. a worktree of an
older commit) with this benchmark's driver, for before/after figures.

With ``--client h2load`` it measures issue 32's tail target instead, without
the probe and without a Python client on the cores: h2load
(`benchmarks.load.h2load`, 4 connections, open loop) at `--rate` against a
daemon exporting /metrics, `--repeats` runs of `--seconds` each, and reports
the client's p99 (target <= 45 ms) beside the daemon's own p99 from HEADERS
to the last byte (`ibex_answer_seconds`, its 1 ms buckets from 38 to 50 ms,
scraped before and after each run) less the wall (target <= 1.5 ms), the
gRPC statuses from the daemon's counters, and the medians over the repeats.
The figures go to the results file (`benchmarks.figures`, source
``load.after_wall``) unless ``--no-figures``.

With ``--versus DIR`` (h2load only) the rounds alternate this checkout's daemon and
DIR's (ABBA, one run of `--seconds` each, `--repeats` rounds), each with its own
stack, so both see the same moments of a shared machine; both sides' medians and
ranges are printed and recorded (DIR's under ``after_wall.h2load.versus.*``).

Run: ``python -m benchmarks.load.after_wall [--rate 100] [--seconds 8] [--root DIR]``
or ``python -m benchmarks.load.after_wall --client h2load [--repeats 5] [--seconds 8]``
or ``python -m benchmarks.load.after_wall --client h2load --versus DIR [--probe]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import aio, figures
from benchmarks.load import h2load
from benchmarks.load.capacity import stack_daemon
from benchmarks.load.deadlines import LONG, warmed_run
from benchmarks.load.driver import build_requests, fixed_rate
from benchmarks.load.report import percentile
from benchmarks.load.speed import reference_cpu_ms, spread
from benchmarks.load.stack import ROOT, Stack
from benchmarks.targets import (
    answer_buckets,
    answer_wall,
    bucket_deltas,
    histogram_quantile,
)

PROBE = Path(__file__).resolve().parent / "wall_probe"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "load.after_wall.json"
CLIENT_P99_MS = 45.0  # issue 32, item 4: h2load's p99 at 100 rps
AFTER_WALL_P99_MS = 1.5  # the daemon's p99 past the wall, from its own histogram


def summary(steps: dict[str, list[float]]) -> list[tuple[str, int, float, float]]:
    """(step, calls, median, p90) per step, in step order."""
    rows = []
    for name in sorted(steps):
        values = sorted(steps[name])
        if values:
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            rows.append((name, len(values), statistics.median(values), p90))
    return rows


async def measure(root: Path, rate: float, seconds: float) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="ibex-wall-")) / "steps.json"
    env = {"PYTHONPATH": f"{PROBE}:{root}", "IBEX_WALL_PROBE_OUT": str(out)}
    with Stack() as stack:
        with stack.daemon(1, root, **env) as daemon:
            async with warmed_run(stack, daemon) as run:
                stack.memory.set_latency("cold", stack.cold_ms + 100.0)
                row, _ = await run.open(f"cold +100 ms @{rate:.0f}", fixed_rate((rate, seconds)))
        steps = json.loads(out.read_text()) if out.exists() else {}
    return {"client": row, "steps": summary(steps)}


def h2load_row(
    run: h2load.Run, codes: dict[str, float], buckets: dict[float, float], wall_s: float
) -> dict[str, Any]:
    """One h2load run's row: the client's percentiles, the daemon's statuses and its own
    p99 (and p50) from HEADERS to the last byte, in ms past the wall."""
    lat = sorted(run.latency_ms)
    p99 = histogram_quantile(buckets, 0.99)
    p50 = histogram_quantile(buckets, 0.50)
    return {
        "calls": run.done,
        "http_failed": run.failed + run.errored + run.timeout,
        "statuses": {k: int(v) for k, v in sorted(codes.items())},
        "client_p50_ms": round(percentile(lat, 50), 2) if lat else None,
        "client_p99_ms": round(percentile(lat, 99), 2) if lat else None,
        "server_observed": int(buckets.get(float("inf"), 0.0)),
        "server_p50_after_wall_ms": None if p50 is None else round((p50 - wall_s) * 1e3, 2),
        "server_p99_after_wall_ms": None if p99 is None else round((p99 - wall_s) * 1e3, 2),
        "client_cpu_cores": round(run.client_cpu_s / run.seconds, 3) if run.seconds else 0.0,
    }


async def measure_h2load(
    root: Path, rate: int, seconds: float, repeats: int, probe: bool = False
) -> dict[str, Any]:
    """`repeats` h2load runs at `rate` with the cold endpoint +100 ms and 1 s deadlines;
    with `probe`, the step probe in the daemon too (its steps over all the runs)."""
    out = Path(tempfile.mkdtemp(prefix="ibex-wall-")) / "steps.json"
    probe_env = {"PYTHONPATH": f"{PROBE}:{root}", "IBEX_WALL_PROBE_OUT": str(out)} if probe else {}
    rows: list[dict[str, Any]] = []
    speed: list[float] = []
    with Stack() as stack, stack_daemon(stack, 1, None, root, **probe_env) as target:
        wall_s = answer_wall(stack.env(target.daemon.port, root), LONG)
        messages = build_requests(stack.tenants, len(stack.tenants), 0, versions=True)
        load = h2load.Load(rate)
        # Warm: connections, caches, first-call imports, and one cut call per tenant.
        await asyncio.to_thread(h2load.run, target.addr, messages, load, 2.0, deadline_s=LONG)
        stack.memory.set_latency("cold", stack.cold_ms + 100.0)
        try:
            await asyncio.to_thread(h2load.run, target.addr, messages, load, 1.0, deadline_s=LONG)
            for i in range(repeats):
                speed.append(reference_cpu_ms())
                codes0 = await asyncio.to_thread(target.codes)
                text0 = await asyncio.to_thread(h2load.scrape, target.metrics_port)
                run = await asyncio.to_thread(
                    h2load.run, target.addr, messages, load, seconds, deadline_s=LONG
                )
                text1 = await asyncio.to_thread(h2load.scrape, target.metrics_port)
                codes = h2load.code_deltas(codes0, h2load.grpc_codes(text1))
                buckets = bucket_deltas(answer_buckets(text0), answer_buckets(text1))
                row = h2load_row(run, codes, buckets, wall_s)
                rows.append(row)
                print(f"run {i + 1}: {json.dumps(row)}", flush=True)
        finally:
            stack.memory.set_latency("cold", stack.cold_ms)
    steps = json.loads(out.read_text()) if out.exists() else {}
    return {
        "rate": rate,
        "seconds": seconds,
        "probe": probe,
        "steps": summary(steps),
        "wall_ms": round(wall_s * 1e3, 3),
        "runs": rows,
        "machine_speed": spread(speed),
        "client_p99_ms": _median(rows, "client_p99_ms"),
        "server_p99_after_wall_ms": _median(rows, "server_p99_after_wall_ms"),
        "server_p50_after_wall_ms": _median(rows, "server_p50_after_wall_ms"),
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


async def measure_versus(
    root: Path, base: Path, rate: int, seconds: float, rounds: int, probe: bool
) -> dict[str, Any]:
    """`rounds` alternating h2load runs of `root`'s daemon and `base`'s (ABBA)."""
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "versus": []}
    for i in range(rounds):
        order = [("this", root), ("versus", base)]
        for side, where in order if i % 2 == 0 else order[::-1]:
            runs[side].append(await measure_h2load(where, rate, seconds, 1, probe))
            row = runs[side][-1]["runs"][0]
            print(f"round {i + 1} {side}: {json.dumps(row)}", flush=True)
    return {side: _merged(results) for side, results in runs.items()}


def _merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's runs as one result: its rows, medians, and its steps' medians per run."""
    rows = [r["runs"][0] for r in results]
    steps: dict[str, list[tuple[int, float, float]]] = {}
    for r in results:
        for name, n, p50, p90 in r["steps"]:
            steps.setdefault(name, []).append((n, p50, p90))
    speed = [r["machine_speed"]["median_ms"] for r in results if "median_ms" in r["machine_speed"]]
    return {
        **{k: results[0][k] for k in ("rate", "seconds", "probe", "wall_ms")},
        "runs": rows,
        "steps": [
            (
                name,
                sum(n for n, _, _ in got),
                [p50 for _, p50, _ in got],
                [p90 for _, _, p90 in got],
            )
            for name, got in sorted(steps.items())
        ],
        "machine_speed": spread(speed) if speed else results[0]["machine_speed"],
        "client_p99_ms": _median(rows, "client_p99_ms"),
        "server_p99_after_wall_ms": _median(rows, "server_p99_after_wall_ms"),
        "server_p50_after_wall_ms": _median(rows, "server_p50_after_wall_ms"),
    }


def _range(rows: list[dict[str, Any]], key: str) -> str:
    values = sorted(r[key] for r in rows if r[key] is not None)
    return f"{values[0]:g}-{values[-1]:g}" if values else "-"


def main_versus(args: argparse.Namespace, argv: list[str]) -> None:
    res = aio.run(
        measure_versus(
            args.root.resolve(),
            args.versus.resolve(),
            int(args.rate),
            args.seconds,
            args.repeats,
            args.probe,
        )
    )
    print(
        f"cold +100 ms, 1 s deadlines, {args.rate:.0f} rps, h2load, {args.repeats} alternating "
        f"rounds of {args.seconds:g} s; medians (ranges):"
    )
    for side, label in (("this", str(args.root)), ("versus", str(args.versus))):
        r = res[side]
        print(
            f"  {label}: client p99 {r['client_p99_ms']} ({_range(r['runs'], 'client_p99_ms')}) "
            f"ms; daemon past the wall p99 {r['server_p99_after_wall_ms']} "
            f"({_range(r['runs'], 'server_p99_after_wall_ms')}) ms, p50 "
            f"{r['server_p50_after_wall_ms']} ({_range(r['runs'], 'server_p50_after_wall_ms')}) ms"
        )
    if res["this"]["steps"]:
        print(f"{'step (ms from the wall): p50 per run':44s} this | versus")
        names = sorted({n for side in res.values() for n, *_ in side["steps"]})
        for name in names:
            cells = []
            for side in ("this", "versus"):
                got = [p50s for n, _, p50s, _ in res[side]["steps"] if n == name]
                cells.append(" ".join(f"{v:.2f}" for v in got[0]) if got else "-")
            print(f"  {name:42s} {cells[0]} | {cells[1]}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    if not args.no_figures:
        command = " ".join(["python -m benchmarks.load.after_wall", *argv])
        name = _short_commit(args.versus)
        both = figures_of(res["this"]) + figures_of(res["versus"], "versus", name)
        path = figures.record("load.after_wall", command, res["this"]["machine_speed"], both)
        print(f"recorded in {path}")


def _short_commit(checkout: Path) -> str:
    """The checkout's commit, as the figures name it."""
    got = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return got.stdout.strip() or str(checkout)


def figures_of(res: dict[str, Any], side: str = "", name: str = "") -> list[figures.Figure]:
    """The run's figures; `side` (e.g. "versus") keys those of the compared checkout `name`."""
    n, rate = len(res["runs"]), res["rate"]
    where = f"cold +100 ms, 1 s deadlines, {rate} rps, h2load, median of {n}"
    if side:
        where = f"the daemon of {name}, alternating with this code: {where}"
    figs = _figures(res, where)
    if not side:
        return figs
    return [
        figures.Figure(
            f.key.replace("h2load.", f"h2load.{side}.", 1),
            f.label,
            f.value,
            f.unit,
            f.source,
            f.beside,
        )
        for f in figs
    ]


def _figures(res: dict[str, Any], where: str) -> list[figures.Figure]:
    return [
        figures.Figure(
            "after_wall.h2load.client_p99_ms",
            f"client p99 ms ({where}; target beside)",
            res["client_p99_ms"],
            "ms",
            "load.after_wall",
            CLIENT_P99_MS,
        ),
        figures.Figure(
            "after_wall.h2load.server_p99_after_wall_ms",
            f"daemon p99 ms past the wall, ibex_answer_seconds ({where}; target beside)",
            res["server_p99_after_wall_ms"],
            "ms",
            "load.after_wall",
            AFTER_WALL_P99_MS,
        ),
        figures.Figure(
            "after_wall.h2load.server_p50_after_wall_ms",
            f"daemon p50 ms past the wall ({where})",
            res["server_p50_after_wall_ms"],
            "ms",
            "load.after_wall",
        ),
    ]


def main_h2load(args: argparse.Namespace, argv: list[str] | None) -> None:
    res = aio.run(
        measure_h2load(args.root.resolve(), int(args.rate), args.seconds, args.repeats, args.probe)
    )
    print(
        f"cold +100 ms, 1 s deadlines, {args.rate:.0f} rps, h2load, wall {res['wall_ms']} ms, "
        f"median of {len(res['runs'])} runs of {args.seconds:g} s:\n"
        f"  client p99 {res['client_p99_ms']} ms (target <= {CLIENT_P99_MS:g})\n"
        f"  daemon p99 past the wall {res['server_p99_after_wall_ms']} ms "
        f"(target <= {AFTER_WALL_P99_MS:g}); p50 {res['server_p50_after_wall_ms']} ms"
    )
    if res["steps"]:
        print(f"{'step (ms from the wall), all runs':40s} {'calls':>6s} {'p50':>7s} {'p90':>7s}")
        for name, n, p50, p90 in res["steps"]:
            print(f"{name:40s} {n:6d} {p50:7.3f} {p90:7.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    if not args.no_figures:
        command = " ".join(["python -m benchmarks.load.after_wall", *(argv or [])])
        path = figures.record("load.after_wall", command, res["machine_speed"], figures_of(res))
        print(f"recorded in {path}")


def retrieval_cost(blocks: int = 10, calls: int = 300) -> dict[str, list[float]]:
    """CPU µs per `retrieve` without a wall listener, with one that has answers made
    before the wall (a branch task waits for that instant) and with one that has them
    made at the wall only (`ahead` None), alternating blocks of `calls`, the branches
    landing in time (hot after 0.5 ms, cold after 1 ms): what waiting for the wall
    costs a call that never reaches it."""
    import trio

    from ibex.assembly.structs import AssemblyRequest
    from ibex.sources.retrieval import RetrievalConfig, retrieve
    from ibex.testing.samples import AGENT, ORG

    class Sources:
        async def hot(self, *args: Any, **kwargs: Any) -> list[Any]:
            await trio.sleep(0.0005)
            return []

        async def cold(self, *args: Any, **kwargs: Any) -> list[Any]:
            await trio.sleep(0.001)
            return []

    class Listener:
        def __init__(self, ahead: float | None) -> None:
            self.ahead = ahead

        def before_wall(self, got: Any) -> None: ...

        def wall_reached(self, got: Any) -> None: ...

    out: dict[str, list[float]] = {"no wall listener": [], "made before the wall": [],
                                   "made at the wall only": []}  # fmt: skip
    request = AssemblyRequest(agent_id=AGENT, org_id=ORG, query="q", model="gpt-4o")

    async def run() -> None:
        for i in range(blocks):
            sides = [
                ("no wall listener", None),
                ("made before the wall", Listener(0.003)),
                ("made at the wall only", Listener(None)),
            ]
            for side, listener in sides if i % 2 == 0 else sides[::-1]:
                t0 = time.process_time()
                for _ in range(calls):
                    await retrieve(
                        request,
                        directive_source=None,
                        memory_source=Sources(),  # type: ignore[arg-type]
                        config=RetrievalConfig(),
                        wall_listener=listener,  # type: ignore[arg-type]
                    )
                out[side].append((time.process_time() - t0) / calls * 1e6)

    trio.run(run)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose daemon runs")
    p.add_argument("--client", choices=("grpcio", "h2load"), default="grpcio")
    p.add_argument("--repeats", type=int, default=5, help="h2load runs (with --client h2load)")
    p.add_argument("--no-figures", action="store_true", help="do not update figures.json")
    p.add_argument("--probe", action="store_true", help="with --client h2load: the step probe too")
    p.add_argument(
        "--versus", type=Path, help="with --client h2load: alternate with this checkout's daemon"
    )
    p.add_argument(
        "--retrieval-cost",
        action="store_true",
        help="CPU per retrieval with and without a task waiting for the wall (in-process)",
    )
    args = p.parse_args(argv)
    if args.retrieval_cost:
        for side, values in retrieval_cost().items():
            print(
                f"{side:22s} CPU µs per retrieval, median "
                f"{statistics.median(values):.0f} (blocks {min(values):.0f}-{max(values):.0f})"
            )
        return
    if args.versus is not None:
        if args.client != "h2load":
            p.error("--versus goes with --client h2load")
        main_versus(args, argv if argv is not None else sys.argv[1:])
        return
    if args.probe and args.client != "h2load":
        p.error("--probe goes with --client h2load (the grpcio run always has it)")
    if args.client == "h2load":
        main_h2load(args, argv if argv is not None else sys.argv[1:])
        return
    res = aio.run(measure(args.root.resolve(), args.rate, args.seconds))
    client = res["client"]
    print(
        f"cold +100 ms, 1 s deadlines, {args.rate:.0f} rps, daemon from {args.root}: "
        f"client p50 {client['p50_ms']} ms, p99 {client['p99_ms']} ms"
    )
    print(f"{'step (ms from the wall)':40s} {'calls':>6s} {'p50':>7s} {'p90':>7s}")
    for name, n, p50, p90 in res["steps"]:
        print(f"{name:40s} {n:6d} {p50:7.3f} {p90:7.3f}")


if __name__ == "__main__":
    main()
