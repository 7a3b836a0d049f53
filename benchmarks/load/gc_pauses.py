"""What the cyclic garbage collector costs the daemon: its passes, per generation.

Each run starts a daemon with `gc_probe/sitecustomize.py` on its PYTHONPATH,
which times every collector pass (`gc.callbacks`), then drives it at 200 rps
and with 32 closed-loop callers (the memory stand-in at its usual latencies).
With `--root`, the same is done for another checkout's daemon (e.g. a worktree
of an older commit), the two alternating, for before/after figures. Per run:
the number of passes and the p50/max CPU of a pass per generation, how many
objects the passes freed (cyclic garbage: what reference counting could not
free), and the daemon's CPU per answer in the closed loop.

Run: ``python -m benchmarks.load.gc_pauses [--rounds 2] [--root DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import aio
from benchmarks.load.deadlines import warmed_run
from benchmarks.load.driver import fixed_rate
from benchmarks.load.stack import ROOT, Stack

PROBE = Path(__file__).resolve().parent / "gc_probe"


def summary(passes: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per generation: passes, p50 and max CPU ms of a pass, objects freed in all."""
    out: dict[int, dict[str, float]] = {}
    for generation in (0, 1, 2):
        mine = [p for p in passes if p["generation"] == generation]
        if not mine:
            continue
        cpu = [p["cpu_ms"] for p in mine]
        out[generation] = {
            "passes": len(mine),
            "cpu_p50_ms": statistics.median(cpu),
            "cpu_max_ms": max(cpu),
            "collected": sum(p["collected"] for p in mine),
        }
    return out


async def measure(stack: Stack, root: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="ibex-gc-")) / "passes.json"
    env = {"PYTHONPATH": f"{PROBE}:{root}", "IBEX_GC_PROBE_OUT": str(out)}
    with stack.daemon(1, root, **env) as daemon:
        async with warmed_run(stack, daemon, 1.5) as run:
            await run.open("200 rps", fixed_rate((200, 4.0)))
            closed = await run.closed("32 callers", 32, 4.0, 1.0)
    passes = json.loads(out.read_text()) if out.exists() else []
    return {"cpu_ms_per_answer": closed["daemon_cpu_ms_per_answer"], "gc": summary(passes)}


async def measure_all(roots: Sequence[Path], rounds: int) -> list[tuple[Path, dict[str, Any]]]:
    results = []
    with Stack() as stack:
        for i in range(rounds):
            for root in roots if i % 2 == 0 else list(reversed(roots)):
                results.append((root, await measure(stack, root)))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--root", type=Path, default=None, help="another checkout, alternated")
    args = p.parse_args(argv)
    roots = [ROOT] if args.root is None else [ROOT, args.root.resolve()]
    for root, res in aio.run(measure_all(roots, args.rounds)):
        gens = "  ".join(
            f"gen{g}: {s['passes']:.0f} passes, p50 {s['cpu_p50_ms']:.2f} ms, "
            f"max {s['cpu_max_ms']:.2f} ms, freed {s['collected']:.0f}"
            for g, s in res["gc"].items()
        )
        print(f"{root}: {res['cpu_ms_per_answer']} ms CPU/answer (32 callers)  {gens}")


if __name__ == "__main__":
    main()
