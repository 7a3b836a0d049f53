"""Every patch ibex makes to another library's internals, one module per library, and
`install_patches`, which the daemon calls at start-up. Below every layer: the sources
and the service use it, and it imports neither.

A private API can change in any release: each install function first calls
`ibex.versions.require` for the packages it patches, so a version outside the
range the patch was written for stops start-up with a message instead of
misbehaving at run time. Nothing here is applied at import.

- `grpclib_h2`: `answer_expired_deadlines` (grpclib), `lighten_h2` (grpclib,
  h2, hpack, hyperframe) and `count_open_streams_inline` (h2);
- `trio_asyncio_loop`: `batch_ready_callbacks`, trio-asyncio's main loop batching
  ready callbacks;
- `redis_connection`: `honour_cancellation_in_redis_writes`, redis-py's asyncio
  connections writing under a `wait_for` that never drops a cancellation, and
  `tap_replies`, a leased connection's incoming bytes seen as they arrive (applied
  per lease by `ibex.sources.redis_early_reply`, not installed);
- `trio_epoll`: `precise_wakeups`, Trio's epoll wait ending on time; a context
  manager, entered for the Trio run that serves.
"""

from __future__ import annotations

from ibex._lazy import lazy_exports

__all__ = [
    "answer_expired_deadlines",
    "batch_ready_callbacks",
    "count_open_streams_inline",
    "honour_cancellation_in_redis_writes",
    "install_patches",
    "lighten_h2",
    "precise_wakeups",
    "tap_replies",
]

# Imported on first use: a source that taps redis-py's reader loads no HTTP/2 stack.
__getattr__ = lazy_exports(
    __name__,
    {
        "answer_expired_deadlines": "grpclib_h2",
        "lighten_h2": "grpclib_h2",
        "count_open_streams_inline": "grpclib_h2",
        "batch_ready_callbacks": "trio_asyncio_loop",
        "honour_cancellation_in_redis_writes": "redis_connection",
        "tap_replies": "redis_connection",
        "precise_wakeups": "trio_epoll",
    },
)


def install_patches() -> None:
    """Install every process-wide patch (idempotent); `precise_wakeups` is entered apart,
    inside the Trio run. Raises `ibex.versions.UnsupportedVersion` for a package outside
    the range its patch supports."""
    from ibex.patches import grpclib_h2, redis_connection, trio_asyncio_loop

    grpclib_h2.answer_expired_deadlines()
    grpclib_h2.lighten_h2()
    grpclib_h2.count_open_streams_inline()
    trio_asyncio_loop.batch_ready_callbacks()
    redis_connection.honour_cancellation_in_redis_writes()
