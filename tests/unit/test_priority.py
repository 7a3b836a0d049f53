"""A starting worker's lower priority: lowered on a fresh process, restored on every thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ibex.ops import priority


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


needs_restore = pytest.mark.skipif(
    not priority.can_restore(),
    reason="this process may not lower a nice value again (RLIMIT_NICE, CAP_SYS_NICE)",
)


def test_the_probe_leaves_this_process_as_it_was() -> None:
    before = priority.current()
    priority.can_restore()
    assert priority.current() == before
    assert {nice_of(int(t)) for t in os.listdir("/proc/self/task")} == {before}


def test_a_spawned_process_is_lowered_by_the_starting_step() -> None:
    base = priority.current()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert priority.lower(child.pid, base)
        assert nice_of(child.pid) == min(19, base + priority.STARTING_NICE)
    finally:
        child.kill()
        child.wait()


@needs_restore
def test_restore_brings_every_thread_back() -> None:
    """Threads started while lowered inherit the start-up priority; all of them return."""
    base = priority.current()
    lowered = threading.Event()
    done = threading.Event()

    def lowered_thread() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base + 5)
        lowered.set()
        done.wait(30)

    thread = threading.Thread(target=lowered_thread)
    thread.start()
    try:
        assert lowered.wait(30)
        assert thread.native_id is not None and nice_of(thread.native_id) == base + 5
        priority.restore(base)
        assert {nice_of(int(t)) for t in os.listdir("/proc/self/task")} == {base}
    finally:
        done.set()
        thread.join(30)
