"""A real redis-server on a free loopback port, for integration and chaos tests.

The process is started and stopped synchronously (it takes a few milliseconds)
so the fixture works for any test; the one call that must not block the event
loop, `debug_sleep`, is a Trio task. Expose the fixtures to a test package with
`from ibex.testing.redis_server import redis_server  # noqa: F401` in its conftest, or
`pytest_plugins = ["ibex.testing.redis_server"]` in the top-level conftest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import trio
import trio_asyncio

_START_TIMEOUT = 5.0
_LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def _resp(*parts: str | bytes) -> bytes:
    """Encode one command in RESP, so the helper needs no client library."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class RedisServer:
    """One redis-server process: start, pause, kill and restart it on the same port."""

    def __init__(
        self,
        executable: str,
        workdir: Path,
        *,
        tls: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.executable = executable
        self.workdir = workdir
        self.extra_args = list(extra_args)  # e.g. --replicaof, --cluster-enabled
        self.port = _free_port()
        self.tls_port = _free_port() if tls else None
        self.ca_path = workdir / "ca.pem"
        # Unix socket paths are limited to ~100 bytes; pytest's tmp_path can be longer.
        self._sockdir = Path(tempfile.mkdtemp(prefix="ibex-redis-"))
        self.unix_path = self._sockdir / "redis.sock"
        self.log_path = workdir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{_LOOPBACK}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_path}"

    @property
    def tls_url(self) -> str:
        """rediss:// on the TLS port; trust `ca_path` to verify it."""
        assert self.tls_port is not None, "started without tls=True"
        return f"rediss://{_LOOPBACK}:{self.tls_port}/0"

    @property
    def pid(self) -> int:
        assert self._proc is not None, "redis-server is not running"
        return self._proc.pid

    def start(self) -> None:
        """Start on self.port and return once PING answers."""
        args = [
            self.executable,
            "--port", str(self.port),
            "--bind", _LOOPBACK,
            "--save", "",
            "--appendonly", "no",
            "--unixsocket", str(self.unix_path),
            "--unixsocketperm", "700",
            "--enable-debug-command", "local",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.tls_port is not None:
            args += self._tls_args(self.tls_port)
        args += self.extra_args
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                # -NOAUTH: up, with a password (extra_args=["--requirepass", ...]).
                if self.command("PING", timeout=0.2).startswith((b"+PONG", b"-NOAUTH")):
                    return
            time.sleep(0.005)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{tail}")

    def _tls_args(self, port: int) -> list[str]:
        """A throwaway CA (trustme) and a server certificate for 127.0.0.1."""
        import trustme

        key_path, cert_path = self.workdir / "server.key", self.workdir / "server.pem"
        if not self.ca_path.exists():
            ca = trustme.CA()
            leaf = ca.issue_cert(_LOOPBACK)
            ca.cert_pem.write_to_path(str(self.ca_path))
            leaf.private_key_pem.write_to_path(str(key_path))
            leaf.cert_chain_pems[0].write_to_path(str(cert_path))
        return [
            "--tls-port", str(port),
            "--tls-cert-file", str(cert_path),
            "--tls-key-file", str(key_path),
            "--tls-ca-cert-file", str(self.ca_path),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def command(self, *parts: str | bytes, timeout: float = 1.0) -> bytes:
        """One command on a fresh connection: a bulk reply's payload, else the reply line."""
        with socket.create_connection((_LOOPBACK, self.port), timeout=timeout) as s:
            s.sendall(_resp(*parts))
            buf = b""
            while True:
                head, sep, rest = buf.partition(b"\r\n")
                if sep and not head.startswith(b"$"):
                    return head
                if sep and (int(head[1:]) < 0 or len(rest) >= int(head[1:])):
                    return rest[: max(0, int(head[1:]))]
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("redis-server closed the connection")
                buf += chunk

    def set(self, key: str, value: bytes | str) -> None:
        reply = self.command("SET", key, value)
        assert reply == b"+OK", reply

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap: connections are reset, new ones are refused."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=_START_TIMEOUT)

    def restart(self) -> None:
        """Kill (if running) and start again on the same port; data is gone."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the process (even if paused) and remove the socket directory."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGCONT)
            self._proc.kill()
            self._proc.wait(timeout=_START_TIMEOUT)
        self._proc = None
        shutil.rmtree(self._sockdir, ignore_errors=True)

    async def debug_sleep(
        self,
        seconds: float,
        *,
        settle: float = 0.01,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Block the whole server for `seconds` via DEBUG SLEEP on its own connection.

        Use with `await nursery.start(server.debug_sleep, 0.05)`: it reports started
        once the command is sent and `settle` has passed (so the server is asleep),
        and returns when the server answers again (or dies).
        """
        with trio.socket.socket() as s:
            await s.connect((_LOOPBACK, self.port))
            await s.send(_resp("DEBUG", "SLEEP", repr(seconds)))
            await trio.sleep(settle)
            task_status.started()
            reply = await s.recv(64)
            # An empty reply means the server was killed meanwhile, which chaos tests do.
            assert not reply or reply.startswith(b"+OK"), reply


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail(
            "redis-server not found on PATH; install it (e.g. `apt-get install redis-server`)",
            pytrace=False,
        )
    return path


def _started(server: RedisServer) -> Iterator[RedisServer]:
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test, always killed in teardown."""
    yield from _started(RedisServer(find_redis_server(), tmp_path))


@pytest.fixture
def redis_tls_server(tmp_path: Path) -> Iterator[RedisServer]:
    """Like redis_server, plus a TLS port (`tls_url`, `ca_path`)."""
    yield from _started(RedisServer(find_redis_server(), tmp_path, tls=True))


@pytest.fixture
async def trio_asyncio_loop() -> AsyncIterator[trio_asyncio.TrioEventLoop]:
    """The daemon's loop shape: Trio running a trio-asyncio loop for redis.asyncio.

    pytest-trio runs fixtures and the test in one contextvars context, so the
    loop opened here is `trio_asyncio.current_loop` inside the test.
    """
    async with trio_asyncio.open_loop() as loop:
        yield loop
