"""CPU work in worker threads that must not take the core from the event loop thread."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Final, TypeVar

T = TypeVar("T")

WORKER_NICE: Final = 10  # worker threads yield a contended core to the loop thread


def niced(fn: Callable[[], T]) -> T:
    """Run `fn` in the calling worker thread at a lower CPU priority than the loop thread.

    On Linux a thread's nice value is its own (setpriority on the thread id), so
    the loop thread wins a core both want and answers keep their deadlines while
    a large pipeline or decode runs. Raising niceness needs no privilege and is
    never undone (the thread stays a worker). Elsewhere this just calls `fn`.
    """
    if sys.platform == "linux":
        try:
            tid = threading.get_native_id()
            if os.getpriority(os.PRIO_PROCESS, tid) < WORKER_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, WORKER_NICE)
        except OSError:
            pass
    return fn()
