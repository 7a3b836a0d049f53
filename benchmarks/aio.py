"""`run`: `asyncio.run` on asyncio's own loop, whatever event loop policy is installed.

Importing trio_asyncio (`ibex.cli` does, and `ibex.testing` through it) installs
its policy, under which `asyncio.run` makes a `SyncTrioEventLoop`: a Trio run in
a thread of its own that every loop step crosses into. A load generator or a
floor server that is meant to be plain asyncio runs on the selector loop instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a new `asyncio.SelectorEventLoop`, then close it."""
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main)
