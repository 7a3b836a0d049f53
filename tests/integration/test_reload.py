"""SIGHUP to `ibex serve --workers 2 --env-file F`: every worker replaced, no call lost.

Real supervisor and worker processes, a real grpcio client balancing with
round_robin over the per-worker ports (IBEX_CONTEXT_WORKER_PORT_BASE), the
answers from the bundled sample source. Every wait is on a condition (a log
line, the worker pids) with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import trio

from ibex.cli import SAMPLE_AGENT, SAMPLE_ORG
from ibex.config import Settings
from ibex.ops import handover, rolling_reload, worker_process, workers
from ibex.sources.directive_envelope import directive_key
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.redis_server import RedisServer
from tests.integration.test_workers import (
    ROUND_ROBIN,
    children,
    free_port,
    free_port_run,
    reloadable_fake,
    scrape,
    supervising,
    wait_ready,
)

DEADLINE = 120.0  # seconds any one wait may take on a loaded machine
IN_FLIGHT = 4  # calls kept open at once, so some are always in flight during a drain
GENEROUS = ("TIMEOUT", "DEADLINE_MS", "DIRECTIVE_TIMEOUT_MS", "HOT_TIMEOUT_MS", "COLD_TIMEOUT_MS")


@dataclass
class Supervised:
    proc: subprocess.Popen[str]
    base: int
    metrics_port: int
    env_file: Path
    log_path: Path

    def log(self) -> list[dict[str, object]]:
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def events(self, name: str) -> list[dict[str, object]]:
        return [e for e in self.log() if e.get("event") == name]

    def workers(self) -> set[int]:
        return children(self.proc.pid)


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[Supervised]:
    base, metrics_port = free_port_run(2), free_port()
    env_file = tmp_path / "context.env"
    env_file.write_text("# settings a reload applies\nIBEX_CONTEXT_LOG_LEVEL=info\n")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(DEADLINE)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{free_port()}",
        IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{metrics_port}",
        IBEX_CONTEXT_WORKER_PORT_BASE=str(base),
        IBEX_CONTEXT_DRAIN_GRACE="5s",
        NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
    )
    # Branch budgets far above a loaded machine's stalls (a worker starting takes a
    # core for seconds): an answer is degraded here only when a worker was not able
    # to serve it, which is what a reload must not cause.
    env.update({f"IBEX_CONTEXT_{name}": "2s" for name in GENEROUS})
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ibex", "serve", "--workers", "2", "--env-file", str(env_file)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
            start_new_session=True,  # its own process group: teardown reaches the workers
        )
        try:
            wait_ready(notify)
            yield Supervised(proc, base, metrics_port, env_file, log_path)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            notify.close()


def wait_until(predicate: Callable[[], bool], what: str, tick: Callable[[], None]) -> None:
    """Call `tick` (one round of client calls) until `predicate` holds, within DEADLINE."""
    end = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        tick()


@dataclass
class Client:
    """round_robin over both worker ports, IN_FLIGHT calls at a time; records each answer."""

    base: int
    ok: list[str] = field(default_factory=list)  # the degradation level of each answer
    failed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        target = f"ipv4:127.0.0.1:{self.base},127.0.0.1:{self.base + 1}"
        options = [("grpc.service_config", ROUND_ROBIN), ("grpc.enable_retries", 0)]
        self.channel = grpc.insecure_channel(target, options=options)
        grpc.channel_ready_future(self.channel).result(timeout=DEADLINE)
        self.stub = context_pb2_grpc.ContextAssemblyServiceStub(self.channel)
        self.request = context_pb2.AssembleContextRequest(
            org_id=SAMPLE_ORG, agent_id=SAMPLE_AGENT, model="gpt-4o", query="deploy"
        )

    def round(self) -> None:
        futures: list[Future[context_pb2.AssembleContextResponse]] = [
            self.stub.AssembleContext.future(self.request, timeout=10) for _ in range(IN_FLIGHT)
        ]
        for f in futures:
            try:
                self.ok.append(f.result().degradation_level)
            except grpc.RpcError as exc:
                self.failed.append(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]

    def calls(self, n: int) -> None:
        for _ in range(n // IN_FLIGHT):
            self.round()

    def close(self) -> None:
        self.channel.close()


def degraded_share(levels: list[str]) -> float:
    return sum(level != "L0" for level in levels) / max(1, len(levels))


def reloads(metrics_port: int) -> dict[str, float]:
    out = {}
    for line in scrape(metrics_port).splitlines():
        if line.startswith("ibex_worker_reloads_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.split()[-1])
    return out


def test_sighup_replaces_every_worker_while_calls_keep_being_answered(
    supervised: Supervised,
) -> None:
    old = supervised.workers()
    assert len(old) == 2
    client = Client(supervised.base)
    try:
        client.calls(40)
        before = list(client.ok)
        supervised.env_file.write_text("IBEX_CONTEXT_LOG_LEVEL=info\nIBEX_CONTEXT_HOT_LIMIT=7\n")
        os.kill(supervised.proc.pid, signal.SIGHUP)
        over = ("reload_done", "reload_failed", "reload_rejected")
        wait_until(lambda: any(map(supervised.events, over)), "the reload's end", client.round)
        assert supervised.events("reload_done"), supervised.log_path.read_text()[-3000:]
        during = client.ok[len(before) :]
        client.calls(40)  # and the new workers serve on
    finally:
        client.close()

    assert client.failed == []
    assert len(client.ok) >= 40 + len(during) + 40
    new = supervised.workers()
    assert len(new) == 2 and new.isdisjoint(old)  # every worker pid replaced
    assert degraded_share(client.ok[len(before) :]) <= degraded_share(before)
    events = [e["event"] for e in supervised.log()]
    story = [e for e in events if e in ("reload_started", "worker_replaced", "reload_done")]
    assert story == ["reload_started", "worker_replaced", "worker_replaced", "reload_done"]
    replaced = supervised.events("worker_replaced")
    assert {e["old_pid"] for e in replaced} == old
    assert {e["pid"] for e in replaced} == new
    assert [e["worker"] for e in replaced] == [0, 1]  # one slot at a time, in order
    # The new workers run the file's new settings; both still own their ports.
    serving = supervised.events("serving")[-2:]
    assert sorted(e["own_ports"] for e in serving) == [  # type: ignore[type-var]
        [supervised.base],
        [supervised.base + 1],
    ]
    assert reloads(supervised.metrics_port) == {"done": 1.0, "failed": 0.0, "rejected": 0.0}
    assert "worker_exited" not in events  # a replaced worker is no crash


def test_invalid_env_file_on_sighup_keeps_the_old_workers(supervised: Supervised) -> None:
    old = supervised.workers()
    client = Client(supervised.base)
    try:
        supervised.env_file.write_text("IBEX_CONTEXT_MAX_IN_FLIGHT=lots\n")
        os.kill(supervised.proc.pid, signal.SIGHUP)
        wait_until(lambda: bool(supervised.events("reload_rejected")), "rejection", client.round)
        client.calls(20)
    finally:
        client.close()
    (rejected,) = supervised.events("reload_rejected")
    assert "IBEX_CONTEXT_MAX_IN_FLIGHT" in str(rejected["error"])
    assert rejected["level"] == "error"
    assert supervised.workers() == old
    assert client.failed == [] and len(client.ok) >= 20
    assert not supervised.events("worker_started")[2:]  # no worker was started for it
    assert reloads(supervised.metrics_port) == {"done": 0.0, "failed": 0.0, "rejected": 1.0}


def test_a_new_worker_that_cannot_start_leaves_the_old_one_serving(
    supervised: Supervised, tmp_path: Path
) -> None:
    """Settings that load but stop a worker's start (a catalog file that is not JSON): the
    reload ends at the first slot, whose old worker never stopped serving."""
    old = supervised.workers()
    client = Client(supervised.base)
    try:
        broken = tmp_path / "catalog.json"
        broken.write_text("not json")
        supervised.env_file.write_text(f"IBEX_CONTEXT_CATALOG_PATH={broken}\n")
        os.kill(supervised.proc.pid, signal.SIGHUP)
        wait_until(lambda: bool(supervised.events("reload_failed")), "reload_failed", client.round)
        client.calls(20)
    finally:
        client.close()
    (failed,) = supervised.events("reload_failed")
    assert (failed["worker"], failed["replaced"]) == (0, 0)
    assert supervised.workers() == old
    assert client.failed == []
    assert not supervised.events("worker_replaced")
    assert reloads(supervised.metrics_port) == {"done": 0.0, "failed": 1.0, "rejected": 0.0}
    # The crash of a reload's worker is not a restart of a serving one.
    assert 'ibex_worker_restarts_total{reason="exited"} 0.0' in scrape(supervised.metrics_port)


def test_sighups_during_a_reload_make_one_more_reload_after_it(supervised: Supervised) -> None:
    client = Client(supervised.base)
    try:
        os.kill(supervised.proc.pid, signal.SIGHUP)
        wait_until(lambda: bool(supervised.events("reload_started")), "a reload", client.round)
        # One at a time: signals sent together may reach the process as one.
        os.kill(supervised.proc.pid, signal.SIGHUP)
        wait_until(lambda: bool(supervised.events("reload_queued")), "queued", client.round)
        os.kill(supervised.proc.pid, signal.SIGHUP)
        wait_until(lambda: bool(supervised.events("reload_coalesced")), "coalesced", client.round)
        wait_until(lambda: len(supervised.events("reload_done")) == 2, "two reloads", client.round)
        after_first = {e["pid"] for e in supervised.events("worker_replaced")[:2]}
        client.calls(20)
    finally:
        client.close()
    assert client.failed == []
    story = [
        e["event"]
        for e in supervised.log()
        if e["event"] in ("reload_started", "worker_replaced", "reload_done")
    ]
    one = ["reload_started", "worker_replaced", "worker_replaced", "reload_done"]
    assert story == one + one  # queued and coalesced, never interleaved
    assert len(supervised.events("reload_queued")) == 1
    assert len(supervised.events("reload_coalesced")) == 1
    final = supervised.workers()
    assert len(final) == 2 and final.isdisjoint(after_first)


@contextlib.contextmanager
def serving_alone(
    cmd: list[str], env: dict[str, str], log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon process serving on its own, from its `serving` line until it exits 0
    on SIGTERM (killed instead if the block fails)."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stderr=log, stdout=subprocess.DEVNULL)
        try:
            wait_logged(proc, log_path, "serving")
            yield proc
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def wait_logged(proc: subprocess.Popen[bytes], log_path: Path, event: str) -> None:
    end = time.monotonic() + DEADLINE
    while f'"event":"{event}"' not in log_path.read_text():
        assert proc.poll() is None and time.monotonic() < end, log_path.read_text()
        time.sleep(0.05)


def assemble_once(port: int, org: str, agent: str) -> context_pb2.AssembleContextResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        request = context_pb2.AssembleContextRequest(
            org_id=org, agent_id=agent, model="gpt-4o", query="deploy"
        )
        answer: context_pb2.AssembleContextResponse = stub.AssembleContext(request, timeout=10)
        return answer


def test_sighup_to_a_process_serving_alone_is_logged_not_fatal(tmp_path: Path) -> None:
    """Without the supervisor (one worker, no metrics, no env file) SIGHUP's default
    action would end the process: it says a reload needs the supervisor and serves on."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    port = free_port()
    env["IBEX_CONTEXT_GRPC_ADDR"] = f"127.0.0.1:{port}"
    log_path = tmp_path / "stderr.log"
    with serving_alone([sys.executable, "-m", "ibex", "serve"], env, log_path) as proc:
        proc.send_signal(signal.SIGHUP)
        wait_logged(proc, log_path, "reload_needs_supervisor")
        assert assemble_once(port, SAMPLE_ORG, SAMPLE_AGENT).degradation_level == "L0"


