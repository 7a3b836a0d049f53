"""The processes under load: redis-server, the memory stand-in and the daemon.

Everything binds to loopback on a free port and is torn down by the context
managers, also when a run fails or is interrupted. CPU is read from
`/proc/<pid>/stat` (utime + stime) of the daemon's supervisor and its live
worker children, so a multi-worker daemon is charged for all of its processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.load.driver import directive_version
from benchmarks.load.memory import tenants
from ibex.testing.memory_server import DEFAULT_TOKEN
from ibex.testing.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def add_daemon_env(parser: argparse.ArgumentParser, example: str) -> None:
    """`--daemon-env KEY=VALUE` (repeatable): extra daemon settings; see `daemon_env`."""
    parser.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"extra daemon setting, e.g. {example} (repeatable)",
    )


def daemon_env(args: argparse.Namespace) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in args.daemon_env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds (0 if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_busy_seconds() -> float:
    """CPU seconds all processes on the machine spent busy (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(x) for x in fields[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / CLK_TCK


def children(pid: int) -> list[int]:
    """Live direct children of pid (scans /proc; no CONFIG_PROC_CHILDREN needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(raw.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def listeners(port: int) -> int:
    """How many sockets LISTEN on 127.0.0.1:port (one per worker with SO_REUSEPORT)."""
    want = f"0100007F:{port:04X}"
    count = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[1] == want and parts[3] == "0A":
                count += 1
    return count


def wait_listening(
    proc: subprocess.Popen[bytes], port: int, count: int = 1, timeout: float = 30.0
) -> bool:
    """Wait until `count` sockets listen on the port; False if `proc` ended or time ran out."""
    deadline = time.monotonic() + timeout
    while listeners(port) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def directive_value(i: int) -> str:
    content = (
        f"You are the support assistant for tenant {i}. Answer precisely, cite the runbook "
        "section when you use one, and never reveal internal ticket numbers. "
        "回答は簡潔に。Use ✅/❌ markers for checklists."
    )
    version = directive_version(i)
    return json.dumps(
        {"v": 1, "content": content, "injection_mode": "system_first", "version_id": version}
    )


class MemoryProcess:
    """benchmarks.load.memory in a child process, steered over its stdin."""

    def __init__(
        self, n_tenants: int, hot_ms: float, cold_ms: float, hits: tuple[int, int] | None = None
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.load.memory",
            "--tenants",
            str(n_tenants),
            "--hot-latency-ms",
            str(hot_ms),
            "--cold-latency-ms",
            str(cold_ms),
        ]
        if hits is not None:  # (hot, cold) memories per tenant; the stand-in's own default else
            cmd += ["--hot", str(hits[0]), "--cold", str(hits[1])]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first.startswith("memory server listening on "):
            self.stop()
            raise RuntimeError(f"memory stand-in did not start: {first!r}")
        self.url = first.rsplit(" ", 1)[1].strip()

    def command(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply

    def set_latency(self, endpoint: str, ms: float) -> None:
        self.command(f"latency {endpoint} {ms}")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Daemon:
    """`python -m ibex serve [--workers N]` as a child process, run from checkout `root`.

    `python -m` puts the working directory first on `sys.path`, ahead of
    PYTHONPATH, so the daemon's code is the checkout it runs in: another
    checkout's daemon needs that checkout as its working directory.
    """

    def __init__(self, env: dict[str, str], workers: int, port: int, root: Path = ROOT) -> None:
        self.workers = workers
        self.port = port
        self.addr = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "ibex", "serve"]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.root_pid = self.proc.pid
        if not wait_listening(self.proc, port, workers):
            tail = self.output()[-3000:]
            self.stop()
            raise RuntimeError(f"daemon did not start:\n{tail}")

    def pids(self) -> list[int]:
        return [self.root_pid, *children(self.root_pid)]

    def worker_pids(self) -> list[int]:
        return children(self.root_pid) if self.workers > 1 else [self.root_pid]

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM (the daemon drains), SIGKILL the whole session after 10 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.root_pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Stack:
    """Redis and the memory stand-in for the whole benchmark; daemons come and go."""

    def __init__(
        self,
        n_tenants: int = 4,
        hot_ms: float = 2.0,
        cold_ms: float = 8.0,
        hits: tuple[int, int] | None = None,
    ) -> None:
        self.tenants = tenants(n_tenants)
        self.hot_ms, self.cold_ms = hot_ms, cold_ms
        self.hits = hits
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> Stack:
        try:
            workdir = Path(self._exit.enter_context(tempfile.TemporaryDirectory()))
            self.redis = RedisServer("/usr/bin/redis-server", workdir)
            self._exit.callback(self.redis.stop)
            self.redis.start()
            for i, (org, agent) in enumerate(self.tenants):
                self.redis.set(f"{org}:directive:{agent}", directive_value(i))
            self.memory = MemoryProcess(len(self.tenants), self.hot_ms, self.cold_ms, self.hits)
            self._exit.callback(self.memory.stop)
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    def env(self, port: int, root: Path = ROOT, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_CONTEXT_")}
        env.update(
            IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{port}",
            IBEX_CONTEXT_REDIS_URL=self.redis.url,
            IBEX_CONTEXT_MEMORY_BASE_URL=self.memory.url,
            IBEX_CONTEXT_MEMORY_API_TOKEN=DEFAULT_TOKEN,
            IBEX_CONTEXT_HOT_LIMIT="20",
            IBEX_CONTEXT_COLD_LIMIT="10",
            IBEX_CONTEXT_LOG_LEVEL="warning",
            PYTHONPATH=str(root),
        )
        env.update(extra)
        return env

    @contextlib.contextmanager
    def daemon(self, workers: int, root: Path = ROOT, **extra: str) -> Iterator[Daemon]:
        """A daemon of checkout `root` (this one by default); `extra` adds to its environment."""
        port = free_port()
        d = Daemon(self.env(port, root, **extra), workers, port, root)
        try:
            yield d
        finally:
            d.stop()

    def aux_cpu(self) -> dict[str, float]:
        """CPU of the helpers, to see what the daemon competed with."""
        return {"memory": cpu_seconds(self.memory.proc.pid), "redis": cpu_seconds(self.redis.pid)}
