"""The settings table: every row's layer target exists and shares its default, the root
fills each layer config from it, its secret rows are redacted, and its errors name the variable."""

from __future__ import annotations

import msgspec
import pytest

from ibex.assembly.pipeline import PipelineConfig
from ibex.assembly.validation import RequestLimits
from ibex.config import PREFIX, TABLE, ConfigError, Settings, load_settings
from ibex.service.admission import AdmissionConfig
from ibex.service.connections import ConnectionsConfig
from ibex.service.daemon import DaemonConfig
from ibex.service.handlers import EdgeConfig
from ibex.service.root import layer_config
from ibex.sources.directive_cache import DirectiveCacheConfig
from ibex.sources.retrieval import RetrievalConfig

LAYERS: dict[str, type[msgspec.Struct]] = {
    c.__name__: c
    for c in (
        RetrievalConfig,
        RequestLimits,
        PipelineConfig,
        AdmissionConfig,
        EdgeConfig,
        DirectiveCacheConfig,
        ConnectionsConfig,
        DaemonConfig,
    )
}
TARGETS = [(setting, target) for setting, row in TABLE.items() for target in row.to]


def test_the_table_covers_every_setting_once() -> None:
    assert list(TABLE) == list(Settings.__struct_fields__)
    suffixes = [row.suffix for row in TABLE.values()]
    assert len(set(suffixes)) == len(suffixes)
    assert len(TARGETS) >= 30  # the retrieval, admission, request and cache knobs at least


@pytest.mark.parametrize("setting,target", TARGETS)
def test_each_target_is_a_layer_field_with_the_same_default(setting: str, target: str) -> None:
    """A layer built alone (tests, benchmarks) behaves as the daemon's default, except
    where the layer's None turns a feature off that the daemon turns on."""
    struct, _, field = target.partition(".")
    fields = {f.name: f for f in msgspec.structs.fields(LAYERS[struct])}
    assert field in fields, f"{setting} targets a missing {target}"
    if fields[field].default is not None:
        assert fields[field].default == getattr(Settings(), setting), target


def test_layer_config_takes_every_targeted_field_from_the_settings() -> None:
    """Each targeted setting, moved off its default, reaches its layer field."""
    changed = {}
    for setting, _ in TARGETS:
        default = getattr(Settings(), setting)
        changed[setting] = 2.5 if default is None else type(default)(default * 2 + 1)
    settings = Settings(**changed)
    for setting, target in TARGETS:
        struct, _, field = target.partition(".")
        extra = {"connections": ConnectionsConfig()} if struct == "DaemonConfig" else {}
        built = layer_config(LAYERS[struct], settings, **extra)
        assert getattr(built, field) == changed[setting], target


def test_secret_rows_are_the_credentials_and_are_redacted() -> None:
    secrets = {field for field, row in TABLE.items() if row.secret}
    assert secrets == {
        "memory_api_token",
        "auth_tokens_sha256",
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
    shown = repr(load_settings(env).redacted())
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