# A stand-in worker: READY=1 after $FAKE_START_S seconds, then pings; SIGTERM ends it.
FAKE_WORKER = """
import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(float(os.environ["FAKE_START_S"]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
    s.sendto(b"WATCHDOG=1", os.environ["NOTIFY_SOCKET"])
"""


async def test_a_reload_whose_worker_is_never_ready_keeps_the_old_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The new worker of a slot hangs in start-up: after WORKER_START_TIMEOUT it is killed,
    the old one serves on and no restart is counted; the next reload, once fixed, replaces."""
    sup, env_file = reloadable_fake(monkeypatch, tmp_path, FAKE_WORKER, "FAKE_START_S", "0")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(30):
            await sup.all_ready.wait()
        first = sup.workers[0].current
        assert first is not None and first.pid is not None

        # Only the hanging worker gets 1 s to start; the others have the usual time.
        monkeypatch.setattr(worker_process, "WORKER_START_TIMEOUT", 1.0)
        env_file.write_text("FAKE_START_S=3600\n")
        with trio.fail_after(30):
            assert await sup.reload() is False
        assert sup.workers[0].current is first and first.returncode is None
        assert sup.reload_metric.counts == {"done": 0, "failed": 1, "rejected": 0}

        env_file.write_text("FAKE_START_S=0\n")
        # On a loaded machine a process start alone can take longer than 1 s.
        monkeypatch.setattr(worker_process, "WORKER_START_TIMEOUT", 60.0)
        with trio.fail_after(90):
            assert await sup.reload() is True
        second = sup.workers[0].current
        assert second is not None and second.pid != first.pid
        assert first.exited.is_set() and first.returncode == 0  # drained on SIGTERM
        assert sup.reload_metric.counts == {"done": 1, "failed": 1, "rejected": 0}
        assert sup.restart_metric.counts == {"exited": 0, "unresponsive": 0}
        await sup.stop()
        nursery.cancel_scope.cancel()


# A stand-in worker that reports the agents its cache served last and writes the agents
# it was handed (its IBEX_WORKER_DIRECTIVES) to $HANDED_DIR/<pid>.
REPORTING_WORKER = """
import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(os.path.join(os.environ["HANDED_DIR"], str(os.getpid())), "w") as f:
    f.write(os.environ.get("IBEX_WORKER_DIRECTIVES", ""))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
    report = b"WATCHDOG=1\\nX_IBEX_DIRECTIVES=" + os.environ["REPORT"].encode()
    s.sendto(report, os.environ["NOTIFY_SOCKET"])
