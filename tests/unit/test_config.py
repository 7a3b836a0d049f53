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
    assert s.token_cache_bytes == 32 * 1024 * 1024
    assert load_settings({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "8"}).formatter_nonce_bytes == 8


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "65"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "0"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        # Below 8 random bytes a forged nonce becomes guessable.
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "7"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_TOKEN_CACHE_BYTES": "-1"}, "IBEX_CONTEXT_TOKEN_CACHE_BYTES"),
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
