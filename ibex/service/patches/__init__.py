"""Every patch ibex makes to another library's internals, one module per library, and
`install_patches`, which the daemon calls at start-up.

A private API can change in any release: each install function first calls
`ibex.versions.require` for the packages it patches, so a version outside the
range the patch was written for stops start-up with a message instead of
misbehaving at run time. Nothing here is applied at import.

- `grpclib_h2`: `answer_expired_deadlines` (grpclib), `lighten_h2` (grpclib,
  h2, hpack, hyperframe) and `count_open_streams_inline` (h2);
- `trio_asyncio_loop`: `batch_ready_callbacks`, trio-asyncio's main loop batching
  ready callbacks;
- `redis_wait_for`: `honour_cancellation_in_redis_writes`, redis-py's asyncio
  connections writing under a `wait_for` that never drops a cancellation;
- `trio_epoll`: `precise_wakeups`, Trio's epoll wait ending on time; a context
  manager, entered for the Trio run that serves.
"""

from __future__ import annotations

from ibex.service.patches.grpclib_h2 import (
    answer_expired_deadlines,
    count_open_streams_inline,
    lighten_h2,
)
from ibex.service.patches.redis_wait_for import honour_cancellation_in_redis_writes
from ibex.service.patches.trio_asyncio_loop import batch_ready_callbacks
from ibex.service.patches.trio_epoll import precise_wakeups

__all__ = [
    "answer_expired_deadlines",
    "batch_ready_callbacks",
    "count_open_streams_inline",
    "honour_cancellation_in_redis_writes",
    "install_patches",
    "lighten_h2",
    "precise_wakeups",
]


def install_patches() -> None:
    """Install every process-wide patch (idempotent); `precise_wakeups` is entered apart,
    inside the Trio run. Raises `ibex.versions.UnsupportedVersion` for a package outside
    the range its patch supports."""
    answer_expired_deadlines()
    lighten_h2()
    count_open_streams_inline()
    batch_ready_callbacks()
    honour_cancellation_in_redis_writes()
