"""Workers never outlive their supervisor, even one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.test_workers import children, free_port, wait_for


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env["IBEX_CONTEXT_GRPC_ADDR"] = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ibex", "serve", "--workers", "2"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    workers: set[int] = set()
    try:
        wait_for(lambda: log_path.read_text().count('"event":"serving"') == 2, 60, "workers")
        workers = children(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)  # no drain, no signal forwarding: just gone
        proc.wait(timeout=10)
        wait_for(lambda: not any(alive(w) for w in workers), 30, "the workers to exit")
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
