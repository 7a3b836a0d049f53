"""ibex.sources.cpu.niced: worker threads give a contended core to the loop thread."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ibex.sources.cpu import WORKER_NICE, niced


def _in_a_thread(fn: object) -> tuple[int, int, object]:
    """(nice before, nice after, result) of `niced(fn)` in a fresh thread."""
    out: list[tuple[int, int, object]] = []

    def run() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        result = niced(fn)  # type: ignore[arg-type]
        out.append((before, os.getpriority(os.PRIO_PROCESS, tid), result))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_thread_runs_fn_at_worker_nice_or_lower_priority_and_only_that_thread() -> None:
    """Raised to WORKER_NICE when below it (a thread already nicer keeps its value: under
    `nice -n 19` both read 19), and the calling process's own priority is untouched."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before, after, result = _in_a_thread(lambda: "done")
    assert result == "done"
    assert after == max(before, WORKER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
