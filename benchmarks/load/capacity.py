"""Capacity and the floor at one worker and at one per core, from two clients, in one run.

For one worker and for `--workers 2`, the daemon on the standard stack (real
Redis, the memory stand-in hot 2 ms / cold 8 ms, `IBEX_CONTEXT_METRICS_ADDR`
set so each call's gRPC status is read from its own counters) alternates with
the stack's floor driven the same way: grpclib on trio-asyncio with one
crossing into Trio and a canned answer (`benchmarks.load.floor`), as many floor
processes on one port (SO_REUSEPORT) as the daemon has workers. Each runs at
100 and 200 rps (open loop) and saturated (a closed loop), from h2load
(`benchmarks.load.h2load`: 4 connections, 8 streams each when closed) and from
the grpcio driver (`benchmarks.load.driver`: 4 channels, 32 callers when
closed), so the client's share of capacity and of the tail shows beside each
figure.

CPU per answer is the target's CPU from /proc (supervisor and workers; every
floor process) over the calls answered OK. The ratio to the floor is the
median of each repeat's ibex row over the floor row measured seconds before
it. Then, on the bundled sample (no Redis, no stand-in sharing the cores),
answers/s saturated with one worker and with two, alternating: the scaling
ratio. The machine's speed reference (`benchmarks.load.speed`) is timed before
every row.

Targets printed beside the ratios: CPU per answer <= 2.0x the floor at 100 and
200 rps and <= 2.5x saturated; two workers >= 1.7x the answers/s of one on the
bundled sample.

Run: ``python -m benchmarks.load.capacity [--quick]`` (or ``just bench-capacity``);
JSON in ``benchmarks/results/load.capacity.json``; the current figures go to
the results file behind docs/performance.md (`benchmarks.figures`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

from benchmarks import aio, figures
from benchmarks.load import h2load
from benchmarks.load.driver import Driver, build_requests, fixed_rate
from benchmarks.load.floor import _Bare
from benchmarks.load.report import summarize
from benchmarks.load.speed import reference_cpu_ms, spread
from benchmarks.load.stack import ROOT, Daemon, Stack, free_port, wait_listening
from ibex.sources.local_file import SAMPLE_AGENT_ID, SAMPLE_ORG_ID

RESULTS = Path(__file__).resolve().parents[1] / "results" / "load.capacity.json"
LOADS = (h2load.Load(100), h2load.Load(200), h2load.Load(None))
CLIENTS = ("h2load", "grpcio")
CALLERS = 32  # grpcio closed loop; h2load's is 4 connections x 8 streams
DEADLINE_S = 1.0
CPU_LIMITS = {"100rps": 2.0, "200rps": 2.0, "closed": 2.5}
SCALING_TARGET = 1.7


class Target(Protocol):
    addr: str

    def cpu(self) -> float: ...


class FloorWorkers:
    """`n` floor servers (trio-asyncio mode) sharing one port, as a daemon's workers do."""

    def __init__(self, n: int) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.servers: list[_Bare] = []
        try:
            for _ in range(n):
                self.servers.append(_Bare("trio-asyncio", self.port))
            if not wait_listening(self.servers[-1].proc, self.port, n):
                raise RuntimeError(f"{n} floor servers did not all listen")
        except BaseException:
            self.stop()
            raise

    def cpu(self) -> float:
        return sum(s.cpu() for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class Metered:
    """A daemon and the port of its /metrics."""

    def __init__(self, daemon: Daemon, metrics_port: int) -> None:
        self.daemon = daemon
        self.addr = daemon.addr
        self.metrics_port = metrics_port

    def cpu(self) -> float:
        return self.daemon.cpu()

    def codes(self) -> dict[str, float]:
        return h2load.grpc_codes(h2load.scrape(self.metrics_port))


def auth_env(token: str | None) -> dict[str, str]:
    """The daemon setting that makes it accept `token` (and only it) as a bearer token."""
    if not token:
        return {}
    return {"IBEX_CONTEXT_AUTH_TOKENS_SHA256": hashlib.sha256(token.encode()).hexdigest()}


def sample_env(port: int, metrics_port: int, token: str | None = None) -> dict[str, str]:
    """The daemon on the bundled sample: no Redis, no memory service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_CONTEXT_")}
    env.update(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{port}",
        IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{metrics_port}",
        IBEX_CONTEXT_LOG_LEVEL="warning",
        PYTHONPATH=str(ROOT),
    )
    env.update(auth_env(token))
    return env


@contextmanager
def metered(daemon_cm: Any, metrics_port: int) -> Iterator[Metered]:
    with daemon_cm as daemon:
        if not wait_listening(daemon.proc, metrics_port):
            raise RuntimeError("the daemon's /metrics did not start")
        yield Metered(daemon, metrics_port)


@contextmanager
def stack_daemon(
    stack: Stack, workers: int, token: str | None, root: Path = ROOT, **extra: str
) -> Iterator[Metered]:
    """A daemon (of checkout `root`, with `extra` settings) on the standard stack with
    /metrics (and auth when `token` is given)."""
    port, metrics_port = free_port(), free_port()
    env = stack.env(port, root, **extra)
    env["IBEX_CONTEXT_METRICS_ADDR"] = f"127.0.0.1:{metrics_port}"
    env.update(auth_env(token))
    with _metered(Daemon(env, workers, port, root), metrics_port, "the daemon") as metered:
        yield metered


@contextmanager
def sample_daemon(workers: int, token: str | None = None) -> Iterator[Metered]:
    port, metrics_port = free_port(), free_port()
    daemon = Daemon(sample_env(port, metrics_port, token), workers, port)
    with _metered(daemon, metrics_port, "the sample daemon") as metered:
        yield metered


@contextmanager
def _metered(d: Daemon, metrics_port: int, what: str) -> Iterator[Metered]:
    """`d` once its /metrics listens, stopped on the way out (also when it never does)."""
    try:
        if not wait_listening(d.proc, metrics_port):
            raise RuntimeError(f"{what}'s /metrics did not start")
        yield Metered(d, metrics_port)
    finally:
        d.stop()


class Rows:
    """Runs one row (a client against a target at a load) and keeps the request material."""

    def __init__(
        self,
        tenants: list[tuple[str, str]],
        versions: bool,
        seconds: float,
        token: str | None = None,
    ) -> None:
        self.tenants = tenants
        self.token = token
        self.versions = versions
        self.seconds = seconds
        self.salt = 0
        # One request per tenant for h2load (one h2load process each; 4 connections in all).
        self.messages = build_requests(tenants, len(tenants), 0, versions=versions)
        self.speed: list[float] = []

    async def row(
        self, client: str, target: Target, driver: Driver, load: h2load.Load
    ) -> dict[str, Any]:
        self.salt += 1
        ref = reference_cpu_ms()
        self.speed.append(ref)
        codes0 = target.codes() if isinstance(target, Metered) else None
        cpu0 = target.cpu()
        if client == "h2load":
            run = await asyncio.to_thread(
                h2load.run,
                target.addr,
                self.messages,
                load,
                self.seconds,
                deadline_s=DEADLINE_S,
                token=self.token,
            )
            cpu = target.cpu() - cpu0
            codes = None
            if isinstance(target, Metered) and codes0 is not None:
                codes = h2load.code_deltas(codes0, target.codes())
            out = run.summary(cpu, codes)
        else:
            if load.rps is None:
                reqs = build_requests(self.tenants, 4096, self.salt, versions=self.versions)
                rec = await driver.closed_loop(reqs, CALLERS, self.seconds, DEADLINE_S)
            else:
                n = int(load.rps * self.seconds)
                reqs = build_requests(self.tenants, n, self.salt, versions=self.versions)
                sched = fixed_rate((load.rps, self.seconds))
                rec = await driver.open_loop(reqs, sched, DEADLINE_S)
            s = summarize(rec, daemon_cpu_s=target.cpu() - cpu0, aux_cpu_s={})
            out = {
                "client": "grpcio",
                "calls": s["calls"],
                "answers": s["answers"],
                "answers_per_s": s["achieved_rps"],
                "p50_ms": s["p50_ms"],
                "p90_ms": s["p90_ms"],
                "p99_ms": s["p99_ms"],
                "statuses": {"OK": s["answers"], **s["errors"]},
                "cpu_ms_per_answer": s["daemon_cpu_ms_per_answer"],
                "client_cpu_cores": s["driver_cpu_cores"],
            }
        out["ref_cpu_ms"] = round(ref, 1)
        await asyncio.sleep(0.2)
        return out


async def warm(rows: Rows, targets: Sequence[tuple[Target, Driver]]) -> None:
    """Connections, caches and first-call imports, before anything is measured."""
    for target, driver in targets:
        await driver.ready()
        await asyncio.to_thread(
            h2load.run, target.addr, rows.messages, h2load.Load(100), 1.0, token=rows.token
        )
        reqs = build_requests(rows.tenants, 100, 0, versions=rows.versions)
        await driver.open_loop(reqs, fixed_rate((100, 1.0)), DEADLINE_S)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats, with the per-repeat CPU figures kept for the paired ratio."""

    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    statuses: dict[str, int] = {}
    for r in runs:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "cpu_ms_per_answer": med("cpu_ms_per_answer"),
        "answers_per_s": med("answers_per_s"),
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        "client_cpu_cores": med("client_cpu_cores"),
        "statuses": statuses,
        "cpu_ms_per_answer_runs": [r["cpu_ms_per_answer"] for r in runs],
        "answers_per_s_runs": [r["answers_per_s"] for r in runs],
        "samples": len(runs),
    }