"""
ORG_X = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
AGENT_X = "7c9e6679-7425-40de-944b-e07fc1f90ae7"


async def test_a_reloads_new_worker_is_handed_the_agents_the_workers_served(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each worker's report (notify field X_IBEX_DIRECTIVES) reaches the next worker's
    environment (IBEX_WORKER_DIRECTIVES), merged over the live workers, malformed keys
    dropped, at most handover.MAX_KEYS and handover.MAX_BYTES."""
    monkeypatch.setattr(worker_process, "WORKER_WATCHDOG_USEC", 200_000)
    monkeypatch.setattr(rolling_reload, "RELOAD_SETTLE", 0.0)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    handed = tmp_path / "handed"
    handed.mkdir()
    many = " ".join(f"{uuid.UUID(int=2 * i)}/{uuid.UUID(int=2 * i + 1)}" for i in range(100))
    report = f"{ORG_X}/{AGENT_X} not-a-key bad/id/with/slashes {'x' * 200}/y {many}"
    monkeypatch.setenv("HANDED_DIR", str(handed))
    monkeypatch.setenv("REPORT", report)
    sup = workers.Supervisor(
        Settings(workers=2), drain_grace=1.0, argv=[sys.executable, "-c", REPORTING_WORKER]
    )
    async with supervising(sup):
        with trio.fail_after(30):
            while not all(w.current and w.current.directives for w in sup.workers):  # noqa: ASYNC110
                await trio.sleep(0.05)
        first = {w.current.pid for w in sup.workers if w.current}
        assert all((handed / str(pid)).read_text() == "" for pid in first)  # nothing to hand

        with trio.fail_after(30):
            assert await sup.reload() is True
        second = [w.current.pid for w in sup.workers if w.current]
        assert not set(second) & first
        for pid in second:
            keys = handover.decode((handed / str(pid)).read_text())
            assert keys[0] == (ORG_X, AGENT_X)  # the latest first
            assert (str(uuid.UUID(int=0)), str(uuid.UUID(int=1))) in keys
            assert all(len(org) == len(agent) == 36 for org, agent in keys)
            assert len(keys) == handover.MAX_KEYS
            assert len((handed / str(pid)).read_text()) <= handover.MAX_BYTES


