"""Cost curves: CPU per answer, its p99, and each stage's time against the work in a request.

Four axes, each varied with the others at the production shape of
`benchmarks.pipeline` (30 candidates, 4 history messages, 2 tool schemas,
mixed scripts): candidates (10, 30, 100, 300, 1,000 memories), history (1, 10,
100, 512 messages), tool schemas (0, 10, 100) and the script of the text
(ASCII against CJK, the same number of characters). A 16,000-token window
makes the packer choose once the candidates outgrow it.

The work is the pure pipeline (`assemble_pure`), run in this process with a
fresh nonce per call, CPU timed per call with `time.process_time_ns`: the
network, the event loop and the clients share nothing with it, so the curve is
the pipeline's own growth. Retrieval caps what reaches it through the daemon
(`IBEX_CONTEXT_HOT_LIMIT` and `_COLD_LIMIT` are at most 100 each); 300 and
1,000 candidates are what the pipeline would pay past that cap. Each stage is
re-run alone with the pipeline's own functions (as `benchmarks.pipeline`'s
stage table does), and its growth is fitted as an exponent (time ∝ work^k),
over all points and between the two largest (the growth where it matters;
flat starts hide it in the first), printed beside the complexity the stage
should have (`EXPECTED`); a stage whose top exponent exceeds it by more than
`TOLERANCE` is marked FASTER.

The plot (PNG, `--plot PATH`) needs matplotlib, an optional benchmark
dependency: without it the benchmark says so and writes the figures only.

Run: ``python -m benchmarks.load.curves [--quick] [--plot docs/cost-curves.png]``
(or ``just bench-curves``); JSON in ``benchmarks/results/load.curves.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import figures
from benchmarks.load import h2load
from benchmarks.load.capacity import Metered, metered
from benchmarks.load.driver import directive_version
from benchmarks.load.report import percentile
from benchmarks.load.speed import reference_cpu_ms, spread
from benchmarks.load.stack import Stack, free_port
from benchmarks.pipeline import CATEGORIES, CJK, CODE, EMOJI, ENGLISH
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.packer import pack
from ibex.assembly.pipeline import (
    AssemblyInputs,
    assemble_pure,
    count_fixed_sections,
    price,
    render_within_ceiling,
    resolve_model,
    select_candidates,
)
from ibex.assembly.structs import AssemblyRequest, BranchOutcome, Directive, MemoryHit, Message
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.xml_format import XML_TAGS, new_nonce
from ibex.testing.grpcio_stubs import context_pb2 as pb
from ibex.testing.samples import AGENT, ORG

RESULTS = Path(__file__).resolve().parents[1] / "results" / "load.curves.json"
AXES: dict[str, tuple[int, ...]] = {
    "candidates": (10, 30, 100, 300, 1000),
    "history": (1, 10, 100, 512),
    "tools": (0, 10, 100),
}
BASE = {"candidates": 30, "history": 4, "tools": 2}
SCRIPTS = {"mixed": (ENGLISH, CJK, CODE, EMOJI), "ascii": (ENGLISH,), "cjk": (CJK,)}
WINDOW = 16_000
MODEL = "gpt-4o"
STAGES = ("fixed sections", "select", "price", "pack", "render")
# The growth each stage should have along each axis, as an exponent of the work
# (1 = linear; n log n is read as 1 within the fit's tolerance), and why.
EXPECTED: dict[str, dict[str, tuple[float, str]]] = {
    "candidates": {
        "fixed sections": (0.0, "does not see candidates"),
        "select": (1.0, "filter and score each, one sort: n log n"),
        "price": (1.0, "escape and count each candidate's text: linear"),
        "pack": (
            1.0,
            "DP n x buckets (buckets fixed by the window), greedy n log n past the cell cap",
        ),
        "render": (1.0, "linear in the chosen text, at most the window"),
    },
    "history": {
        "fixed sections": (1.0, "counting is linear in the history's text"),
        "select": (0.0, "does not see history"),
        "price": (0.0, "does not see history"),
        "pack": (0.0, "the budget shrinks; buckets fall"),
        "render": (1.0, "linear in the text written"),
    },
    "tools": {
        "fixed sections": (1.0, "counting is linear in the schemas' text"),
        "select": (0.0, "does not see tools"),
        "price": (0.0, "does not see tools"),
        "pack": (0.0, "the budget shrinks; buckets fall"),
        "render": (1.0, "linear in the text written"),
    },
}
TOLERANCE = 0.3  # a fitted exponent this far above the expected one is "faster"
# Through the daemon: retrieval caps candidates at HOT_LIMIT + COLD_LIMIT (100 each).
DAEMON_AXES: dict[str, tuple[int, ...]] = {
    "candidates": (10, 30, 100, 200),
    "history": (1, 10, 100, 512),
    "tools": (0, 10, 100),
}
DAEMON_TENANTS = 2
DAEMON_RATE = 20  # calls/s from h2load, open loop: light, so p99 is the work's, not a queue's


def _text(rng: random.Random, sources: tuple[str, ...], length: int) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < length:
        src = rng.choice(sources)
        start = rng.randrange(len(src))
        parts.append(src[start : start + rng.randint(20, 200)])
    return "".join(parts)[:length]


def tool_schema(i: int) -> str:
    return json.dumps(
        {
            "name": f"tool_{i}",
            "description": f"Look up record kind {i} in the operations store",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        }
    )


def inputs(candidates: int, history: int, tools: int, script: str, seed: int = 7) -> AssemblyInputs:
    """A request of the given work: hits split half hot, half cold; unique contents."""
    rng = random.Random(seed)
    sources = SCRIPTS[script]
    hits = [
        MemoryHit(
            memory_id=f"{rng.getrandbits(128):032x}",
            org_id=ORG,
            agent_id=AGENT,
            content=f"{i}: " + _text(rng, sources, rng.randint(50, 800)),
            category=rng.choice(CATEGORIES),
            confidence=rng.random(),
            similarity=rng.random(),
            rank=i + 1,
            branch="hot" if i % 2 else "cold",
        )
        for i in range(candidates)
    ]
    roles = ("user", "assistant")
    messages = tuple(
        Message(roles[i % 2], _text(rng, sources, rng.randint(80, 400))) for i in range(history)
    )
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="how do I deploy billing safely?",
        model=MODEL,
        available_tokens=WINDOW,
        recent_messages=messages,
        tool_schemas=tuple(tool_schema(i) for i in range(tools)),
    )
    return AssemblyInputs(
        request=request,
        directive=Directive("You are the support assistant for Acme Cloud. " * 3, version_id="v1"),
        hot=tuple(h for h in hits if h.branch == "hot"),
        cold=tuple(h for h in hits if h.branch == "cold"),
        branches=(
            BranchOutcome("directive", "success", 1.0),
            BranchOutcome("hot", "success", 4.0),
            BranchOutcome("cold", "success", 20.0),
        ),
        nonce=new_nonce(16),
        now=time.time(),
    )


def whole(inp: AssemblyInputs, catalog: Catalog, tok: Tokenizers, calls: int) -> dict[str, Any]:
    """CPU µs per assembly (median, p99) over `calls` calls, each with a fresh nonce."""
    for _ in range(5):
        assemble_pure(
            msgspec.structs.replace(inp, nonce=new_nonce(16)), catalog=catalog, tokenizers=tok
        )
    batch = [msgspec.structs.replace(inp, nonce=new_nonce(16)) for _ in range(calls)]
    cpu = []
    for item in batch:
        t0 = time.process_time_ns()
        result = assemble_pure(item, catalog=catalog, tokenizers=tok)
        cpu.append((time.process_time_ns() - t0) / 1000.0)
    cpu.sort()
    return {
        "cpu_us_median": round(statistics.median(cpu), 1),
        "cpu_us_p99": round(percentile(cpu, 99), 1),
        "included": result.memories_included,
        "pack_path": result.pack.path,
        "tokens_used": result.tokens_used,
    }


def stages(inp: AssemblyInputs, catalog: Catalog, tok: Tokenizers, calls: int) -> dict[str, float]:
    """Median CPU µs of each stage, re-run one by one with the pipeline's functions."""
    request = inp.request
    cap = resolve_model(catalog, request.model, request.available_tokens)
    family = catalog.family(cap.tokenizer_family)
    counter = tok.counter(family.name, family.encoding)
    model = cap.model_id or request.model
    samples: dict[str, list[int]] = {s: [] for s in STAGES}
    for _ in range(calls):
        nonce = new_nonce(16)
        t0 = time.process_time_ns()
        fixed = count_fixed_sections(request, inp.directive, nonce, cap, family, counter, XML_TAGS)
        t1 = time.process_time_ns()
        candidates, _ = select_candidates(request, inp.hot, inp.cold, inp.now)
        t2 = time.process_time_ns()
        candidates = price(candidates, counter, XML_TAGS)
        t3 = time.process_time_ns()
        result = pack(candidates, fixed.budget.usable_budget)
        t4 = time.process_time_ns()
        render_within_ceiling(
            request, inp.directive, nonce, fixed, result.packed, counter, model, XML_TAGS
        )
        t5 = time.process_time_ns()
        for name, a, b in zip(STAGES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
            samples[name].append(b - a)
    return {name: round(statistics.median(s) / 1000.0, 2) for name, s in samples.items()}


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (time ∝ work^k); None below two points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return None if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def calls_for(work: int) -> int:
    return max(20, min(400, 12_000 // max(work, 10)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    catalog, tok = load_catalog(), Tokenizers(None, 65536)
    speed: list[float] = []
    out: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.curves", *sys.argv[1:]]),
        "axes": {},
    }
    scale = 0.25 if args.quick else 1.0
    for axis, points in AXES.items():
        rows = []
        for x in points:
            shape = {**BASE, axis: x}
            inp = inputs(shape["candidates"], shape["history"], shape["tools"], "mixed")
            n = max(5, int(calls_for(x if axis != "tools" else x * 3) * scale))
            speed.append(reference_cpu_ms())
            rows.append(
                {
                    "work": x,
                    **whole(inp, catalog, tok, n),
                    "stages_us": stages(inp, catalog, tok, n),
                }
            )
            print(f"{axis}={x}: {rows[-1]}", flush=True)
        fits = {}
        for stage in STAGES:
            xs = [r["work"] for r in rows]
            ys = [r["stages_us"][stage] for r in rows]
            k = exponent(xs, ys)
            top = exponent(xs[-2:], ys[-2:])  # the growth at the largest work
            want, why = EXPECTED[axis][stage]
            fits[stage] = {
                "exponent": None if k is None else round(k, 2),
                "top_exponent": None if top is None else round(top, 2),
                "expected": want,
                "why": why,
                "follows": top is not None and top <= want + TOLERANCE,
            }
        whole_k = exponent([r["work"] for r in rows], [r["cpu_us_median"] for r in rows])
        out["axes"][axis] = {"rows": rows, "fits": fits, "whole_exponent": whole_k}
    scripts = {}
    for script in ("ascii", "cjk"):
        inp = inputs(BASE["candidates"], BASE["history"], BASE["tools"], script)
        n = max(5, int(300 * scale))
        speed.append(reference_cpu_ms())
        scripts[script] = {**whole(inp, catalog, tok, n), "stages_us": stages(inp, catalog, tok, n)}
    out["scripts"] = scripts
    if not args.no_daemon:
        out["daemon"] = daemon_curves(3.0 if args.quick else 10.0, speed)
    out["machine_speed"] = spread(speed)
    return out


def daemon_request(tenant: int, history: int, tools: int, script: str, seed: int = 11) -> bytes:
    """One serialized AssembleContextRequest of the given work for tenant `tenant`."""
    from benchmarks.load.memory import tenants

    org, agent = tenants(DAEMON_TENANTS)[tenant]
    rng = random.Random(seed + tenant)
    sources = SCRIPTS[script]
    roles = ("user", "assistant")
    return pb.AssembleContextRequest(
        agent_id=agent,
        org_id=org,
        session_id=f"curves-{tenant}",
        query=_text(rng, sources, 60),
        model=MODEL,
        available_tokens=WINDOW,
        recent_messages=[
            pb.Message(role=roles[i % 2], content=_text(rng, sources, rng.randint(80, 400)))
            for i in range(history)
        ],
        tool_schemas=[tool_schema(i) for i in range(tools)],
        directive_version_id=directive_version(tenant),
    ).SerializeToString()


def daemon_row(target: Metered, messages: list[bytes], seconds: float) -> dict[str, Any]:
    """Warm for a second, then `seconds` at DAEMON_RATE: CPU per answer, p50/p99, statuses."""
    load = h2load.Load(DAEMON_RATE, clients=DAEMON_TENANTS)
    h2load.run(target.addr, messages, load, 1.0)
    codes0, cpu0 = target.codes(), target.cpu()
    run = h2load.run(target.addr, messages, load, seconds)
    cpu = target.cpu() - cpu0
    row = run.summary(cpu, h2load.code_deltas(codes0, target.codes()))
    calls = sum(row["statuses"].values())
    # CPU per call finished (any status) beside CPU per answer: refused and cut calls
    # cost CPU too, and a curve of CPU over OK answers alone bends up when they appear.
    row["cpu_ms_per_call"] = round(cpu * 1000.0 / calls, 3) if calls else None
    keys = ("answers", "cpu_ms_per_answer", "cpu_ms_per_call", "p50_ms", "p99_ms", "statuses")
    return {k: row[k] for k in keys}


def daemon_curves(seconds: float, speed: list[float]) -> dict[str, Any]:
    """The same axes through the daemon on the standard stack, from h2load."""
    out: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for n in DAEMON_AXES["candidates"]:
        hot, cold = n // 2, n - n // 2
        with Stack(DAEMON_TENANTS, hits=(hot, cold)) as stack:
            port = free_port()
            daemon = stack.daemon(
                1,
                IBEX_CONTEXT_HOT_LIMIT=str(hot),
                IBEX_CONTEXT_COLD_LIMIT=str(cold),
                IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{port}",
            )
            with metered(daemon, port) as target:
                msgs = [daemon_request(t, BASE["history"], BASE["tools"], "mixed") for t in (0, 1)]
                speed.append(reference_cpu_ms())
                rows.append({"work": n, **daemon_row(target, msgs, seconds)})
                print(f"daemon candidates={n}: {rows[-1]}", flush=True)
    out["candidates"] = rows
    with Stack(DAEMON_TENANTS) as stack:
        port = free_port()
        with metered(stack.daemon(1, IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{port}"), port) as t:
            for axis in ("history", "tools"):
                rows = []
                for x in DAEMON_AXES[axis]:
                    shape = {**BASE, axis: x}
                    msgs = [
                        daemon_request(i, shape["history"], shape["tools"], "mixed") for i in (0, 1)
                    ]
                    speed.append(reference_cpu_ms())
                    rows.append({"work": x, **daemon_row(t, msgs, seconds)})
                    print(f"daemon {axis}={x}: {rows[-1]}", flush=True)
                out[axis] = rows
            scripts = {}
            for script in ("ascii", "cjk"):
                msgs = [daemon_request(i, 40, BASE["tools"], script) for i in (0, 1)]
                speed.append(reference_cpu_ms())
                scripts[script] = daemon_row(t, msgs, seconds)
            out["scripts"] = scripts
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"{'axis':<11} {'work':>5} {'CPU µs p50':>10} {'p99':>8} {'path':>6}  stages µs"]
    for axis, data in out["axes"].items():
        for r in data["rows"]:
            st = " ".join(f"{k.split()[0]} {v:.0f}" for k, v in r["stages_us"].items())
            lines.append(
                f"{axis:<11} {r['work']:>5} {r['cpu_us_median']:>10.0f} {r['cpu_us_p99']:>8.0f} "
                f"{r['pack_path']:>6}  {st}"
            )
    for script, r in out["scripts"].items():
        lines.append(
            f"{'script':<11} {script:>5} {r['cpu_us_median']:>10.0f} {r['cpu_us_p99']:>8.0f}"
        )
    lines.append(
        "growth (time ∝ work^k): k over all points, k between the two largest / expected k"
    )
    for axis, data in out["axes"].items():
        parts = []
        for stage, f in data["fits"].items():
            k = "-" if f["exponent"] is None else f"{f['exponent']:.2f}"
            top = "-" if f["top_exponent"] is None else f"{f['top_exponent']:.2f}"
            mark = "" if f["follows"] else " FASTER"
            parts.append(f"{stage} {k}, {top}/{f['expected']:g}{mark}")
        lines.append(f"  {axis}: " + ", ".join(parts))
    daemon = out.get("daemon")
    if daemon:
        lines.append(
            f"through the daemon (h2load, {DAEMON_RATE} calls/s): "
            "axis, work, CPU ms/answer, CPU ms/call, p50 / p99 ms, statuses"
        )
        for axis in DAEMON_AXES:
            for r in daemon[axis]:
                lines.append(
                    f"  {axis:<11} {r['work']:>5} {_num(r['cpu_ms_per_answer'], '.2f'):>7} "
                    f"{_num(r['cpu_ms_per_call'], '.2f'):>7} "
                    f"{r['p50_ms']:>7.1f} / {r['p99_ms']:<7.1f} {r['statuses']}"
                )
        for script, r in daemon["scripts"].items():
            lines.append(
                f"  {'script 40 msgs':<11} {script:>5} {_num(r['cpu_ms_per_answer'], '.2f'):>7} "
                f"{_num(r['cpu_ms_per_call'], '.2f'):>7} "
                f"{r['p50_ms']:>7.1f} / {r['p99_ms']:<7.1f} {r['statuses']}"
            )
    lines.append(f"reference work, ms of CPU (lower is faster): {out['machine_speed']}")
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(out: dict[str, Any], path: Path) -> bool:
    """The curves as a PNG; False (with a message) when matplotlib is not installed."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    daemon = out.get("daemon")
    nrows = 2 if daemon else 1
    fig, grid = plt.subplots(nrows, len(AXES), figsize=(5 * len(AXES), 4 * nrows), squeeze=False)
    axes = grid[0]
    for ax, (axis, data) in zip(axes, out["axes"].items(), strict=True):
        xs = [r["work"] for r in data["rows"]]
        ax.plot(xs, [r["cpu_us_median"] for r in data["rows"]], "o-", label="whole, p50")
        ax.plot(xs, [r["cpu_us_p99"] for r in data["rows"]], "o--", label="whole, p99")
        for stage in STAGES:
            ax.plot(xs, [r["stages_us"][stage] for r in data["rows"]], ".:", label=stage)
        ax.set_xscale("symlog" if min(xs) == 0 else "log")
        ax.set_yscale("log")
        ax.set_xlabel(axis)
        ax.set_ylabel("CPU µs per assembly")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    if daemon:
        for ax, axis in zip(grid[1], DAEMON_AXES, strict=True):
            rows = daemon[axis]
            xs = [r["work"] for r in rows]
            ax.plot(xs, [r["cpu_ms_per_answer"] or 0 for r in rows], "o-", label="CPU ms/answer")
            ax.plot(xs, [r["p99_ms"] for r in rows], "o--", label="p99 ms (h2load)")
            ax.set_xscale("symlog" if min(xs) == 0 else "log")
            ax.set_yscale("log")
            ax.set_xlabel(f"{axis} (through the daemon, {DAEMON_RATE} calls/s)")
            ax.set_ylabel("ms")
            ax.grid(True, which="both", alpha=0.3)
        grid[1][0].legend(fontsize=7)
    s = out["scripts"]
    fig.suptitle(
        f"assemble_pure cost against work (ASCII {s['ascii']['cpu_us_median']:.0f} µs, "
        f"CJK {s['cjk']['cpu_us_median']:.0f} µs at the base shape)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")
    return True


def figures_of(out: dict[str, Any]) -> list[figures.Figure]:
    src = "load.curves"
    found = []
    for axis, data in out["axes"].items():
        last = data["rows"][-1]
        first = data["rows"][0]
        found.append(
            figures.Figure(
                f"curves.{axis}.cpu_us",
                f"pipeline CPU µs per assembly, {axis} {first['work']} → {last['work']}",
                last["cpu_us_median"],
                "µs",
                src,
                beside=first["cpu_us_median"],
            )
        )
    for axis, rows in (out.get("daemon") or {}).items():
        if axis == "scripts":
            continue
        found.append(
            figures.Figure(
                f"curves.daemon.{axis}.cpu_ms",
                f"daemon CPU ms/answer, {axis} {rows[0]['work']} → {rows[-1]['work']} (h2load)",
                rows[-1]["cpu_ms_per_answer"],
                "ms",
                src,
                beside=rows[0]["cpu_ms_per_answer"],
            )
        )
        found.append(
            figures.Figure(
                f"curves.daemon.{axis}.p99_ms",
                f"daemon p99 ms, {axis} {rows[0]['work']} → {rows[-1]['work']} (h2load)",
                rows[-1]["p99_ms"],
                "ms",
                src,
                beside=rows[0]["p99_ms"],
            )
        )
    s = out["scripts"]
    found.append(
        figures.Figure(
            "curves.cjk_over_ascii",
            "pipeline CPU per assembly, CJK ÷ ASCII text",
            round(s["cjk"]["cpu_us_median"] / s["ascii"]["cpu_us_median"], 3),
            "×",
            src,
        )
    )
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a quarter of the calls per point")
    p.add_argument("--plot", type=Path, help="write the curves as a PNG (needs matplotlib)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-figures", action="store_true", help="do not update figures.json")
    p.add_argument("--no-daemon", action="store_true", help="the in-process curves only")
    args = p.parse_args(argv)
    out = measure(args)
    out["table"] = table(out)
    print(out["table"])
    if args.plot:
        plot(out, args.plot)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    if not args.no_figures:
        path = figures.record("load.curves", out["command"], out["machine_speed"], figures_of(out))
        print(f"recorded in {path}")


if __name__ == "__main__":
    main()
