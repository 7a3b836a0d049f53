"""`ibex serve --workers 2`: one port, READY when all are up, a crash survived, drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def assemble(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ibex", "assemble", "--addr", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def wait_for(predicate: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def supervisor(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], int, int, socket.socket, Path]]:
    grpc_port, metrics_port = free_port(), free_port()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = tmp_path / "notify.sock"
    notify.bind(str(notify_path))
    notify.settimeout(30)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{grpc_port}",
        IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{metrics_port}",
        IBEX_CONTEXT_DRAIN_GRACE="5s",
        NOTIFY_SOCKET=str(notify_path),
    )
    log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibex", "serve", "--workers", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    try:
        yield proc, grpc_port, metrics_port, notify, tmp_path / "stderr.log"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        notify.close()
        log.close()


def test_workers_share_port_survive_a_crash_and_drain(
    supervisor: tuple[subprocess.Popen[str], int, int, socket.socket, Path],
) -> None:
    proc, port, metrics_port, notify, log_path = supervisor
    # systemd hears READY=1 only once both workers have bound the port.
    msg = notify.recv(4096).decode()
    while "READY=1" not in msg.splitlines():
        msg = notify.recv(4096).decode()
    workers = children(proc.pid)
    assert len(workers) == 2

    first = assemble(port)
    assert first.returncode == 0, first.stderr
    assert "<memories nonce=" in first.stdout

    victim = sorted(workers)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(children(proc.pid) - {victim}) == 2, 30, "a replacement worker")
    assert victim not in children(proc.pid)
    wait_for(
        lambda: log_path.read_text().count('"event":"serving"') == 3, 60, "the replacement ready"
    )
    # The port keeps answering while and after the worker is replaced.
    for _ in range(3):
        again = assemble(port)
        assert again.returncode == 0, again.stderr

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    text = body.decode()
    ok = [
        line
        for line in text.splitlines()
        if line.startswith('ibex_grpc_requests_total{code="OK",method="AssembleContext"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= 4  # aggregated over all workers, dead ones too

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    stderr = log_path.read_text()
    assert '"event":"worker_exited"' in stderr
    assert stderr.count('"event":"stopped"') >= 2