def test_a_worker_handed_agents_reads_their_directives_before_serving(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """`ibex serve --worker` with IBEX_WORKER_DIRECTIVES (as a reload starts one): its first
    call for a handed agent is answered from its directive cache (detail `cache`), no
    Redis read on the call's path."""
    envelope = {"v": 1, "content": "Answer in haiku.", "injection_mode": "system_first"}
    redis_server.set(directive_key(ORG_X, AGENT_X), json.dumps(envelope))
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(
        IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{port}",
        IBEX_CONTEXT_REDIS_URL=redis_server.url,
        IBEX_CONTEXT_LOG_LEVEL="info",
        IBEX_CONTEXT_DIRECTIVE_CACHE_TTL="10m",
        IBEX_WORKER_DIRECTIVES=f"{ORG_X}/{AGENT_X} {uuid.UUID(int=1)}/{uuid.UUID(int=2)} {ORG_X}/x",
    )
    env.update({f"IBEX_CONTEXT_{name}": "2s" for name in GENEROUS})
    log_path = tmp_path / "stderr.log"
    cmd = [sys.executable, "-m", "ibex", "serve", "--worker", "--worker-index", "0"]
    with serving_alone(cmd, env, log_path):
        first = assemble_once(port, ORG_X, AGENT_X)
    (directive,) = [b for b in first.branches if b.source == "directive"]
    assert (directive.status, directive.detail) == ("success", "cache")
    primed = [json.loads(x) for x in log_path.read_text().splitlines() if "directives_primed" in x]
    # The key that is no UUID pair is dropped; the unknown agent is cached as having none.
    assert [(p["agents"], p["cached"]) for p in primed] == [(2, 2)]