def paired_ratio(runs: Sequence[float | None], base: Sequence[float | None]) -> float | None:
    """Median of repeat-by-repeat ratios (each pair measured seconds apart)."""
    pairs = [a / b for a, b in zip(runs, base, strict=True) if a is not None and b]
    return round(statistics.median(pairs), 3) if pairs else None


async def stack_part(args: argparse.Namespace, speed: list[float]) -> dict[str, Any]:
    """ibex beside the floor, per worker count, load and client."""
    out: dict[str, Any] = {}
    with Stack() as stack:
        for workers in args.workers:
            rows = Rows(stack.tenants, True, args.seconds, args.token)
            with ExitStack() as stop:
                ibex = stop.enter_context(stack_daemon(stack, workers, args.token))
                floor = FloorWorkers(workers)
                stop.callback(floor.stop)
                drivers = {
                    "ibex": Driver(ibex.addr, token=args.token),
                    "floor": Driver(floor.addr, token=args.token),
                }
                try:
                    await warm(rows, [(ibex, drivers["ibex"]), (floor, drivers["floor"])])
                    got: dict[str, list[dict[str, Any]]] = {}
                    for _ in range(args.repeats):
                        for load in LOADS:
                            for client in CLIENTS:
                                for name, target in (("ibex", ibex), ("floor", floor)):
                                    r = await rows.row(client, target, drivers[name], load)
                                    got.setdefault(f"{name}|{client}|{load.label}", []).append(r)
                finally:
                    for d in drivers.values():
                        await d.close()
            speed += rows.speed
            for key, runs in got.items():
                name, client, label = key.split("|")
                out.setdefault(f"w{workers}", {}).setdefault(client, {}).setdefault(label, {})[
                    name
                ] = medians(runs)
            for client in CLIENTS:
                for load in LOADS:
                    cell = out[f"w{workers}"][client][load.label]
                    cell["ratio"] = paired_ratio(
                        cell["ibex"]["cpu_ms_per_answer_runs"],
                        cell["floor"]["cpu_ms_per_answer_runs"],
                    )
    return out


