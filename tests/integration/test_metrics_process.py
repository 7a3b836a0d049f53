"""`/metrics` is never served from the serving loop: one worker plus a supervisor."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_workers import assemble, children, free_port, wait_for


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_one_worker_with_metrics_runs_under_a_supervisor_that_serves_them(
    tmp_path: Path,
) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{grpc_port}",
        IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{metrics_port}",
        IBEX_CONTEXT_DRAIN_GRACE="5s",
    )
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ibex", "serve"], env=env, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            wait_for(lambda: '"event":"serving"' in log_path.read_text(), 60, "the worker")
            workers = children(proc.pid)
            assert len(workers) == 1  # the gRPC loop runs in a child, not in the scraped process
            done = assemble(grpc_port)
            assert done.returncode == 0, done.stderr
            assert 'ibex_grpc_requests_total{code="OK",method="AssembleContext"} 1.0' in scrape(
                metrics_port
            )
            # With the worker gone, the supervisor still answers scrapes (and restarts it).
            os.kill(workers.pop(), signal.SIGKILL)
            assert "ibex_grpc_requests_total" in scrape(metrics_port)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


SCRAPE_TOKEN = "process-scrape-token-5b4a69788796a5b4"


def _serve_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(IBEX_CONTEXT_DRAIN_GRACE="5s", **extra)
    return env


def test_the_daemon_serves_metrics_only_with_the_scrape_token(tmp_path: Path) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    digest = hashlib.sha256(SCRAPE_TOKEN.encode()).hexdigest()
    env = _serve_env(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{grpc_port}",
        IBEX_CONTEXT_METRICS_ADDR=str(metrics_port),  # a bare port: loopback
        IBEX_CONTEXT_METRICS_TOKEN_SHA256=digest,
    )
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ibex", "serve"], env=env, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            wait_for(lambda: '"event":"serving"' in log_path.read_text(), 60, "the worker")
            with pytest.raises(urllib.error.HTTPError) as info:
                scrape(metrics_port)
            assert info.value.code == 401
            request = urllib.request.Request(
                f"http://127.0.0.1:{metrics_port}/metrics",
                headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"},
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                assert "ibex_worker_restarts_total" in response.read().decode()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    logged = log_path.read_text()
    assert SCRAPE_TOKEN not in logged and digest not in logged


def test_metrics_off_loopback_without_a_token_refuse_to_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ibex", "serve"],
        env=_serve_env(IBEX_CONTEXT_METRICS_ADDR=f"0.0.0.0:{free_port()}"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "IBEX_CONTEXT_METRICS_ADDR: binding 0.0.0.0 (not loopback) requires" in done.stderr
    assert "IBEX_CONTEXT_METRICS_TOKEN_SHA256" in done.stderr
