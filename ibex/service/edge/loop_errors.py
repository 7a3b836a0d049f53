"""The asyncio loop's exception handler: errors are logged, and never end the process.

The errors it sees most are `accept()` failing for lack of file descriptors or
memory, in floods, while the connection caps (`connections`) keep the fds the
daemon needs.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

__all__ = ["ACCEPT_ERROR_LOG_INTERVAL", "LoopErrorHandler"]

log = logging.getLogger(__name__)

ACCEPT_ERROR_LOG_INTERVAL = 10.0  # seconds between two `accept_failed` lines during a flood
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class LoopErrorHandler:
    """The asyncio loop's exception handler: log, never end the process.

    trio-asyncio's default handler re-raises into the loop's nursery, so one
    `accept()` failing with EMFILE took the daemon down. asyncio's accept loop
    already stops reading the listener for a second after such an error and
    then resumes; this handler only logs (at most once per `interval` for accept
    errors, which come in floods).
    """

    def __init__(self, interval: float = ACCEPT_ERROR_LOG_INTERVAL) -> None:
        self.accept_errors = 0
        self._interval = interval
        self._logged_at = -interval
        self._logged = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            self.accept_errors += 1
            now = time.monotonic()
            if now - self._logged_at >= self._interval:
                log.warning(
                    "accept_failed",
                    extra={
                        "error": errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                        "count": self.accept_errors - self._logged,
                        "detail": str(context.get("message", "")),
                    },
                )
                self._logged_at = now
                self._logged = self.accept_errors
            return
        log.error(
            "loop_error",
            extra={
                "detail": str(context.get("message", "")),
                "error": repr(exc) if exc is not None else None,
            },
        )