async def sample_part(args: argparse.Namespace, speed: list[float]) -> dict[str, Any]:
    """Saturated answers/s on the bundled sample, one worker against two, alternating."""
    rows = Rows([(SAMPLE_ORG_ID, SAMPLE_AGENT_ID)], False, args.seconds, args.token)
    closed = h2load.Load(None)
    got: dict[str, list[dict[str, Any]]] = {}
    with sample_daemon(1, args.token) as one, sample_daemon(2, args.token) as two:
        targets = {1: one, 2: two}
        drivers = {w: Driver(t.addr, token=args.token) for w, t in targets.items()}
        try:
            await warm(rows, [(targets[w], drivers[w]) for w in targets])
            for _ in range(args.repeats):
                for client in CLIENTS:
                    for w, target in targets.items():
                        r = await rows.row(client, target, drivers[w], closed)
                        got.setdefault(f"{client}|{w}", []).append(r)
        finally:
            for d in drivers.values():
                await d.close()
    speed += rows.speed
    out: dict[str, Any] = {}
    for client in CLIENTS:
        m1, m2 = medians(got[f"{client}|1"]), medians(got[f"{client}|2"])
        out[client] = {
            "w1": m1,
            "w2": m2,
            "scaling": paired_ratio(m2["answers_per_s_runs"], m1["answers_per_s_runs"]),
        }
    return out


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def verdict(value: float | None, limit: float, at_least: bool = False) -> str:
    if value is None:
        return "short"
    return "met" if (value >= limit if at_least else value <= limit) else "short"


