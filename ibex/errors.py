"""Errors that map to gRPC status codes; messages name the offending field."""

from __future__ import annotations


class InputError(ValueError):
    """The request is malformed (INVALID_ARGUMENT). str() is safe to return to the caller."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TooLargeError(InputError):
    """The request exceeds a configured size limit (RESOURCE_EXHAUSTED)."""
