"""`ibex serve` refused at start says why in one line on stderr, naming the setting or the
address, with the exit status of its class (docs/operations.md: 2 a setting, 4 a file, 5 an
address); `ibex check` finds the same; a configuration that serves less than it could is a
warning at start and in `ibex check`."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from ibex.testing.grpc_harness import daemon_process, free_port, in_thread, run_cli
from ibex.testing.redis_server import RedisServer

PREFIX = "IBEX_CONTEXT_"


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another process's socket listens on for the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def said(out: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr's lines that are not structured log events (JSON): what a person reads."""
    assert "Traceback" not in out.stderr, out.stderr
    return [line for line in out.stderr.splitlines() if not line.startswith("{")]


def events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


async def test_serve_on_a_port_in_use_says_one_line_and_exits_5() -> None:
    with held_port() as port:
        out = await in_thread(
            run_cli, "serve", env={PREFIX + "GRPC_ADDR": f"127.0.0.1:{port}"}, timeout=60
        )
    assert out.returncode == 5, out.stderr
    assert said(out) == [
        f"ibex: cannot listen: IBEX_CONTEXT_GRPC_ADDR 127.0.0.1:{port}: address in use"
    ]


async def test_check_tries_every_address_serve_would_listen_on() -> None:
    grpc_port, metrics_port = free_port(), free_port()
    with held_port() as worker_port:
        env = {
            PREFIX + "GRPC_ADDR": f"127.0.0.1:{grpc_port}",
            PREFIX + "WORKER_PORT_BASE": str(worker_port),
            PREFIX + "METRICS_ADDR": f"127.0.0.1:{metrics_port}",
        }
        out = await in_thread(run_cli, "check", env=env)
        assert out.returncode == 1, out.stdout
        assert (
            f"bind 127.0.0.1:{worker_port} (IBEX_CONTEXT_WORKER_PORT_BASE): ERROR address in use"
            in out.stdout.splitlines()
        )
        assert "catalog: ok" in out.stdout  # the other checks still ran
    with held_port() as port:
        out = await in_thread(run_cli, "check", env={PREFIX + "GRPC_ADDR": f"127.0.0.1:{port}"})
    assert out.returncode == 1
    assert f"bind 127.0.0.1:{port} (IBEX_CONTEXT_GRPC_ADDR): ERROR address in use" in (
        out.stdout.splitlines()
    )
    good = await in_thread(run_cli, "check", env={PREFIX + "GRPC_ADDR": f"127.0.0.1:{port}"})
    assert good.returncode == 0, good.stdout
    assert f"bind 127.0.0.1:{port}: ok" in good.stdout.splitlines()


async def test_a_worker_port_in_use_names_worker_port_base() -> None:
    with held_port() as port:
        env = {
            PREFIX + "GRPC_ADDR": f"127.0.0.1:{free_port()}",
            PREFIX + "WORKER_PORT_BASE": str(port),
        }
        out = await in_thread(run_cli, "serve", env=env, timeout=60)
    assert out.returncode == 5, out.stderr
    assert said(out) == [
        f"ibex: cannot listen: IBEX_CONTEXT_WORKER_PORT_BASE 127.0.0.1:{port}: address in use"
    ]


async def test_the_supervisor_stops_with_a_worker_that_cannot_start() -> None:
    """`--workers 2` on a port in use: each worker says why once and the supervisor exits
    with their status, instead of restarting them forever."""
    with held_port() as port:
        out = await in_thread(
            run_cli,
            "serve",
            "--workers",
            "2",
            env={PREFIX + "GRPC_ADDR": f"127.0.0.1:{port}"},
            timeout=120,
        )
    assert out.returncode == 5, out.stderr
    line = f"ibex: cannot listen: IBEX_CONTEXT_GRPC_ADDR 127.0.0.1:{port}: address in use"
    assert set(said(out)) == {line}
    assert len(said(out)) <= 2  # once per worker, no restarts
    logged = events(out.stderr)
    assert [e["event"] for e in logged if e["level"] == "error"][:1] == ["worker_start_failed"]
    assert not any(e["event"] == "worker_exited" for e in logged)  # the restart path


