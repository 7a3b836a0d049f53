"""Settings: durations, validation messages that name the variable, redaction."""

from __future__ import annotations

import pytest

from ibex.config import (
    DURATIONS,
    PREFIX,
    TABLE,
    ConfigError,
    format_duration,
    known_variables,
    load_settings,
    parse_duration,
    redact_url,
    unknown_variables,
)


@pytest.mark.parametrize(
    "raw,seconds",
    [
        ("45", 0.045),
        ("45ms", 0.045),
        ("0.2s", 0.2),
        (" 5 ms ", 0.005),
        ("2m", 120.0),
        ("1.5m", 90.0),
        ("1h", 3600.0),
    ],
)
def test_durations(raw: str, seconds: float) -> None:
    """docs/configuration.md: a unit of ms, s, m or h; a bare number is milliseconds."""
    assert parse_duration("X", raw) == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "nan", "inf", "1e999s", "5 minutes", "", "5d"])
def test_bad_durations_name_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_TIMEOUT"):
        load_settings({"IBEX_CONTEXT_TIMEOUT": raw or "  x"})


#: The duration settings documented in seconds: a bare number is refused, not read as ms.
SECONDS_SETTINGS = [
    "MAX_QUEUE_WAIT",
    "REQUEST_READ_TIMEOUT",
    "DIRECTIVE_CACHE_TTL",
    "DIRECTIVE_CACHE_MAX_AGE",
    "DRAIN_GRACE",
    "CONNECTION_AUTH_TIMEOUT",
    "CONNECTION_FIRST_CALL_GRACE",
    "TLS_HANDSHAKE_TIMEOUT",
    "CONNECTION_IDLE_TIMEOUT",
    "MAX_CONNECTION_AGE",
    "MAX_CONNECTION_AGE_GRACE",
]


@pytest.mark.parametrize("suffix", SECONDS_SETTINGS)
def test_a_bare_number_is_refused_where_it_would_change_the_meaning(suffix: str) -> None:
    """`MAX_QUEUE_WAIT=45` must not be 45 s beside `TIMEOUT=45` being 45 ms: it asks for
    a unit, naming the variable; with one it is read as given."""
    name = PREFIX + suffix
    with pytest.raises(ConfigError) as caught:
        load_settings({name: "45"})
    assert str(caught.value).startswith(
        f"{name}: give a unit, e.g. 45ms or 5s (a bare number would be milliseconds)"
    )
    row = TABLE[name]
    assert row.value(load_settings({name: "45s"})) == 45.0
    assert row.value(load_settings({name: "450ms"})) == pytest.approx(0.45)
    assert row.value(load_settings({name: "2m"})) == 120.0


def test_every_duration_setting_is_read_one_way() -> None:
    """Each duration takes every unit; a bare number is milliseconds or refused, never
    seconds."""
    assert {TABLE[name].suffix for name in DURATIONS} >= set(SECONDS_SETTINGS) | {"TIMEOUT"}
    within_bounds = {PREFIX + "NONCE_MAX_AGE": ("1.5m", 90.0)}  # a minute at least
    for name in DURATIONS:
        raw, seconds = within_bounds.get(name, ("1.5s", 1.5))
        assert TABLE[name].value(load_settings({name: raw})) == seconds
        try:
            bare = TABLE[name].value(load_settings({name: "45"}))
        except ConfigError as exc:
            assert str(exc).startswith(f"{name}: give a unit")
        else:
            assert bare == pytest.approx(0.045), name


