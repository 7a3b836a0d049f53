"""The settings table: every row's layer target is a real defaulted field, an unset
targeted setting takes the layer's own default (written once, in the layer struct) and a set
one overrides it, `ibex config` prints the effective value, secret rows are redacted, and
errors name the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from ibex.config import (
    DURATIONS,
    PREFIX,
    TABLE,
    UNSET,
    ConfigError,
    Settings,
    format_duration,
    load_settings,
)
from ibex.service.admission import AdmissionConfig
from ibex.service.edge.connections import ConnectionsConfig
from ibex.service.root import (
    LAYERS,
    admission_config,
    connections_config,
    effective_settings,
    layer_config,
    layer_defaults,
)

TARGETS = [(setting, target) for setting, row in TABLE.items() for target in row.to]


def layer_default(target: str) -> Any:
    """The field's value in the layer struct built with no arguments (its own default)."""
    struct, _, field = target.partition(".")
    return getattr(LAYERS[struct](), field)


def built(struct: str, settings: Settings) -> msgspec.Struct:
    """The layer struct as the composition root builds it for the daemon."""
    if struct == AdmissionConfig.__name__:
        return admission_config(settings)
    if struct == ConnectionsConfig.__name__:
        return connections_config(settings)
    return layer_config(LAYERS[struct], settings)


def test_the_table_covers_every_setting_once() -> None:
    assert list(TABLE) == list(Settings.__struct_fields__)
    suffixes = [row.suffix for row in TABLE.values()]
    assert len(set(suffixes)) == len(suffixes)
    assert len(TARGETS) >= 30  # the retrieval, admission, request and cache knobs at least


def test_targeted_settings_and_only_they_default_to_unset() -> None:
    """The default of a targeted setting is not written in the table: it is UNSET there."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(Settings)}
    for setting, row in TABLE.items():
        assert (defaults[setting] is UNSET) == bool(row.to), setting


@pytest.mark.parametrize("setting,target", TARGETS)
def test_each_target_is_a_defaulted_field_of_a_layer_struct(setting: str, target: str) -> None:
    struct, _, field = target.partition(".")
    assert struct in LAYERS, f"{setting} targets an unknown struct {struct}"
    fields = {f.name: f for f in msgspec.structs.fields(LAYERS[struct])}
    assert field in fields, f"{setting} targets a missing {target}"
    assert fields[field].default is not msgspec.NODEFAULT, f"{target} has no default"
    assert layer_defaults()[setting] == layer_default(target)


@pytest.mark.parametrize("setting,target", TARGETS)
def test_an_unset_setting_takes_the_layer_default_and_a_set_one_overrides_it(
    setting: str, target: str
) -> None:
    struct, _, field = target.partition(".")
    assert getattr(built(struct, load_settings({})), field) == layer_default(target)
    default = layer_default(target)
    if default is None:
        value: Any = 2.5
    elif isinstance(default, str):
        value = f"not-{default}"  # any other text: the struct takes what the root passes
    else:
        value = type(default)(default * 2 + 1)
    settings = Settings(**{setting: value})
    assert getattr(built(struct, settings), field) == value


def test_derived_values_follow_the_built_struct() -> None:
    """The root derives the per-org cap, the thread queue and the age grace from the
    layer values (set or default), not from another copy of a default."""
    assert admission_config(Settings()).max_org_concurrent == max(
        1, AdmissionConfig().max_concurrent // 2
    )
    assert admission_config(Settings()).max_thread_queue == max(
        1, AdmissionConfig().max_in_flight // 4
    )
    env = {PREFIX + "MAX_CONCURRENT_ASSEMBLIES": "6", PREFIX + "MAX_IN_FLIGHT": "40"}
    admission = admission_config(load_settings(env))
    assert (admission.max_org_concurrent, admission.max_thread_queue) == (3, 10)
    assert connections_config(Settings()).age_grace == layer_default("DaemonConfig.drain_grace")
    assert connections_config(Settings(drain_grace=3.5)).age_grace == 3.5
    assert connections_config(Settings(max_connection_age_grace=1.5)).age_grace == 1.5


def shown_as(setting: str, value: Any) -> Any:
    """A value as `ibex config` shows it: a duration with its unit, a list for a tuple."""
    if setting in DURATIONS and value is not None:
        return format_duration(value)
    return list(value) if isinstance(value, tuple) else value


def test_ibex_config_prints_the_layer_default_of_an_unset_setting() -> None:
    """The real CLI entry point, in a clean environment but for one set variable: every
    variable by its name, an unset one at its layer default, durations with a unit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env[PREFIX + "HOT_LIMIT"] = "7"
    proc = subprocess.run(
        [sys.executable, "-m", "ibex", "config", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert list(shown) == [PREFIX + row.suffix for row in TABLE.values()]
    assert shown[PREFIX + "HOT_LIMIT"] == 7
    for setting, target in TARGETS:
        if setting != "hot_limit":
            variable = PREFIX + TABLE[setting].suffix
            assert shown[variable] == shown_as(setting, layer_default(target)), variable
    assert shown[PREFIX + "TIMEOUT"] == "45ms" and shown[PREFIX + "DRAIN_GRACE"] == "10s"


def test_secret_rows_are_the_credentials_and_are_redacted() -> None:
    secrets = {field for field, row in TABLE.items() if row.secret}
    assert secrets == {
        "memory_api_token",
        "auth_tokens_sha256",
        "auth_token_orgs",
        "redis_sentinel_password",
        "nonce_key",
        "metrics_token_sha256",
    }
    digest = "ab" * 32
    env = {
        PREFIX + "MEMORY_BASE_URL": "http://m:8080",
        PREFIX + "MEMORY_API_TOKEN": "tok-secret-1",
        PREFIX + "AUTH_TOKENS_SHA256": digest,
        PREFIX + "REDIS_SENTINELS": "s1:26379",
        PREFIX + "REDIS_SENTINEL_MASTER": "mymaster",
        PREFIX + "REDIS_SENTINEL_PASSWORD": "sentinel-secret-2",
        PREFIX + "NONCE_KEY": "n" * 40,
        PREFIX + "METRICS_TOKEN_SHA256": digest,
    }
    settings = load_settings(env)
    for shown in (repr(settings.redacted()), repr(effective_settings(settings))):
        for value in ("tok-secret-1", digest, "sentinel-secret-2", "n" * 40):
            assert value not in shown


@pytest.mark.parametrize("setting", list(TABLE))
def test_a_rejected_value_names_its_variable(setting: str) -> None:
    row = TABLE[setting]
    name = PREFIX + row.suffix
    try:
        row.parse(name, "no-such\x00value:x")
    except ConfigError as exc:
        assert str(exc).startswith(name)


def test_a_worker_finds_its_port_from_its_slot_alone() -> None:
    """A worker process sees the supervisor's `--workers` only through its slot: its own
    port is WORKER_PORT_BASE + slot even when its settings say one worker."""
    settings = Settings(worker_port_base=9100)
    assert settings.workers == 1
    assert settings.worker_port(3) == 9103
    assert Settings().worker_port(0) is None
    assert Settings(worker_port_base=9100, workers=3).worker_ports() == (9100, 9101, 9102)
