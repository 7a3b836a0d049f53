"""The settings table is derived from the declarations: every variable is declared once, on
the field it sets and beside its default (a layer config struct's, or `Settings`' own); an
unset variable takes that default and a set one overrides it, `ibex config` prints the
effective value, secret rows are redacted, and errors name the variable."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import typing
from typing import Any

import msgspec
import pytest

from ibex.assembly.tokens import TokenCacheConfig, Tokenizers
from ibex.config import (
    DURATIONS,
    LAYERS,
    PREFIX,
    TABLE,
    ConfigError,
    Row,
    Settings,
    format_duration,
    load_settings,
    replace_settings,
)
from ibex.envvar import declared
from ibex.service.admission import AdmissionConfig
from ibex.service.root import admission_config, connections_config, effective_settings
from ibex.sources.local_file import LocalFileSource
from ibex.sources.memory_http import MemoryHttpSource, MemoryServiceConfig
from ibex.sources.memory_schema import DEFAULT_MAX_CONTENT_BYTES

#: The variables the contract fixes (shared/spec/contract.md, section 4).
CONTRACT = {
    "AUTH_TOKEN_ORGS", "COLD_TIMEOUT_MS", "DEADLINE_MS", "DIRECTIVE_TIMEOUT_MS",
    "FORMATTER_NONCE_BYTES", "GRPC_ADDR", "HOT_TIMEOUT_MS", "MAX_CONNECTION_AGE",
    "MAX_CONNECTION_AGE_GRACE", "MEMORY_API_TOKEN", "MEMORY_BASE_URL", "NONCE_KEY",
    "PACKER_DP_CELL_CEILING", "PACKER_MAX_CONSECUTIVE_SKIPS", "REDIS_CLUSTER",
    "REDIS_SENTINELS", "REDIS_SENTINEL_MASTER", "REDIS_SENTINEL_PASSWORD", "REDIS_URL",
    "REQUIRE_PRINCIPAL", "SECTION_ORDER", "TIMEOUT", "WORKER_PORT_BASE",
}  # fmt: skip
LAYER_ROWS = [row for row in TABLE.values() if row.layer is not None]


def test_the_table_holds_every_declaration_once_and_the_contracts_names() -> None:
    declarations = [d.variable for d in declared(Settings)]
    declarations += [d.variable for struct in LAYERS.values() for d in declared(struct)]
    assert sorted(declarations) == sorted(TABLE)  # each once, nothing besides
    assert {PREFIX + name for name in CONTRACT} <= set(TABLE)
    assert len(LAYER_ROWS) >= 40  # the retrieval, admission, request, cache and pool knobs
    assert {row.owner.__name__ for row in LAYER_ROWS} >= {
        "RetrievalConfig", "RequestLimits", "PipelineConfig", "AdmissionConfig", "EdgeConfig",
        "DirectiveCacheConfig", "ConnectionsConfig", "DaemonConfig", "MemoryServiceConfig",
        "TokenCacheConfig",
    }  # fmt: skip


@pytest.mark.parametrize("variable", list(TABLE))
def test_each_row_is_its_fields_declaration_and_default(variable: str) -> None:
    """The row's default is the field's own (the one place it is written), and the field's
    annotation names this variable."""
    row = TABLE[variable]
    field = {f.name: f for f in msgspec.structs.fields(row.owner)}[row.field]
    assert row.default == field.default is not msgspec.NODEFAULT
    hint = typing.get_type_hints(row.owner, include_extras=True)[row.field]
    assert [m.extra["env"] for m in hint.__metadata__] == [variable]


def test_a_default_the_sources_use_is_the_declared_one() -> None:
    """The token cache and the memory-service client take their defaults from the struct
    that declares the variable, not from a second copy."""
    tokenizers = inspect.signature(Tokenizers).parameters
    assert tokenizers["cache_bytes"].default == TokenCacheConfig().max_bytes == 32 * 1024**2
    memory = inspect.signature(MemoryHttpSource).parameters
    defaults = MemoryServiceConfig()
    assert memory["pool_size"].default == defaults.pool_size == 32
    assert memory["max_response_bytes"].default == defaults.max_response_bytes == 4 * 1024**2
    assert memory["max_content_bytes"].default == defaults.max_content_bytes == 32 * 1024
    local = inspect.signature(LocalFileSource.load).parameters
    assert local["max_content_bytes"].default == DEFAULT_MAX_CONTENT_BYTES == 32 * 1024


def other_value(row: Row) -> Any:
    """A valid value that is not the default."""
    if row.default is None:
        return 2.5
    if isinstance(row.default, str):
        return next(v for v in typing.get_args(_hint(row)) if v != row.default)
    if isinstance(row.default, bool):
        return not row.default
    return type(row.default)(row.default * 2 + 1)


def _hint(row: Row) -> Any:
    return typing.get_type_hints(row.owner)[row.field]


def raw_text(variable: str, value: Any) -> str:
    """`value` as an operator writes it (a duration with its unit)."""
    return format_duration(value) if variable in DURATIONS else str(value)


@pytest.mark.parametrize("row", LAYER_ROWS, ids=lambda row: row.variable)
def test_an_unset_variable_takes_the_default_and_a_set_one_overrides_it(row: Row) -> None:
    assert row.value(load_settings({})) == row.default
    value = other_value(row)
    loaded = row.value(load_settings({row.variable: raw_text(row.variable, value)}))
    assert loaded == pytest.approx(value) if isinstance(value, float) else loaded == value
    assert row.value(replace_settings(Settings(), **{row.keyword: value})) == value


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
    assert connections_config(Settings()).age_grace == 10.0  # DRAIN_GRACE's default
    assert connections_config(replace_settings(Settings(), drain_grace=3.5)).age_grace == 3.5
    assert connections_config(Settings(max_connection_age_grace=1.5)).age_grace == 1.5


def test_ibex_config_prints_the_default_of_an_unset_variable() -> None:
    """The real CLI entry point, in a clean environment but for one set variable: every
    variable by its name, an unset one at its declared default, durations with a unit."""
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
    assert list(shown) == list(TABLE)
    assert shown[PREFIX + "HOT_LIMIT"] == 7
    for row in LAYER_ROWS:
        if row.suffix != "HOT_LIMIT":
            default = row.default
            if row.variable in DURATIONS and default is not None:
                default = format_duration(default)
            assert shown[row.variable] == default, row.variable
    assert shown[PREFIX + "TIMEOUT"] == "45ms" and shown[PREFIX + "DRAIN_GRACE"] == "10s"


def test_secret_rows_are_the_credentials_and_are_redacted() -> None:
    secrets = {row.suffix for row in TABLE.values() if row.secret}
    assert secrets == {
        "MEMORY_API_TOKEN",
        "AUTH_TOKENS_SHA256",
        "AUTH_TOKEN_ORGS",
        "REDIS_SENTINEL_PASSWORD",
        "NONCE_KEY",
        "METRICS_TOKEN_SHA256",
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


@pytest.mark.parametrize("variable", list(TABLE))
def test_a_rejected_value_names_its_variable(variable: str) -> None:
    try:
        TABLE[variable].parse(variable, "no-such\x00value:x")
    except ConfigError as exc:
        assert str(exc).startswith(variable)


def test_settings_built_in_code_name_each_value_as_the_environment_does() -> None:
    """`replace_settings` takes a variable's suffix in lower case (a unit's `_ms` dropped)
    and refuses a name no variable has."""
    settings = replace_settings(Settings(), hot_timeout=0.01, request_read_timeout=0.3)
    assert (settings.retrieval.hot_timeout, settings.admission.read_timeout) == (0.01, 0.3)
    with pytest.raises(TypeError, match="hot_timeout_ms"):
        replace_settings(Settings(), hot_timeout_ms=0.01)


def test_a_worker_finds_its_port_from_its_slot_alone() -> None:
    """A worker process sees the supervisor's `--workers` only through its slot: its own
    port is WORKER_PORT_BASE + slot even when its settings say one worker."""
    settings = Settings(worker_port_base=9100)
    assert settings.workers == 1
    assert settings.worker_port(3) == 9103
    assert Settings().worker_port(0) is None
    assert Settings(worker_port_base=9100, workers=3).worker_ports() == (9100, 9101, 9102)
