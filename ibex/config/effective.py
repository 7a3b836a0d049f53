"""The values the daemon runs with: each layer's struct as built, and those derived at start.

A few settings default to a value computed from others (the per-org and
per-caller caps from the global ones, the connection caps from RLIMIT_NOFILE,
the age grace from the drain grace). They are computed here, from the built
structs, for the composition root (`ibex.service.root`), the supervisor and
`ibex config` alike; nothing here loads the daemon.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ibex.config.settings import Settings
from ibex.config.table import DURATIONS, LAYERS, TABLE
from ibex.config.values import format_duration
from ibex.service.admission_config import AdmissionConfig
from ibex.service.edge.connections_config import ConnectionsConfig, default_max_connections

__all__ = [
    "admission_config",
    "connections_config",
    "drain_grace",
    "effective_settings",
    "layer_config",
]

T = TypeVar("T", bound=msgspec.Struct)


def layer_config(struct: type[T], settings: Settings) -> T:
    """The `struct` that `settings` holds (each field set from its variable, or its default)."""
    for name, held in LAYERS.items():
        if held is struct:
            value: T = getattr(settings, name)
            return value
    raise KeyError(f"Settings holds no {struct.__name__}")


def effective_settings(settings: Settings) -> dict[str, Any]:
    """Every variable -> the value the daemon runs with (what `ibex config` prints).

    An unset targeted setting shows its layer default, a computed one (the
    connection caps from RLIMIT_NOFILE, the per-org cap, the age grace) the
    value computed now; durations carry a unit (`45ms`, `5s`), secrets are
    redacted. None is a setting that is off (no URL, no age limit).
    """
    own = settings.redacted()
    connections = connections_config(settings)
    admission = admission_config(settings)
    own.update(
        max_org_assemblies=admission.max_org_concurrent,
        max_caller_in_flight_bytes=admission.max_caller_bytes,
        max_connections=connections.max_connections,
        max_connections_per_peer=connections.max_per_peer,
        max_connection_age_grace=connections.age_grace,
    )
    out: dict[str, Any] = {}
    for name, row in TABLE.items():
        value = row.value(settings) if row.layer else own[row.field]
        if name in DURATIONS and value is not None:
            value = format_duration(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def admission_config(settings: Settings) -> AdmissionConfig:
    """Admission; the per-org, per-caller and worker-thread queue defaults derive from the
    global caps."""
    built = settings.admission
    return msgspec.structs.replace(
        built,
        max_org_concurrent=settings.max_org_assemblies or max(1, built.max_concurrent // 2),
        max_caller_bytes=settings.max_caller_in_flight_bytes or built.max_in_flight_bytes // 4,
        max_thread_queue=max(1, built.max_in_flight // 4),
    )


def connections_config(settings: Settings) -> ConnectionsConfig:
    """Connection limits; the cap's default is computed from RLIMIT_NOFILE at start-up, the
    per-peer cap's from the cap, the age grace's from the daemon's drain grace."""
    cap = settings.max_connections or default_max_connections()
    grace = settings.max_connection_age_grace
    return msgspec.structs.replace(
        settings.connections,
        max_connections=cap,
        max_per_peer=settings.max_connections_per_peer or max(1, cap // 4),
        age_grace=grace if grace is not None else drain_grace(settings),
    )


def drain_grace(settings: Settings) -> float:
    """How long in-flight calls may finish on SIGTERM (the supervisor waits for it too)."""
    return settings.daemon.drain_grace
