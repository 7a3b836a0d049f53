"""Loaded into a served process by `benchmarks.load.profile --calls` (via PYTHONPATH) only.

cProfile, switched on by SIGUSR1 and off by SIGUSR2, which also writes the stats
to IBEX_CALLS_PROBE_OUT. Function call counts per answer do not depend on how
loaded the machine is, unlike sampled CPU: they show where a process does more
work than another for the same answers.
"""

from __future__ import annotations

import cProfile
import os
import signal
from types import FrameType


def _install(out: str) -> None:
    profile = cProfile.Profile()

    def on(signum: int, frame: FrameType | None) -> None:
        profile.enable()

    def off(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)


_OUT = os.environ.get("IBEX_CALLS_PROBE_OUT")
if _OUT:
    _install(_OUT)
