"""Configurations that serve less than they could are named, each by its variable; the
defaults, and a complete configuration on TLS, are quiet (docs/configuration.md)."""

from __future__ import annotations

import pytest

from ibex.config import PREFIX, load_settings
from ibex.service.startup_checks import config_warnings

MEMORY = {PREFIX + "MEMORY_BASE_URL": "http://127.0.0.1:8080", PREFIX + "MEMORY_API_TOKEN": "t"}
SENTINELS = {
    PREFIX + "REDIS_SENTINELS": "10.0.0.1:26379,10.0.0.2:26379",
    PREFIX + "REDIS_SENTINEL_MASTER": "ibex",
}


def warned(env: dict[str, str]) -> list[str]:
    return config_warnings(load_settings(env))


@pytest.mark.parametrize(
    "env",
    [
        {},  # the bundled sample
        {PREFIX + "REDIS_URL": "redis://127.0.0.1:6379/0", **MEMORY},
        {PREFIX + "REDIS_URL": "redis://:pw@127.0.0.1:6379/0", **MEMORY},  # loopback
        {PREFIX + "REDIS_URL": "redis://:pw@localhost:6379/0", **MEMORY},
        {PREFIX + "REDIS_URL": "rediss://:pw@10.0.0.5:6379/0", **MEMORY},
        {PREFIX + "REDIS_URL": "unix:///run/redis.sock?password=pw", **MEMORY},
        {PREFIX + "REDIS_URL": "redis://10.0.0.5:6379/0", **MEMORY},  # no password to leak
        {
            **SENTINELS,
            PREFIX + "REDIS_URL": "rediss://:pw@redis/0",
            PREFIX + "REDIS_SENTINEL_PASSWORD": "spw",
            **MEMORY,
        },
        # Branch timeouts at the wall, or left at their defaults whatever the wall.
        {PREFIX + "HOT_TIMEOUT_MS": "40", PREFIX + "COLD_TIMEOUT_MS": "40ms"},
        {PREFIX + "DEADLINE_MS": "10"},
        {PREFIX + "TIMEOUT": "2s", PREFIX + "DEADLINE_MS": "2s", PREFIX + "HOT_TIMEOUT_MS": "2s"},
    ],
)
def test_a_configuration_that_serves_all_it_can_is_quiet(env: dict[str, str]) -> None:
    assert warned(env) == []


@pytest.mark.parametrize(
    "suffix,value,shown", [("HOT_TIMEOUT_MS", "500", "500ms"), ("DIRECTIVE_TIMEOUT_MS", "1s", "1s")]
)
def test_a_branch_timeout_above_the_wall_is_named(suffix: str, value: str, shown: str) -> None:
    """HOT_TIMEOUT_MS=500 over the 40 ms wall: the wall cuts the branch at 40 ms."""
    (warning,) = warned({PREFIX + suffix: value})
    assert warning.startswith(f"{PREFIX}{suffix}: {shown} is above the retrieval wall of 40ms")


def test_the_wall_is_the_lesser_of_timeout_and_deadline() -> None:
    (warning,) = warned({PREFIX + "TIMEOUT": "20ms", PREFIX + "COLD_TIMEOUT_MS": "30"})
    assert warning.startswith(f"{PREFIX}COLD_TIMEOUT_MS: 30ms is above the retrieval wall of 20ms")


def test_redis_without_the_memory_service_is_named() -> None:
    """Every answer would have no memories (issue row 5): said, naming the missing variable."""
    (warning,) = warned({PREFIX + "REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert warning.startswith(f"{PREFIX}MEMORY_BASE_URL: not set while {PREFIX}REDIS_URL is")
    assert "no memories" in warning
    (warning,) = warned(SENTINELS)
    assert warning.startswith(f"{PREFIX}MEMORY_BASE_URL: not set while {PREFIX}REDIS_SENTINELS")


def test_the_memory_service_without_redis_is_named() -> None:
    (warning,) = warned(MEMORY)
    assert warning.startswith(f"{PREFIX}REDIS_URL: not set while {PREFIX}MEMORY_BASE_URL is")
    assert "no directive" in warning


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@10.0.0.5:6379/0",
        "redis://default:hunter2@redis.example:6379/0",
        "redis://10.0.0.5:6379/0?password=hunter2",
    ],
)
def test_a_redis_password_in_clear_off_loopback_is_named(url: str) -> None:
    (warning,) = warned({PREFIX + "REDIS_URL": url, **MEMORY})
    assert warning.startswith(f"{PREFIX}REDIS_URL: its password is sent in clear")
    assert "rediss://" in warning and "hunter2" not in warning


def test_a_sentinel_password_in_clear_off_loopback_is_named() -> None:
    env = {
        **SENTINELS,
        PREFIX + "REDIS_URL": "redis://:hunter2@redis/0",
        PREFIX + "REDIS_SENTINEL_PASSWORD": "hunter3",
        **MEMORY,
    }
    warnings = warned(env)
    assert [w.partition(":")[0] for w in warnings] == [
        f"{PREFIX}REDIS_SENTINEL_PASSWORD",
        f"{PREFIX}REDIS_URL",
    ]
    assert "10.0.0.1" in warnings[0]
    assert not any("hunter" in w for w in warnings)
    local = {**env, PREFIX + "REDIS_SENTINELS": "127.0.0.1:26379,[::1]:26380"}
    assert warned(local) == []
