"""`ibex config`, `ibex check` and `ibex serve` on settings: credentials hidden, typos reported."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ibex.testing.grpc_harness import daemon_process, in_thread, run_cli


async def test_cli_config_redacts_url_credentials() -> None:
    out = await in_thread(
        run_cli,
        "config",
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
    assert shown["redis_url"] == "redis://<redacted>@127.0.0.1:6379/0?password=<redacted>"
    assert shown["memory_base_url"] == "http://<redacted>@127.0.0.1:9"


async def test_cli_config_redacts_a_password_holding_url_delimiters() -> None:
    """Everything between `://` and the last `@` is userinfo, whatever characters it holds."""
    for password in ("pa/ss", "pa?ss", "pa#ss", "pa@ss"):
        out = await in_thread(
            run_cli, "config", env={"IBEX_CONTEXT_REDIS_URL": f"redis://:{password}@redis:6379/0"}
        )
        assert out.returncode == 0, out.stderr
        assert password not in out.stdout + out.stderr
        assert json.loads(out.stdout)["redis_url"] == "redis://<redacted>@redis:6379/0"


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
