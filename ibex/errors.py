"""One exception tree for the whole daemon; each class carries its gRPC status.

The gRPC edge maps an `IbexError` to a status once (`ibex.service.edge.status`),
the way h2's exceptions carry their protocol error code: a new error class
never needs a new `except` clause at the edge. `status` is the name of a
`grpc.StatusCode` / `grpclib.const.Status` member, kept as a string so the
pure core imports no gRPC library. `str()` of every error is safe to return
to a caller and to log: no secret, no memory text.
"""

from __future__ import annotations

from typing import ClassVar


class IbexError(Exception):
    """Root of every error the daemon raises on purpose."""

    status: ClassVar[str] = "INTERNAL"


class InputError(IbexError, ValueError):
    """The request is malformed (INVALID_ARGUMENT); the message names the field."""

    status: ClassVar[str] = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverLimitError(InputError):
    """A field breaks a count or size cap (INVALID_ARGUMENT); the message names field and limit.

    The contract's "oversize inputs": the caller must change the request, so it
    is not RESOURCE_EXHAUSTED, which a proxy reads as load and may retry.
    """


class TooLargeError(InputError):
    """The request cannot fit even after the oldest history is left out, or the whole
    gRPC message is over the byte cap, as gRPC itself answers it (RESOURCE_EXHAUSTED)."""

    status: ClassVar[str] = "RESOURCE_EXHAUSTED"


class AuthError(IbexError):
    """Caller authentication failed (UNAUTHENTICATED)."""

    status: ClassVar[str] = "UNAUTHENTICATED"


class PermissionDenied(IbexError):
    """The authenticated caller may not act for this org/agent (PERMISSION_DENIED)."""

    status: ClassVar[str] = "PERMISSION_DENIED"


class Overloaded(IbexError):
    """Admission refused the call: a standing queue or a full process (RESOURCE_EXHAUSTED).

    `reason` is the label on the shed counter.
    """

    status: ClassVar[str] = "RESOURCE_EXHAUSTED"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class DeadlineError(IbexError):
    """The call cannot be answered within its deadline (DEADLINE_EXCEEDED)."""

    status: ClassVar[str] = "DEADLINE_EXCEEDED"


class Unavailable(IbexError):
    """The daemon is draining, or a dependency a call needs is down (UNAVAILABLE)."""

    status: ClassVar[str] = "UNAVAILABLE"


class SourceError(Unavailable):
    """A dependency failed or answered outside its contract; str() is safe to log."""


class Unimplemented(IbexError):
    status: ClassVar[str] = "UNIMPLEMENTED"


class ConfigError(IbexError, ValueError):
    """A setting or start-up file is missing or malformed; the message names the variable.

    `exit_status` is what `ibex serve` exits with when it stops start-up (one
    value per class, listed in docs/operations.md), so a supervisor or a unit's
    `RestartPreventExitStatus=` can tell a mistake a restart cannot fix from one
    it may (an address still held by a process on its way out).
    """

    exit_status: ClassVar[int] = 2
    label: ClassVar[str] = "configuration error"


class ConfigFileError(ConfigError):
    """A file a setting names (or a bundled one) is missing or cannot be loaded:
    certificate, key or CA, catalog, tokenizer rank files, local data."""

    exit_status: ClassVar[int] = 4
    label: ClassVar[str] = "cannot load a file"


class ListenError(ConfigError):
    """An address the daemon is configured to listen on cannot be bound (in use, not an
    address of this host, not permitted); the message names the address."""

    exit_status: ClassVar[int] = 5
    label: ClassVar[str] = "cannot listen"

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


#: The exit statuses of a start-up stopped by one of the errors above.
START_FAILURE_STATUSES = frozenset(
    {ConfigError.exit_status, ConfigFileError.exit_status, ListenError.exit_status}
)