def table(out: Mapping[str, Any]) -> str:
    """Every row side by side, then the ratios against their targets."""
    lines = [
        f"{'workers':>7} {'client':<7} {'load':>7} | {'CPU ms/answer ibex':>18} {'floor':>6} "
        f"{'ratio':>6} | {'answers/s ibex':>14} {'floor':>6} | {'p50/p99 ms ibex':>16} "
        f"{'floor':>12} | {'client cores':>12}"
    ]
    for wkey, by_client in out.get("stack", {}).items():
        for client, by_load in by_client.items():
            for label, cell in by_load.items():
                i, f = cell["ibex"], cell["floor"]
                icpu, fcpu = _f(i["cpu_ms_per_answer"], ".2f"), _f(f["cpu_ms_per_answer"], ".2f")
                lines.append(
                    f"{wkey[1:]:>7} {client:<7} {label:>7} | {icpu:>18} {fcpu:>6} "
                    f"{_f(cell['ratio'], '.2f'):>5}x | "
                    f"{_f(i['answers_per_s'], '.0f'):>14} {_f(f['answers_per_s'], '.0f'):>6} | "
                    f"{_f(i['p50_ms'], '.1f'):>7}/{_f(i['p99_ms'], '.1f'):<8} "
                    f"{_f(f['p50_ms'], '.1f'):>5}/{_f(f['p99_ms'], '.1f'):<6} | "
                    f"{_f(i['client_cpu_cores'], '.2f'):>12}"
                )
                bad = {k: v for k, v in i["statuses"].items() if k != "OK"}
                if bad:
                    lines.append(f"{'':>25} ibex statuses other than OK: {bad}")
    lines.append("ratios (target):")
    for wkey, by_client in out.get("stack", {}).items():
        for client, by_load in by_client.items():
            parts = []
            for label, limit in CPU_LIMITS.items():
                r = by_load[label]["ratio"]
                parts.append(f"{label} {_f(r, '.2f')}x (<= {limit}x {verdict(r, limit)})")
            lines.append(
                f"  CPU/answer ibex/floor, workers {wkey[1:]}, {client}: " + ", ".join(parts)
            )
    for client, s in out.get("sample", {}).items():
        lines.append(
            f"  bundled sample, {client}: 2 workers {_f(s['w2']['answers_per_s'], '.0f')}/s, "
            f"1 worker {_f(s['w1']['answers_per_s'], '.0f')}/s: {_f(s['scaling'], '.2f')}x "
            f"(>= {SCALING_TARGET}x {verdict(s['scaling'], SCALING_TARGET, True)})"
        )
    stack = out.get("stack", {})
    if "w1" in stack and "w2" in stack:
        for client in CLIENTS:
            a1 = stack["w1"][client]["closed"]["ibex"]["answers_per_s"]
            a2 = stack["w2"][client]["closed"]["ibex"]["answers_per_s"]
            if a1 and a2:
                lines.append(
                    f"  standard stack (Redis and the stand-in share the cores), {client}: "
                    f"2 workers / 1 = {a2 / a1:.2f}x (no target)"
                )
    lines.append(f"reference work, ms of CPU (lower is faster): {out['machine_speed']}")
    return "\n".join(lines)