async def test_the_supervisors_metrics_address_in_use_is_named() -> None:
    with held_port() as port:
        env = {
            PREFIX + "GRPC_ADDR": f"127.0.0.1:{free_port()}",
            PREFIX + "METRICS_ADDR": f"127.0.0.1:{port}",
        }
        out = await in_thread(run_cli, "serve", env=env, timeout=60)
    assert out.returncode == 5, out.stderr
    assert said(out) == [
        f"ibex: cannot listen: IBEX_CONTEXT_METRICS_ADDR 127.0.0.1:{port}: address in use"
    ]


async def test_files_that_cannot_be_loaded_exit_4_naming_the_setting(tmp_path: Path) -> None:
    bad_pem = tmp_path / "bad.pem"
    bad_pem.write_text("not a certificate\n")
    cases = {
        "IBEX_CONTEXT_TLS_CERT": {
            PREFIX + "TLS_CERT": str(tmp_path / "missing.pem"),
            PREFIX + "TLS_KEY": str(bad_pem),
        },
        "IBEX_CONTEXT_TLS_CERT/KEY": {
            PREFIX + "TLS_CERT": str(bad_pem),
            PREFIX + "TLS_KEY": str(bad_pem),
        },
        "IBEX_CONTEXT_TIKTOKEN_DIR": {PREFIX + "TIKTOKEN_DIR": str(tmp_path)},  # no rank files
    }
    for variable, env in cases.items():
        env[PREFIX + "GRPC_ADDR"] = f"127.0.0.1:{free_port()}"
        out = await in_thread(run_cli, "serve", env=env, timeout=60)
        assert out.returncode == 4, (variable, out.stderr)
        (line,) = said(out)
        assert line.startswith(f"ibex: cannot load a file: {variable}: "), line


async def test_a_bare_number_for_a_setting_in_seconds_stops_start_up() -> None:
    out = await in_thread(run_cli, "serve", env={PREFIX + "MAX_QUEUE_WAIT": "45"})
    assert out.returncode == 2
    assert said(out) == [
        "ibex: configuration error: IBEX_CONTEXT_MAX_QUEUE_WAIT: give a unit, e.g. 45ms or 5s "
        "(a bare number would be milliseconds), got '45'"
    ]


async def test_warnings_at_start_and_in_check(redis_server: RedisServer, tmp_path: Path) -> None:
    """Redis without the memory service (every answer without memories) and a branch
    timeout above the wall: one warning event each at start, and in `ibex check`."""
    env = {PREFIX + "REDIS_URL": redis_server.url, PREFIX + "HOT_TIMEOUT_MS": "500"}
    check = await in_thread(run_cli, "check", env={**env, PREFIX + "GRPC_ADDR": "127.0.0.1:0"})
    assert check.returncode == 0, check.stdout  # warnings do not fail the check
    warned = [x for x in check.stdout.splitlines() if x.startswith("settings: warning: ")]
    assert [w.removeprefix("settings: warning: ").partition(":")[0] for w in warned] == [
        "IBEX_CONTEXT_HOT_TIMEOUT_MS",
        "IBEX_CONTEXT_MEMORY_BASE_URL",
    ]
    assert "500ms is above the retrieval wall of 40ms" in warned[0]

    with daemon_process(env, tmp_path / "serve.log") as proc:

        def serving() -> list[dict[str, object]]:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                logged = events(proc.stderr)
                if any(e["event"] == "serving" for e in logged):
                    return logged
                time.sleep(0.05)
            raise AssertionError(proc.stderr)

        logged = await in_thread(serving)
    warnings = [e for e in logged if e["event"] == "config_warning"]
    assert [(e["level"], e["variable"]) for e in warnings] == [
        ("warning", "IBEX_CONTEXT_HOT_TIMEOUT_MS"),
        ("warning", "IBEX_CONTEXT_MEMORY_BASE_URL"),
    ]
    assert [e["detail"] for e in warnings] == [
        w.removeprefix("settings: warning: ") for w in warned
    ]
