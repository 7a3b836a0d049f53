"""OpenTelemetry traces: one span per RPC, with a child for each retrieval branch and stage.

Optional: the `otel` extra (`pip install 'ibex-context[otel]'`) brings the SDK.
Without it, or without an exporter configured, `setup_tracing` returns None and
the request path does no tracing work at all (one `is None` test per call).

The standard `OTEL_*` variables configure it, read by the SDK itself at start-up:
tracing is on when `OTEL_TRACES_EXPORTER` names `otlp` or an
`OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` is set, unless `OTEL_SDK_DISABLED=true`.
Spans leave over OTLP/HTTP with protobuf through the SDK's batch processor,
whose queue is bounded (`OTEL_BSP_MAX_QUEUE_SIZE`; a full queue drops spans,
never blocks a call). The sampler is the SDK's, from `OTEL_TRACES_SAMPLER`
(default `parentbased_always_on`, so a caller's sampling decision is kept).

Child spans are built after the answer, from the clock readings the request
path takes anyway (branch start and latency, stage laps), with explicit
start and end times: tracing adds no work between a call's arrival and its
answer beyond starting the RPC span.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from ibex.ops.logs import redact_urls

if TYPE_CHECKING:
    from ibex.ops.otel_sdk import Tracing

log = logging.getLogger(__name__)

SERVICE_NAME: Final = "ibex-context"


def _env(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def tracing_wanted(env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether the `OTEL_*` variables ask for traces, and why (for the start-up log line)."""
    if _env(env, "OTEL_SDK_DISABLED").lower() == "true":
        return False, "OTEL_SDK_DISABLED=true"
    exporters = {e.strip().lower() for e in _env(env, "OTEL_TRACES_EXPORTER").split(",")} - {""}
    endpoint = _env(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env(
        env, "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if "none" in exporters:
        return False, "OTEL_TRACES_EXPORTER=none"
    if exporters and "otlp" not in exporters:
        return False, f"OTEL_TRACES_EXPORTER={','.join(sorted(exporters))}: only otlp is supported"
    if not exporters and not endpoint:
        return False, "no exporter configured"
    protocol = _env(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env(
        env, "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if protocol and protocol != "http/protobuf":
        return False, f"OTLP protocol {protocol}: only http/protobuf is supported"
    return True, endpoint or "default endpoint"


def setup_tracing(env: Mapping[str, str] | None = None) -> Tracing | None:
    """The process's tracer when the environment asks for one and the extra is installed.

    Logs one line saying whether traces are on and why; a request for traces
    that cannot be honoured (extra missing, another exporter or protocol) is a
    warning, not a start-up failure: traces are optional, answers are not.
    """
    env = os.environ if env is None else env
    wanted, why = tracing_wanted(env)
    if not wanted:
        level = logging.WARNING if "supported" in why else logging.DEBUG
        log.log(level, "tracing_off", extra={"detail": why})
        return None
    try:
        # Imported only now: the SDK and its HTTP client cost start-up time.
        from ibex.ops.otel_sdk import Tracing
    except ImportError as exc:
        log.warning(
            "tracing_unavailable",
            extra={"detail": "install ibex-context[otel] for OTEL_* tracing", "error": str(exc)},
        )
        return None
    tracing = Tracing()
    log.info(
        "tracing_on",
        # The endpoint may carry credentials (`http://user:secret@host`): never logged.
        extra={
            "endpoint": redact_urls(why),
            "sampler": _env(env, "OTEL_TRACES_SAMPLER") or "default",
        },
    )
    return tracing