@pytest.mark.parametrize(
    "seconds,shown",
    [(0.045, "45ms"), (0.04, "40ms"), (0.0005, "0.5ms"), (1.0, "1s"), (1.5, "1.5s"), (300, "300s")],
)
def test_a_duration_is_shown_with_a_unit_that_reads_back(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown
    assert parse_duration("X", shown, bare=False) == pytest.approx(seconds)


def test_defaults_match_the_contract() -> None:
    from ibex.service.root import effective_settings

    s = effective_settings(load_settings({}))
    assert (s[PREFIX + "TIMEOUT"], s[PREFIX + "DEADLINE_MS"]) == ("45ms", "40ms")
    assert (
        s[PREFIX + "DIRECTIVE_TIMEOUT_MS"],
        s[PREFIX + "HOT_TIMEOUT_MS"],
        s[PREFIX + "COLD_TIMEOUT_MS"],
    ) == ("5ms", "15ms", "45ms")
    assert s[PREFIX + "GRPC_ADDR"] == "127.0.0.1:9092"
    assert (s[PREFIX + "PACKER_DP_CELL_CEILING"], s[PREFIX + "PACKER_MAX_CONSECUTIVE_SKIPS"]) == (
        437570,
        5,
    )
    assert s[PREFIX + "FORMATTER_NONCE_BYTES"] == 16
    assert s[PREFIX + "TOKEN_CACHE_BYTES"] == 32 * 1024 * 1024
    assert (s[PREFIX + "MAX_IN_FLIGHT"], s[PREFIX + "MAX_IN_FLIGHT_BYTES"]) == (
        256,
        64 * 1024 * 1024,
    )
    got = load_settings({"IBEX_CONTEXT_MAX_IN_FLIGHT_BYTES": "2048"})
    assert got.admission.max_in_flight_bytes == 2048
    assert load_settings({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "8"}).pipeline.nonce_bytes == 8


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "65"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "0"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        # Below 8 random bytes a forged nonce becomes guessable.
        ({"IBEX_CONTEXT_FORMATTER_NONCE_BYTES": "7"}, "IBEX_CONTEXT_FORMATTER_NONCE_BYTES"),
        ({"IBEX_CONTEXT_TOKEN_CACHE_BYTES": "-1"}, "IBEX_CONTEXT_TOKEN_CACHE_BYTES"),
        ({"IBEX_CONTEXT_MAX_IN_FLIGHT_BYTES": "1023"}, "IBEX_CONTEXT_MAX_IN_FLIGHT_BYTES"),
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


# -- URL credentials and unknown variables (issue 11 item 8) -----------------------------------


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:hunter2@cache:6379/0", "redis://<redacted>@cache:6379/0"),
        ("rediss://user:hunter2@cache:6380/1", "rediss://<redacted>@cache:6380/1"),
        (
            "redis://cache:6379/0?password=hunter2&db=1",
            "redis://cache:6379/0?password=<redacted>&db=1",
        ),
        (
            "unix:///run/redis.sock?db=2&password=hunter2",
            "unix:///run/redis.sock?db=2&password=<redacted>",
        ),
        ("https://svc:hunter2@memory:8443/base", "https://<redacted>@memory:8443/base"),
        ("http://memory:8080", "http://memory:8080"),
        ("127.0.0.1:9092", "127.0.0.1:9092"),
        # `;` separates parameters too, `sig` names a secret, the rest stays as written.
        ("https://h/x?db=1;token=hunter2", "https://h/x?db=1;token=<redacted>"),
        ("https://h/x?a=/b&sig=hunter2#f", "https://h/x?a=/b&sig=<redacted>#f"),
    ],
)
def test_url_credentials_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


@pytest.mark.parametrize(
    "url,shown",
    [
        # A password with characters a URL parser reads as path, query, fragment or userinfo end.
        ("redis://:pa/ss@redis:6379/0", "redis://<redacted>@redis:6379/0"),
        ("redis://:pa?ss@redis:6379/0", "redis://<redacted>@redis:6379/0"),
        ("redis://:pa#ss@redis:6379/0", "redis://<redacted>@redis:6379/0"),
        ("redis://default:pa@ss@redis:6379/0", "redis://<redacted>@redis:6379/0"),
        ("rediss://u:a/b?c#d@e@redis:6380/1", "rediss://<redacted>@redis:6380/1"),
        (
            "redis://:pa/ss@redis:6379/0?password=q&db=1",
            "redis://<redacted>@redis:6379/0?password=<redacted>&db=1",
        ),
        ("user:pa/ss@host:26379", "<redacted>@host:26379"),
    ],
)
def test_userinfo_up_to_the_last_at_sign_is_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    for piece in ("pa/ss", "pa?ss", "pa#ss", "pa@ss", "a/b?c#d@e", ":pa", "ss@"):
        assert piece not in redact_url(url)


def test_every_url_setting_is_redacted() -> None:
    s = load_settings(
        {
            "IBEX_CONTEXT_REDIS_URL": "redis://default:hunter2@cache:6379/0?password=hunter3",
            "IBEX_CONTEXT_MEMORY_BASE_URL": "https://svc:hunter4@memory:8443",
            "IBEX_CONTEXT_MEMORY_API_TOKEN": "hunter5",
        }
    )
    shown = repr(s.redacted())
    for secret in ("hunter2", "hunter3", "hunter4", "hunter5"):
        assert secret not in shown
    assert s.redacted()["redis_url"] == "redis://<redacted>@cache:6379/0?password=<redacted>"
    assert s.redis_url == "redis://default:hunter2@cache:6379/0?password=hunter3"  # unchanged


def test_unknown_variables_name_the_closest_known_one() -> None:
    env = {
        "IBEX_CONTEXT_MAX_INFLIGHT": "8",
        "IBEX_CONTEXT_REDIS_ULR": "redis://x",
        "IBEX_CONTEXT_ZZZZZZZZZZZZ": "1",
        "IBEX_CONTEXT_CLIENT_TOKEN": "used by the CLI client",
        "IBEX_CONTEXT_TIMEOUT": "45ms",
        "IBEX_CONTEXT_MAX_CONNECTION_AGE": "1800s",
        "OTHER_VARIABLE": "ignored",
    }
    assert unknown_variables(env) == [
        ("IBEX_CONTEXT_MAX_INFLIGHT", "IBEX_CONTEXT_MAX_IN_FLIGHT"),
        ("IBEX_CONTEXT_REDIS_ULR", "IBEX_CONTEXT_REDIS_URL"),
        ("IBEX_CONTEXT_ZZZZZZZZZZZZ", None),
    ]


