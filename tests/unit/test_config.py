"""Settings: durations, validation messages that name the variable, redaction."""

from __future__ import annotations

import pytest

from ibex.config import ConfigError, load_settings, parse_duration


@pytest.mark.parametrize(
    "raw,seconds", [("45", 0.045), ("45ms", 0.045), ("0.2s", 0.2), (" 5 ms ", 0.005)]
)
def test_durations(raw: str, seconds: float) -> None:
    assert parse_duration("X", raw) == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "nan", "inf", "1e999s", "5 minutes", ""])
def test_bad_durations_name_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_TIMEOUT"):
        load_settings({"IBEX_CONTEXT_TIMEOUT": raw or "  x"})


def test_defaults_match_the_contract() -> None:
    s = load_settings({})
    assert (s.timeout, s.deadline, s.wall) == (0.045, 0.040, 0.040)
    assert (s.directive_timeout, s.hot_timeout, s.cold_timeout) == (0.005, 0.015, 0.045)
    assert s.grpc_addr == "127.0.0.1:9092"
    assert (s.packer_dp_cell_ceiling, s.packer_max_consecutive_skips) == (437570, 5)
    assert s.formatter_nonce_bytes == 16


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "65"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "0"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_PACKER_DP_CELL_CEILING": "lots"}, "IBEX_CONTEXT_PACKER_DP_CELL_CEILING"),
        ({"IBEX_CONTEXT_GRPC_ADDR": "nohost"}, "IBEX_CONTEXT_GRPC_ADDR"),
        ({"IBEX_CONTEXT_REDIS_URL": "http://x"}, "IBEX_CONTEXT_REDIS_URL"),
        ({"IBEX_CONTEXT_MEMORY_BASE_URL": "ftp://x"}, "IBEX_CONTEXT_MEMORY_BASE_URL"),
        ({"IBEX_CONTEXT_MEMORY_BASE_URL": "http://m:8080"}, "IBEX_CONTEXT_MEMORY_API_TOKEN"),
        ({"IBEX_CONTEXT_AUTH_TOKENS_SHA256": "abc"}, "IBEX_CONTEXT_AUTH_TOKENS_SHA256"),
        ({"IBEX_CONTEXT_ALLOW_INSECURE": "maybe"}, "IBEX_CONTEXT_ALLOW_INSECURE"),
        ({"IBEX_CONTEXT_CATALOG_PATH": "/nonexistent/c.json"}, "IBEX_CONTEXT_CATALOG_PATH"),
        ({"IBEX_CONTEXT_LOG_LEVEL": "loud"}, "IBEX_CONTEXT_LOG_LEVEL"),
    ],
)
def test_errors_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(env)


def test_secret_is_never_in_errors_or_redacted_output() -> None:
    secret = "s3cr3t-token-value"
    s = load_settings(
        {
            "IBEX_CONTEXT_MEMORY_BASE_URL": "http://mem:8080/",
            "IBEX_CONTEXT_MEMORY_API_TOKEN": secret,
        }
    )
    assert s.memory_base_url == "http://mem:8080"
    assert secret not in repr(s.redacted())
    assert s.redacted()["memory_api_token"] == "<redacted>"


# -- scale-out settings ----------------------------------------------------------------------

SENTINELS = "10.0.0.1:26379,10.0.0.2:26379"


def test_worker_ports_are_base_plus_index() -> None:
    s = load_settings({"IBEX_CONTEXT_WORKER_PORT_BASE": "9100", "IBEX_CONTEXT_WORKERS": "3"})
    assert s.worker_ports() == (9100, 9101, 9102)
    assert load_settings({}).worker_ports() == ()


@pytest.mark.parametrize(
    "env",
    [
        {"IBEX_CONTEXT_WORKER_PORT_BASE": "0"},
        {"IBEX_CONTEXT_WORKER_PORT_BASE": "65535", "IBEX_CONTEXT_WORKERS": "2"},
        {"IBEX_CONTEXT_WORKER_PORT_BASE": "9091", "IBEX_CONTEXT_WORKERS": "2"},  # hits 9092
        {"IBEX_CONTEXT_WORKER_PORT_BASE": "9464", "IBEX_CONTEXT_METRICS_ADDR": "0.0.0.0:9464"},
    ],
)
def test_bad_worker_ports_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_WORKER_PORT_BASE"):
        load_settings(env)


def test_sentinel_settings() -> None:
    s = load_settings(
        {
            "IBEX_CONTEXT_REDIS_SENTINELS": SENTINELS,
            "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": "ibex",
            "IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD": "s3cret-sentinel",
        }
    )
    assert s.redis_sentinels == ("10.0.0.1:26379", "10.0.0.2:26379")
    assert (s.redis_sentinel_master, s.redis_configured) == ("ibex", True)
    assert s.redacted()["redis_sentinel_password"] == "<redacted>"
    assert "s3cret-sentinel" not in repr(s.redacted())


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"IBEX_CONTEXT_REDIS_SENTINELS": SENTINELS}, "IBEX_CONTEXT_REDIS_SENTINEL_MASTER"),
        ({"IBEX_CONTEXT_REDIS_SENTINEL_MASTER": "ibex"}, "IBEX_CONTEXT_REDIS_SENTINELS"),
        (
            {"IBEX_CONTEXT_REDIS_SENTINELS": "nohost", "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": "m"},
            "IBEX_CONTEXT_REDIS_SENTINELS",
        ),
        (
            {
                "IBEX_CONTEXT_REDIS_SENTINELS": SENTINELS,
                "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": "m",
                "IBEX_CONTEXT_REDIS_URL": "unix:///run/redis.sock",
            },
            "IBEX_CONTEXT_REDIS_URL",
        ),
        ({"IBEX_CONTEXT_REDIS_CLUSTER": "true"}, "IBEX_CONTEXT_REDIS_CLUSTER"),
        (
            {"IBEX_CONTEXT_REDIS_CLUSTER": "yes", "IBEX_CONTEXT_REDIS_URL": "unix:///r.sock"},
            "IBEX_CONTEXT_REDIS_CLUSTER",
        ),
        ({"IBEX_CONTEXT_REDIS_CLUSTER": "maybe"}, "IBEX_CONTEXT_REDIS_CLUSTER"),
    ],
)
def test_bad_redis_topology_names_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(env)


def test_cluster_setting() -> None:
    s = load_settings(
        {"IBEX_CONTEXT_REDIS_CLUSTER": "true", "IBEX_CONTEXT_REDIS_URL": "redis://10.0.0.1:7000"}
    )
    assert s.redis_cluster and s.redis_configured


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:p4ss@redis:6379/0", "redis://:<redacted>@redis:6379/0"),
        ("rediss://ibex:p4ss@redis:6380/1?x=1", "rediss://ibex:<redacted>@redis:6380/1?x=1"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ],
)
def test_redis_url_password_is_redacted(url: str, shown: str) -> None:
    s = load_settings({"IBEX_CONTEXT_REDIS_URL": url})
    assert s.redacted()["redis_url"] == shown
    assert "p4ss" not in repr(s.redacted())
