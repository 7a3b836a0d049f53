"""Structured logs: one JSON object per line on stderr, where journald or the kubelet collects it.

Use plain stdlib loggers under the ``ibex`` namespace; the message is a stable
event name and everything else goes in ``extra``::

    log = logging.getLogger("ibex.service.handlers")
    with bind_request(request_id, trace_id):
        log.info("assembled", extra={"tokens_used": 812, "degradation": "L0"})

emits ``{"ts": "2025-01-02T03:04:05.678Z", "level": "info", "event": "assembled",
"logger": "ibex.service.handlers", "request_id": "...", "trace_id": "...",
"tokens_used": 812, ...}``.

Rules this module enforces so call sites cannot get them wrong:

- Secrets and memory text never reach a line: fields named in `DENYLIST` (or
  ending in one of `_DENY_SUFFIXES`), at any nesting depth, are replaced by
  ``"<redacted>"``. Structs are walked as dicts, so logging a whole `Settings`
  does not leak its token.
- A URL anywhere in a line (a field, the event, an error message or
  traceback, including third-party libraries' lines) loses its userinfo and
  the values of query parameters named like secrets (`redact_urls`), so an
  endpoint configured as ``http://user:secret@host`` is logged as
  ``http://<redacted>@host``, whoever logs it.
- Exceptions appear as ``error_type`` plus a short ``error`` message; the
  traceback is added only when the process logs at debug level.
- Request fields are bound with `bind_request` in a `ContextVar`; Trio copies
  the context into every task started inside the block, so branch tasks log
  with the request's ids without passing them around.
- A disabled level costs one `isEnabledFor` check (stdlib does it before
  building a record); third-party loggers are held at WARNING or above so a
  debug run does not dump HTTP client internals.

Writes to stderr are synchronous; a line is small and journald/pipe buffers
absorb it, which is the usual trade for a logger that must work anywhere.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Final, TextIO

import msgspec

REDACTED: Final = "<redacted>"

#: Field names whose values never appear in a log line (compared case-insensitively).
DENYLIST: Final = frozenset(
    {
        "token",
        "authorization",
        "memory_api_token",
        "auth_tokens_sha256",
        "api_key",
        "password",
        "secret",
        "cookie",
        "content",
        "query",
        "assembled_context",
        "recent_messages",
        "messages",
        "tool_schemas",
        "directive",
        "text",
        "body",
        "principal_context",
    }
)
_DENY_SUFFIXES: Final = ("_token", "_secret", "_password", "_api_key", "_content", "_text")

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

#: Exception messages are cut to this many characters; they may quote input.
ERROR_MESSAGE_MAX: Final = 200
_MAX_DEPTH: Final = 4
_RESERVED: Final = ("ts", "level", "event", "logger")
# Attributes every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)

_bound: ContextVar[Mapping[str, Any] | None] = ContextVar("ibex_log_fields", default=None)
_encoder = msgspec.json.Encoder(enc_hook=lambda obj: f"<{type(obj).__name__}>")


# A URL: its scheme, then everything up to whitespace. Greedy, so the userinfo ends at the
# run's last `@` (an unencoded password may hold `/`, `?`, `#` or `@`; over-redacting a
# host or path is harmless, echoing a password is not).
_URL: Final = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://\S*")
_QUERY_SECRET: Final = re.compile(
    r"([?&;][^=&;#\s]*(?:pass|secret|token|key|auth|sig)[^=&;#\s]*=)[^&;#\s]*", re.IGNORECASE
)


def redact_url(value: str) -> str:
    """`value` with its userinfo and secret-named query values replaced by `<redacted>`.

    The userinfo is everything between `://` (or the start) and the LAST `@`: an
    unencoded password may hold `/`, `?`, `#` or `@`, which a URL parser reads as
    the start of the path, query or fragment and would leave on show. Over-redacting
    a host is harmless; echoing a password is not. A parameter is secret-named when
    its name holds pass, secret, token, key, auth or sig (`&` or `;` separate them).
    The rest stays as written, so `host:port` comes back unchanged.
    """
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if "@" in rest:
        rest = REDACTED + "@" + rest.rpartition("@")[2]
    if "=" in rest:
        rest = _QUERY_SECRET.sub(r"\1" + REDACTED, rest)
    return f"{scheme}{sep}{rest}"


def redact_urls(text: str) -> str:
    """`text` with every URL redacted by `redact_url`."""
    if "://" not in text:
        return text
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def is_denied(name: str) -> bool:
    """True when a field of this name must be redacted."""
    key = name.lower()
    return key in DENYLIST or key.endswith(_DENY_SUFFIXES)


@contextmanager
def bind_request(request_id: str = "", trace_id: str = "", **fields: Any) -> Iterator[None]:
    """Merge request-scoped fields into every line logged in this context (and tasks it starts).

    Empty ids are left out rather than logged as "". Nesting adds to the outer
    binding; leaving the block restores it.
    """
    merged = dict(_bound.get() or {})
    if request_id:
        merged["request_id"] = request_id
    if trace_id:
        merged["trace_id"] = trace_id
    merged.update(fields)
    token = _bound.set(merged)
    try:
        yield
    finally:
        _bound.reset(token)


def bound_fields() -> Mapping[str, Any]:
    """The fields bound in the current context (read-only view)."""
    return _bound.get() or {}


def _clean(value: Any, depth: int = 0) -> Any:
    """Redact denied keys inside containers; opaque objects become their type name."""
    if isinstance(value, str):
        return redact_urls(value)
    if value is None or isinstance(value, int | float | bool):
        return value
    if depth >= _MAX_DEPTH:
        return f"<{type(value).__name__}>"
    if isinstance(value, msgspec.Struct):
        value = msgspec.structs.asdict(value)
    if isinstance(value, Mapping):
        return {
            str(k): REDACTED if is_denied(str(k)) else _clean(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(v, depth + 1) for v in value]
    # Unknown objects may have a repr full of secrets (clients, settings-like
    # classes); their type name is all a log needs.
    return f"<{type(value).__name__}>"


class JsonFormatter(logging.Formatter):
    """Render a record as one JSON object; see the module docstring for the shape."""

    def __init__(self, *, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")[
                :-6
            ]
            + "Z",
            "level": record.levelname.lower(),
            "event": redact_urls(record.getMessage()),
            "logger": record.name,
        }
        fields: dict[str, Any] = dict(_bound.get() or {})
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                fields[key] = value
        for key, value in fields.items():
            # A field named like a reserved key is kept under a suffixed name.
            name = f"{key}_" if key in _RESERVED else key
            out[name] = REDACTED if is_denied(key) else _clean(value)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            out["error_type"] = type(exc).__name__
            out["error"] = redact_urls(str(exc))[:ERROR_MESSAGE_MAX]
            if self.tracebacks:
                out["traceback"] = redact_urls("".join(traceback.format_exception(exc)))
        return _encoder.encode(out).decode()


class _IbexHandler(logging.StreamHandler[TextIO]):
    """Marker type so `configure_logging` can replace its own handler and nobody else's."""


def configure_logging(level: str = "info", *, stream: TextIO | None = None) -> None:
    """Send all logging to `stream` (default stderr) as JSON lines at `level`.

    `ibex.*` loggers log at `level`; other libraries at `level` or WARNING,
    whichever is higher. Calling it again replaces the previous configuration
    (tests call it with a StringIO).
    """
    try:
        lvl = LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}") from None
    handler = _IbexHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter(tracebacks=lvl <= logging.DEBUG))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _IbexHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))
    logging.getLogger("ibex").setLevel(lvl)
    logging.captureWarnings(True)
