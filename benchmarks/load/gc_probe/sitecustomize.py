"""Loaded into `python -m ibex serve` by `benchmarks.load.gc_pauses` (via PYTHONPATH) only.

Times every pass of the cyclic collector with `gc.callbacks` (wall and the
thread's CPU, the generation, how many objects it freed) and writes them as
JSON to IBEX_GC_PROBE_OUT when the daemon exits.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from typing import Any


def _install(out: str) -> None:
    passes: list[dict[str, Any]] = []
    start = [0.0, 0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            start[0], start[1] = time.perf_counter(), time.thread_time()
            return
        passes.append(
            {
                "generation": info["generation"],
                "wall_ms": (time.perf_counter() - start[0]) * 1000,
                "cpu_ms": (time.thread_time() - start[1]) * 1000,
                "collected": info["collected"],
            }
        )

    gc.callbacks.append(callback)

    def report() -> None:
        with open(out, "w") as f:
            json.dump(passes, f)

    atexit.register(report)


if "serve" in sys.argv and os.environ.get("IBEX_GC_PROBE_OUT"):
    _install(os.environ["IBEX_GC_PROBE_OUT"])