def test_known_variables_come_from_the_parser_itself() -> None:
    """Every variable `load_settings` reads is known, with no second list to keep in step."""
    known = known_variables()
    for field in ("TIMEOUT", "REDIS_URL", "MAX_CONNECTIONS", "MAX_CONNECTION_AGE_GRACE", "WORKERS"):
        assert PREFIX + field in known


def test_connection_settings() -> None:
    from ibex.service.root import connections_config

    s = load_settings({})
    assert (s.max_connections, s.max_connection_age_grace) == (None, None)
    c = connections_config(s)
    assert (c.idle_timeout, c.max_age, c.age_grace) == (300.0, None, 10.0)
    s = load_settings(
        {
            "IBEX_CONTEXT_MAX_CONNECTIONS": "100",
            "IBEX_CONTEXT_CONNECTION_IDLE_TIMEOUT": "90s",
            "IBEX_CONTEXT_MAX_CONNECTION_AGE": "10m",
            "IBEX_CONTEXT_MAX_CONNECTION_AGE_GRACE": "500ms",
        }
    )
    assert (s.max_connections, s.connections.idle_timeout) == (100, 90.0)
    assert (s.connections.max_age, s.max_connection_age_grace) == (600.0, 0.5)
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_MAX_CONNECTION_AGE"):
        load_settings({"IBEX_CONTEXT_MAX_CONNECTION_AGE": "0s"})
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_MAX_CONNECTIONS"):
        load_settings({"IBEX_CONTEXT_MAX_CONNECTIONS": "0"})


def test_fair_connection_settings() -> None:
    """Per-peer cap, the close of unauthenticated connections, the TLS handshake timeout;
    and their translation (the per-peer default is a quarter of the cap, at least 1)."""
    from ibex.service.root import connections_config

    s = load_settings({"IBEX_CONTEXT_MAX_CONNECTIONS": "100"})
    assert s.max_connections_per_peer is None
    c = connections_config(s)
    assert (c.max_per_peer, c.auth_timeout, c.tls_handshake_timeout) == (25, 10.0, 5.0)
    assert (
        connections_config(load_settings({"IBEX_CONTEXT_MAX_CONNECTIONS": "3"})).max_per_peer == 1
    )
    s = load_settings(
        {
            "IBEX_CONTEXT_MAX_CONNECTIONS_PER_PEER": "7",
            "IBEX_CONTEXT_CONNECTION_AUTH_TIMEOUT": "3s",
            "IBEX_CONTEXT_TLS_HANDSHAKE_TIMEOUT": "1500ms",
        }
    )
    c = connections_config(s)
    assert (c.max_per_peer, c.auth_timeout, c.tls_handshake_timeout) == (7, 3.0, 1.5)
    for name in ("MAX_CONNECTIONS_PER_PEER", "CONNECTION_AUTH_TIMEOUT", "TLS_HANDSHAKE_TIMEOUT"):
        with pytest.raises(ConfigError, match=f"IBEX_CONTEXT_{name}"):
            load_settings({f"IBEX_CONTEXT_{name}": "0"})


def test_directive_cache_max_age() -> None:
    from ibex.service.root import layer_config
    from ibex.sources.directive_cache import DirectiveCacheConfig

    assert layer_config(DirectiveCacheConfig, load_settings({})).max_age == 2.0
    got = load_settings({"IBEX_CONTEXT_DIRECTIVE_CACHE_MAX_AGE": "500ms"})
    assert got.directive_cache.max_age == 0.5
    got = load_settings({"IBEX_CONTEXT_DIRECTIVE_CACHE_MAX_AGE": "3s"})
    assert got.directive_cache.max_age == 3
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_DIRECTIVE_CACHE_MAX_AGE"):
        load_settings({"IBEX_CONTEXT_DIRECTIVE_CACHE_MAX_AGE": "0s"})


def test_a_listening_port_is_named_by_its_variable() -> None:
    """The one line of a failed bind names the setting: worker i's own port is
    WORKER_PORT_BASE + i, also in a worker process, whose settings say one worker."""
    from ibex.service.startup_checks import listen_variable

    worker = load_settings(
        {
            "IBEX_CONTEXT_GRPC_ADDR": "127.0.0.1:9092",
            "IBEX_CONTEXT_WORKER_PORT_BASE": "9100",
            "IBEX_CONTEXT_METRICS_ADDR": "9464",
        }
    )
    assert worker.workers == 1
    assert listen_variable(worker, 9092) == "IBEX_CONTEXT_GRPC_ADDR"
    assert listen_variable(worker, 9103) == "IBEX_CONTEXT_WORKER_PORT_BASE"
    assert listen_variable(worker, 9464) == "IBEX_CONTEXT_METRICS_ADDR"
    assert listen_variable(load_settings({}), 9092) == "IBEX_CONTEXT_GRPC_ADDR"
