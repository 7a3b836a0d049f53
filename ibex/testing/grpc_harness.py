"""Start the daemon for a test: in-process on the test's Trio run, or as `python -m ibex serve`.

In-process (`running_daemon`) is fast and lets a test reach into `Daemon`
(state, health); clients that block (the stock grpcio stack) must then run in a
worker thread (`in_thread`) so they don't stall the loop serving them. The
subprocess form (`DaemonProcess`) is for what only a real process shows:
signals, drain to exit code 0, start-up refusal with exit code 2, the CLI.
Everything binds loopback on a free port.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest.mock
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import trio

import ibex.service.root
from ibex.assembly.catalog import Catalog
from ibex.assembly.tokens import Tokenizers
from ibex.config import Settings, replace_settings
from ibex.service.daemon import Daemon
from ibex.service.root import load_static, make_daemon
from ibex.testing.samples import AGENT, ORG  # noqa: F401  (re-exported for the gRPC tests)

ROOT = Path(__file__).resolve().parents[2]

SERVICE = "ibex.context.v1.ContextAssemblyService"
T = TypeVar("T")


def free_port() -> int:
    """A loopback port that was free a moment ago (the daemon binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking (grpcio) call off the Trio loop that hosts the in-process daemon."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@dataclass
class RunningDaemon:
    daemon: Daemon
    port: int
    shutdown: trio.Event

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        """A stock grpcio channel; close it (or use `with`) when done."""
        if credentials is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(
            self.target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
        )


def test_settings(**overrides: Any) -> Settings:
    """Defaults suited to loopback tests: port 0, short drain, bundled sample source."""
    base = replace_settings(Settings(), grpc_addr="127.0.0.1:0", drain_grace=5.0)
    return replace_settings(base, **overrides)


test_settings.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


_STATIC: dict[tuple[str | None, str | None, int], tuple[Catalog, Tokenizers]] = {}


def _cached_static(settings: Settings) -> tuple[Catalog, Tokenizers]:
    """`load_static` once per test session: preloading the encodings takes ~0.5 s."""
    key = (settings.catalog_path, settings.tiktoken_dir, settings.token_cache.entries)
    if key not in _STATIC:
        _STATIC[key] = load_static(settings)
    return _STATIC[key]


@contextlib.asynccontextmanager
async def running_daemon(
    settings: Settings | None = None,
    *,
    prepare: Callable[[Daemon], None] | None = None,
    **overrides: Any,
) -> AsyncIterator[RunningDaemon]:
    """`Daemon.serve` in a nursery of the current Trio run; drained on exit. `prepare`
    swaps parts of the daemon (say, its admission policies) before it serves."""
    settings = settings if settings is not None else test_settings(**overrides)
    daemon = make_daemon(settings)
    if prepare is not None:
        prepare(daemon)
    shutdown = trio.Event()
    with unittest.mock.patch.object(ibex.service.root, "load_static", _cached_static):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(daemon.serve, shutdown=shutdown))
            try:
                yield RunningDaemon(daemon, port, shutdown)
            finally:
                shutdown.set()


# -- subprocess ------------------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent's environment minus IBEX_CONTEXT_* and systemd variables, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("IBEX_CONTEXT_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """`python -m ibex ARGS` to completion, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ibex", *args],
        cwd=ROOT,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class DaemonProcess:
    """`python -m ibex serve` on a free loopback port; stderr (JSON log lines) kept in a file."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        host: str = "127.0.0.1",
        preexec_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.port = free_port()
        self.env = {"IBEX_CONTEXT_GRPC_ADDR": f"{host}:{self.port}", **env}
        self.log_path = log_path
        self._log = open(log_path, "w+")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ibex", "serve"],
            cwd=ROOT,
            env=child_env(self.env),
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            preexec_fn=preexec_fn,  # e.g. a lower RLIMIT_NOFILE for the fd-exhaustion tests
        )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stderr(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the port accepts connections; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.stderr[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        raise RuntimeError(f"daemon not ready after {timeout}s: {self.stderr[-2000:]}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def daemon_process(
    env: Mapping[str, str],
    log_path: Path,
    *,
    host: str = "127.0.0.1",
    ready: bool = True,
    preexec_fn: Callable[[], Any] | None = None,
) -> Iterator[DaemonProcess]:
    """A `DaemonProcess` for the block; stopped (SIGTERM, then kill) on exit."""
    proc = DaemonProcess(env, log_path, host, preexec_fn)
    try:
        if ready:
            proc.wait_ready()
        yield proc
    finally:
        proc.stop()


# -- stock grpcio health and reflection clients ----------------------------------------------

# grpcio-health-checking and grpcio-reflection register the same protobuf symbols as
# grpclib's copies (which ibex.service imports), so one process cannot load both. The
# stock clients therefore run in a child process, which is also what a real probe is.
_PROBE = """
import json, sys
import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

target, symbol, method = sys.argv[1:4]
services = sys.argv[4:]
out = {"health": {}}
with grpc.insecure_channel(target) as channel:
    health = health_pb2_grpc.HealthStub(channel)
    for name in services:
        try:
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            out["health"][name] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as exc:
            out["health"][name] = exc.code().name
    db = ProtoReflectionDescriptorDatabase(channel)
    out["services"] = list(db.get_services())
    fdp = db.FindFileContainingSymbol(symbol)
    out["file"] = {
        "name": fdp.name,
        "package": fdp.package,
        "dependency": list(fdp.dependency),
        "services": {s.name: [m.name for m in s.method] for s in fdp.service},
    }
    m = DescriptorPool(db).FindMethodByName(method)
    out["method"] = {
        "input": m.input_type.full_name,
        "output": m.output_type.full_name,
        "input_fields": {f.name: f.number for f in m.input_type.fields},
        "output_fields": {f.name: f.number for f in m.output_type.fields},
        "principal_type": m.input_type.fields_by_name["principal_context"].message_type.full_name,
    }
print(json.dumps(out))
"""


def grpcio_probe(target: str, symbol: str, method: str, *services: str) -> dict[str, Any]:
    """Health (per service) and reflection results from grpcio's own clients, as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, target, symbol, method, *services],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"grpcio probe failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result
