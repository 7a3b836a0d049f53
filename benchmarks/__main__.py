"""`just bench`: run every benchmark, each in its own process, and collect their JSON.

Each benchmark is a module with a `main()` that prints its tables and writes
`benchmarks/results/<name>.json`; running them as subprocesses keeps one
benchmark's imports, caches and garbage from skewing the next. The load
benchmarks come after the others (they start servers and take the longest),
and `targets` last of all: the run ends by printing its table, issue 24's
targets measured in one run, each met or short.

    .venv/bin/python -m benchmarks                 # all of them
    .venv/bin/python -m benchmarks --quick         # shorter runs where supported
    .venv/bin/python -m benchmarks --only load     # one (repeatable)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ORDER = (
    "packer",
    "pipeline",
    "codec",
    "token_estimate",
    "memory_client",
    "memory_cut",
    "wakeups",
    "timer_lateness",
    "cache_prefix",
    "load",
    "load.deadlines",
    "load.floor",
    "load.capacity",
    "load.curves",
    "targets",
)
# Arguments that shorten a benchmark under --quick (only for modules that accept them).
QUICK_ARGS = {
    "codec": ["--iterations", "500"],
    "cache_prefix": ["--conversations", "3"],
    "timer_lateness": ["--blocks", "2"],
    "load": ["--quick"],
    "load.deadlines": ["--quick"],
    "load.floor": ["--quick"],
    "load.capacity": ["--quick"],
    "load.curves": ["--quick"],
    "targets": ["--quick"],
}


def available(name: str) -> bool:
    return importlib.util.find_spec(f"benchmarks.{name}") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the benchmarks and write JSON results.")
    parser.add_argument(
        "--only",
        action="append",
        choices=ORDER,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(ORDER)}",
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs where supported")
    args = parser.parse_args(argv)
    names = [n for n in ORDER if not args.only or n in args.only]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    summary: dict[str, dict[str, object]] = {}
    failed = []
    for name in names:
        if not available(name):
            print(f"## {name}: not present, skipped", flush=True)
            summary[name] = {"status": "missing"}
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{name}"]
        if args.quick:
            cmd += QUICK_ARGS.get(name, [])
        print(f"## {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        seconds = round(time.perf_counter() - t0, 1)
        summary[name] = {
            "status": "ok" if code == 0 else f"exit {code}",
            "seconds": seconds,
            "result": f"benchmarks/results/{name}.json",
        }
        if code != 0:
            failed.append(name)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"## done: {json.dumps(summary)}")
    targets = RESULTS / "targets.json"
    if "targets" in names and summary["targets"].get("status") == "ok" and targets.exists():
        print(json.loads(targets.read_text())["table"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
