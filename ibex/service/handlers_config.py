"""`EdgeConfig`: what the RPC handlers need beyond the assembler, each setting declared
on its field.

Apart from `ibex.service.handlers` so the settings table (`ibex.config`) reads the
declarations without loading grpclib and the serving stack.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.envvar import env

__all__ = ["EdgeConfig"]


class EdgeConfig(msgspec.Struct, frozen=True):
    """What the handlers need beyond the assembler; a setting's variable is on its field."""

    max_message_bytes: Annotated[
        int, env("IBEX_CONTEXT_MAX_MESSAGE_BYTES", bounds=(1024, 256 * 1024 * 1024))
    ] = 4 * 1024 * 1024
    # RecordMemoryFeedback's time for both attempts when the caller sets no deadline.
    feedback_timeout: float = 2.0
