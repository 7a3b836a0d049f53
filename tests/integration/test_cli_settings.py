"""`ibex config`, `ibex check` and `ibex serve` on settings: credentials hidden, typos reported."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from ibex.config import PREFIX, TABLE, load_settings
from ibex.service.root import effective_settings
from ibex.testing.grpc_harness import ROOT, child_env, daemon_process, in_thread, run_cli


async def test_cli_config_redacts_url_credentials() -> None:
    out = await in_thread(
        run_cli,
        "config",
        "--json",
        env={
            "IBEX_CONTEXT_REDIS_URL": "redis://default:hunter2@127.0.0.1:6379/0?password=hunter3",
            "IBEX_CONTEXT_MEMORY_BASE_URL": "http://svc:hunter4@127.0.0.1:9",
            "IBEX_CONTEXT_MEMORY_API_TOKEN": "hunter5",
        },
    )
    assert out.returncode == 0, out.stderr
    for secret in ("hunter2", "hunter3", "hunter4", "hunter5"):
        assert secret not in out.stdout + out.stderr
    shown = json.loads(out.stdout)
    assert (
        shown["IBEX_CONTEXT_REDIS_URL"] == "redis://<redacted>@127.0.0.1:6379/0?password=<redacted>"
    )
    assert shown["IBEX_CONTEXT_MEMORY_BASE_URL"] == "http://<redacted>@127.0.0.1:9"


async def test_cli_config_redacts_a_password_holding_url_delimiters() -> None:
    """Everything between `://` and the last `@` is userinfo, whatever characters it holds."""
    for password in ("pa/ss", "pa?ss", "pa#ss", "pa@ss"):
        out = await in_thread(
            run_cli, "config", env={"IBEX_CONTEXT_REDIS_URL": f"redis://:{password}@redis:6379/0"}
        )
        assert out.returncode == 0, out.stderr
        assert password not in out.stdout + out.stderr
        assert "IBEX_CONTEXT_REDIS_URL=redis://<redacted>@redis:6379/0" in out.stdout.splitlines()


def _config(*args: str, env: dict[str, str], nofile: int) -> subprocess.CompletedProcess[str]:
    """`ibex config ARGS` with the open-file limit at `nofile` (the connection caps' base)."""

    def limit() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    return subprocess.run(
        [sys.executable, "-m", "ibex", "config", *args],
        cwd=ROOT,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=limit,
    )


async def test_cli_config_shows_variables_units_and_computed_values() -> None:
    """docs/configuration.md: variable names, durations with a unit, and the computed
    defaults' values as this process computes them (never null)."""
    env = {
        "IBEX_CONTEXT_MAX_CONCURRENT_ASSEMBLIES": "6",
        "IBEX_CONTEXT_DRAIN_GRACE": "3s",
        "IBEX_CONTEXT_MAX_QUEUE_WAIT": "250ms",
        "IBEX_CONTEXT_CONNECTION_IDLE_TIMEOUT": "2m",
    }
    out = await in_thread(_config, env=env, nofile=300)
    assert out.returncode == 0, out.stderr
    shown = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert set(shown) == {PREFIX + row.suffix for row in TABLE.values()}
    expected = {
        "TIMEOUT": "45ms",
        "DEADLINE_MS": "40ms",
        "HOT_TIMEOUT_MS": "15ms",
        "MAX_QUEUE_WAIT": "250ms",
        "REQUEST_READ_TIMEOUT": "5s",
        "DRAIN_GRACE": "3s",
        "CONNECTION_IDLE_TIMEOUT": "120s",
        "MAX_CONNECTION_AGE": "",  # off
        # computed: min(1024, NOFILE - 64), a quarter of it, half the assemblies, DRAIN_GRACE
        "MAX_CONNECTIONS": "236",
        "MAX_CONNECTIONS_PER_PEER": "59",
        "MAX_ORG_ASSEMBLIES": "3",
        "MAX_CONNECTION_AGE_GRACE": "3s",
        "MAX_CONCURRENT_ASSEMBLIES": "6",
        "HOT_LIMIT": "20",
        "REDIS_CLUSTER": "false",
    }
    assert {k: shown[PREFIX + k] for k in expected} == expected

    out = await in_thread(_config, "--json", env=env, nofile=300)
    assert out.returncode == 0, out.stderr
    as_json = json.loads(out.stdout)
    assert list(as_json) == [PREFIX + row.suffix for row in TABLE.values()]
    assert as_json[PREFIX + "MAX_CONNECTIONS"] == 236
    assert as_json[PREFIX + "MAX_ORG_ASSEMBLIES"] == 3
    assert as_json[PREFIX + "MAX_CONNECTION_AGE_GRACE"] == "3s"
    assert as_json[PREFIX + "TIMEOUT"] == "45ms"


async def test_cli_config_reads_back_as_the_same_settings() -> None:
    """The plain form is an environment file: fed back, it gives the same effective values."""
    env = {"IBEX_CONTEXT_HOT_TIMEOUT_MS": "12.5", "IBEX_CONTEXT_DIRECTIVE_CACHE_TTL": "1.5s"}
    out = await in_thread(_config, env=env, nofile=4096)
    assert out.returncode == 0, out.stderr
    again = dict(line.split("=", 1) for line in out.stdout.splitlines())
    first = effective_settings(load_settings(env))
    assert effective_settings(load_settings(again)) == {
        **first,
        "IBEX_CONTEXT_MAX_CONNECTIONS": 1024,
        "IBEX_CONTEXT_MAX_CONNECTIONS_PER_PEER": 256,
    }
    assert again["IBEX_CONTEXT_HOT_TIMEOUT_MS"] == "12.5ms"


async def test_cli_check_reports_an_unknown_variable() -> None:
    out = await in_thread(
        run_cli,
        "check",
        env={"IBEX_CONTEXT_MAX_INFLIGHT": "8", "IBEX_CONTEXT_CLIENT_TOKEN": "cli"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert (
        "settings: warning: unknown variable IBEX_CONTEXT_MAX_INFLIGHT "
        "(did you mean IBEX_CONTEXT_MAX_IN_FLIGHT?)"
    ) in lines
    assert "CLIENT_TOKEN" not in out.stdout  # the CLI client's variable is known
    assert "catalog: ok" in out.stdout  # the other checks still ran


async def test_serve_logs_an_unknown_variable_at_start_up(tmp_path: Path) -> None:
    with daemon_process({"IBEX_CONTEXT_DRAIN_GARCE": "1s"}, tmp_path / "serve.log") as proc:

        def logged() -> list[dict[str, object]]:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                events = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
                if any(e["event"] == "serving" for e in events):
                    return events
                time.sleep(0.05)
            raise AssertionError(proc.stderr)

        events = await in_thread(logged)
    warnings = [e for e in events if e["event"] == "unknown_setting"]
    assert len(warnings) == 1
    assert warnings[0]["level"] == "warning"
    assert warnings[0]["variable"] == "IBEX_CONTEXT_DRAIN_GARCE"
    assert warnings[0]["closest"] == "IBEX_CONTEXT_DRAIN_GRACE"


async def test_serve_refuses_a_supervisor_fd_that_is_not_open() -> None:
    """The hidden option the supervisor passes its workers is checked like any input."""
    out = await in_thread(run_cli, "serve", "--worker", "--supervisor-fd", "987654")
    assert out.returncode == 2
    assert "--supervisor-fd 987654 is not an open file descriptor" in out.stderr