def figures_of(out: Mapping[str, Any]) -> list[figures.Figure]:
    """The figures this benchmark contributes to docs/performance.md's current table."""
    found: list[figures.Figure] = []
    src = "load.capacity"
    for wkey, by_client in out.get("stack", {}).items():
        w = wkey[1:]
        workers = f"{w} worker" + ("" if w == "1" else "s")
        for client, by_load in by_client.items():
            for label in CPU_LIMITS:
                cell = by_load[label]
                where = "saturated" if label == "closed" else label.replace("rps", " rps")
                found.append(
                    figures.Figure(
                        f"capacity.w{w}.{client}.{label}.cpu_ratio",
                        f"CPU/answer ibex ÷ floor, {workers}, {where}, {client}",
                        cell["ratio"],
                        "×",
                        src,
                    )
                )
                found.append(
                    figures.Figure(
                        f"capacity.w{w}.{client}.{label}.cpu_ms",
                        f"CPU ms/answer ibex / floor, {workers}, {where}, {client}",
                        cell["ibex"]["cpu_ms_per_answer"],
                        "ms",
                        src,
                        beside=cell["floor"]["cpu_ms_per_answer"],
                    )
                )
            closed = by_load["closed"]
            found.append(
                figures.Figure(
                    f"capacity.w{w}.{client}.answers_per_s",
                    f"answers/s saturated ibex / floor, {workers}, {client}",
                    closed["ibex"]["answers_per_s"],
                    "answers/s",
                    src,
                    beside=closed["floor"]["answers_per_s"],
                )
            )
            found.append(
                figures.Figure(
                    f"capacity.w{w}.{client}.200rps.p99",
                    f"p99 ms at 200 rps ibex / floor, {workers}, {client}",
                    by_load["200rps"]["ibex"]["p99_ms"],
                    "ms",
                    src,
                    beside=by_load["200rps"]["floor"]["p99_ms"],
                )
            )
    for client, s in out.get("sample", {}).items():
        found.append(
            figures.Figure(
                f"capacity.sample.{client}.scaling",
                f"answers/s 2 workers ÷ 1, bundled sample, saturated, {client}",
                s["scaling"],
                "×",
                src,
            )
        )
    return found


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    speed: list[float] = []
    out: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.capacity", *sys.argv[1:]])
    }
    if not args.sample_only:
        out["stack"] = await stack_part(args, speed)
    if not args.no_sample:
        out["sample"] = await sample_part(args, speed)
    out["machine_speed"] = spread(speed)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of 2 s per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts")
    p.add_argument("--no-sample", action="store_true", help="skip the bundled-sample scaling")
    p.add_argument("--sample-only", action="store_true", help="only the bundled-sample scaling")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--no-figures", action="store_true", help="do not update the results file of figures"
    )
    p.add_argument(
        "--auth",
        action="store_true",
        help="auth on: the daemons accept one random bearer token, both clients send it",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.seconds = 1, 2.0
    args.token = secrets.token_urlsafe(24) if args.auth else None
    h2load.h2load_path()
    out = aio.run(measure(args))
    text = table(out)
    out["table"] = text
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_figures:
        path = figures.record(
            "load.capacity", out["command"], out["machine_speed"], figures_of(out)
        )
        print(f"recorded {len(figures_of(out))} figures in {path}")


if __name__ == "__main__":
    main()
