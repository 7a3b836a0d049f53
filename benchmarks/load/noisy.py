"""Noisy tenant: one org's large calls saturate the worker threads; does another org get OK?

One org keeps `--in-flight` calls open, each with a fresh ~100 K-character tool
schema; another org calls at `--rps` with `--deadline-ms` deadlines (45 ms, the
proxy's). Reported, never asserted: the quiet org's status counts and OK share
(target: every call OK), a baseline of the same calls without the noisy org,
and the noisy org's status counts. The machine's load average is recorded with
each run: on a shared 2-core box the baseline itself shows what the machine allows.

Run: ``.venv/bin/python -m benchmarks.load.noisy [--calls 250] [--in-flight 32]``
(table on stdout, JSON in ``benchmarks/results/noisy.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from ibex.testing.grpcio_stubs import context_pb2_grpc
from ibex.testing.memory_server import DEMO_AGENT, DEMO_ORG
from ibex.testing.noisy_tenant import NoisyTenant, daemon_with_memory, probe, request

RESULTS = Path(__file__).resolve().parents[1] / "results" / "noisy.json"


def share(codes: Counter[str]) -> float:
    total = sum(codes.values())
    return round(codes["OK"] / total, 4) if total else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = args.deadline_ms / 1000
    out: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.load.noisy", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "in_flight": args.in_flight,
        "rps": args.rps,
        "deadline_ms": args.deadline_ms,
        "calls": args.calls,
        "schemas": "cjk" if args.cjk else "ascii",
    }
    with (
        tempfile.TemporaryDirectory() as logs,
        daemon_with_memory(Path(logs)) as daemon,
        grpc.insecure_channel(daemon.target) as noisy_channel,
        grpc.insecure_channel(daemon.target) as quiet_channel,
    ):
        quiet = context_pb2_grpc.ContextAssemblyServiceStub(quiet_channel)
        quiet.AssembleContext(request(DEMO_ORG, DEMO_AGENT), timeout=10)
        probe(quiet, 50, deadline, args.rps)  # warm-up, not reported
        out["loadavg_before"] = os.getloadavg()[0]
        baseline = probe(quiet, args.calls, deadline, args.rps)
        noisy = NoisyTenant(
            context_pb2_grpc.ContextAssemblyServiceStub(noisy_channel), args.in_flight, args.cjk
        )
        noisy.start()
        try:
            time.sleep(1.0)  # the worker threads are busy before the quiet org calls
            loaded = probe(quiet, args.calls, deadline, args.rps)
        finally:
            noisy.stop()
        out["loadavg_after"] = os.getloadavg()[0]
    out["baseline"] = {"codes": dict(baseline), "ok_share": share(baseline)}
    out["with_noisy"] = {"codes": dict(loaded), "ok_share": share(loaded)}
    out["noisy"] = {"codes": dict(noisy.codes)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=250, help="quiet-org calls per phase")
    p.add_argument("--rps", type=float, default=50.0)
    p.add_argument("--deadline-ms", type=float, default=45.0)
    p.add_argument("--in-flight", type=int, default=32, help="noisy org's large calls open")
    p.add_argument("--cjk", action="store_true", help="CJK schemas: the costliest to count")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    out = run(args)
    print(f"{'phase':<12} {'OK share':>9}  codes")
    for phase in ("baseline", "with_noisy"):
        print(f"{phase:<12} {out[phase]['ok_share']:>9.1%}  {out[phase]['codes']}")
    print(f"noisy org: {out['noisy']['codes']}; load average {out['loadavg_after']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
