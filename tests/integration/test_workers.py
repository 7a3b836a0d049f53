"""`ibex serve --workers 2`: one port, READY when all are up, a crash survived, drain on SIGTERM."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import trio

from ibex.cli import SAMPLE_AGENT, SAMPLE_ORG
from ibex.config import Settings
from ibex.ops import rolling_reload, worker_process, workers
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc


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


def free_port_run(n: int) -> int:
    """The first of `n` consecutive loopback ports that were all free a moment ago."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no run of {n} free ports found")


@pytest.fixture
def supervisor(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], int, int, socket.socket, Path]]:
    yield from _supervisor(tmp_path, {})


@pytest.fixture
def supervisor_worker_ports(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], int, int, socket.socket, Path, int]]:
    base = free_port_run(2)
    # Shedding on loop lag is not under test; a loaded test machine must not trigger it.
    env = {"IBEX_CONTEXT_WORKER_PORT_BASE": str(base)}
    for started in _supervisor(tmp_path, env):
        yield (*started, base)


def _supervisor(
    tmp_path: Path, extra: dict[str, str]
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
    env.update(extra)
    log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibex", "serve", "--workers", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
        start_new_session=True,  # its own process group: teardown reaches the workers too
    )
    try:
        yield proc, grpc_port, metrics_port, notify, tmp_path / "stderr.log"
    finally:
        # A failed test leaves the supervisor running; killing only it would orphan
        # its workers (still bound to the ports), so kill the whole group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
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
    assert 'ibex_worker_restarts_total{reason="exited"} 1.0' in text.splitlines()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    stderr = log_path.read_text()
    assert '"event":"worker_exited"' in stderr
    assert stderr.count('"event":"stopped"') >= 2


def wait_ready(notify: socket.socket) -> None:
    msg = notify.recv(4096).decode()
    while "READY=1" not in msg.splitlines():
        msg = notify.recv(4096).decode()


def scrape(metrics_port: int) -> str:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    return str(urllib.request.urlopen(url, timeout=5).read().decode())


ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def test_round_robin_over_worker_ports_spreads_calls_over_both_workers(
    supervisor_worker_ports: tuple[subprocess.Popen[str], int, int, socket.socket, Path, int],
) -> None:
    """One grpcio channel, gRPC's round_robin over P, P+1: each worker serves half the calls."""
    proc, port, metrics_port, notify, log_path, base = supervisor_worker_ports
    wait_ready(notify)
    target = f"ipv4:127.0.0.1:{base},127.0.0.1:{base + 1}"
    options = [("grpc.service_config", ROUND_ROBIN), ("grpc.enable_retries", 0)]
    served: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        request = context_pb2.AssembleContextRequest(
            org_id=SAMPLE_ORG, agent_id=SAMPLE_AGENT, model="gpt-4o", query="deploy"
        )
        calls = 40
        for _ in range(calls):
            response, call = stub.AssembleContext.with_call(request, timeout=10)
            assert "<memories nonce=" in response.assembled_context
            trailers = dict(call.trailing_metadata())
            served[trailers["x-ibex-worker"]] += 1
    # Both workers, each a fair share (round robin alternates once both are connected).
    assert set(served) == {"0", "1"}, served
    assert min(served.values()) >= calls * 0.4, served
    # The shared SO_REUSEPORT port still serves, and the workers named their ports.
    assert assemble(port).returncode == 0
    log = log_path.read_text()
    assert f'"own_ports":[{base}]' in log and f'"own_ports":[{base + 1}]' in log
    restarts = [
        line for line in scrape(metrics_port).splitlines()
        if line.startswith("ibex_worker_restarts_total{")
    ]  # fmt: skip
    assert sorted(restarts) == [
        'ibex_worker_restarts_total{reason="exited"} 0.0',
        'ibex_worker_restarts_total{reason="unresponsive"} 0.0',
    ]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_worker_ports_overlapping_the_grpc_port_refuse_to_start(tmp_path: Path) -> None:
    """--workers 3 from base 9100 would take 9100..9102: the gRPC port 9102 is among them."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
    }
    env.update(IBEX_CONTEXT_GRPC_ADDR="127.0.0.1:9102", IBEX_CONTEXT_WORKER_PORT_BASE="9100")
    proc = subprocess.run(
        [sys.executable, "-m", "ibex", "serve", "--workers", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "IBEX_CONTEXT_WORKER_PORT_BASE" in proc.stderr


# A stand-in worker: start-up takes argv[1] seconds, then READY=1 and pings.
FAKE_WORKER = """
import os, socket, sys, time
time.sleep(float(sys.argv[1]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
    s.sendto(b"WATCHDOG=1", os.environ["NOTIFY_SOCKET"])
"""


@contextlib.asynccontextmanager
async def supervising(sup: workers.Supervisor) -> AsyncIterator[workers.Supervisor]:
    """`sup` running, from every worker ready to its stop."""
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(30):
            await sup.all_ready.wait()
        yield sup
        await sup.stop()
        nursery.cancel_scope.cancel()


def reloadable_fake(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str, name: str, value: str
) -> tuple[workers.Supervisor, Path]:
    """A one-slot supervisor of stand-in `script` workers, with an env file holding
    `name=value` that each reload reads again (returned to be rewritten). The stand-ins
    ping every 50 ms; a 1.5 s silence counts as hung (a stalled test process on a
    loaded host is not a hung worker)."""
    monkeypatch.setattr(worker_process, "WORKER_WATCHDOG_USEC", 1_000_000)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    env_file = tmp_path / "fake.env"
    env_file.write_text(f"{name}={value}\n")
    sup = workers.Supervisor(
        Settings(workers=1),
        drain_grace=1.0,
        argv=[sys.executable, "-c", script],
        env_file=env_file,
        file_env={name: value},
    )
    return sup, env_file


async def run_fake(monkeypatch: pytest.MonkeyPatch, start_s: float) -> workers.Supervisor:
    # Pings expected every 0.1 s, so 0.3 s of silence would count as hung.
    monkeypatch.setattr(worker_process, "WORKER_WATCHDOG_USEC", 200_000)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    argv = [sys.executable, "-c", FAKE_WORKER, str(start_s)]
    return workers.Supervisor(Settings(workers=1), drain_grace=1.0, argv=argv)


async def test_slow_start_is_not_mistaken_for_a_hung_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start-up longer than the watchdog's window (a loaded host) is not a hang."""
    sup = await run_fake(monkeypatch, 1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(30):
            await sup.all_ready.wait()
        await trio.sleep(0.5)  # five ping intervals while serving
        assert sup.restart_metric.counts == {"exited": 0, "unresponsive": 0}
        await sup.stop()
        nursery.cancel_scope.cancel()


async def test_worker_never_ready_is_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_process, "WORKER_START_TIMEOUT", 0.5)
    sup = await run_fake(monkeypatch, 3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(30):
            while sup.restart_metric.counts["unresponsive"] < 1:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert not sup.all_ready.is_set()
        await sup.stop()
        nursery.cancel_scope.cancel()


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_workers_drain_and_exit_when_the_supervisor_is_killed(
    supervisor: tuple[subprocess.Popen[str], int, int, socket.socket, Path],
) -> None:
    """SIGKILL leaves the supervisor no time to stop its workers: each notices on its own
    (EOF on the pipe it holds) and drains, instead of serving on with nobody to stop it."""
    proc, _, _, notify, log_path = supervisor
    wait_ready(notify)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    wait_for(lambda: all(_gone(w) for w in workers), 30, "the orphaned workers to exit")
    stderr = log_path.read_text()
    assert stderr.count('"event":"supervisor_gone"') == 2
    assert stderr.count('"event":"stopped"') == 2


async def test_a_worker_outlives_the_thread_that_started_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """trio starts processes from a cached worker thread that retires when idle. A worker
    tied to its parent *thread* (PR_SET_PDEATHSIG) was sent SIGTERM when that thread
    retired, about 10 s after every start; here the thread retires within 0.1 s."""
    monkeypatch.setattr(trio._core._thread_cache, "IDLE_TIMEOUT", 0.1)
    sup = await run_fake(monkeypatch, 0.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(30):
            await sup.all_ready.wait()
        await trio.sleep(1.0)
        assert sup.restart_metric.counts == {"exited": 0, "unresponsive": 0}
        await sup.stop()
        nursery.cancel_scope.cancel()


# A stand-in worker that, with EXPECT_IDLE=1, waits (at most 10 s) to be put at idle
# priority; starts a thread (which inherits its policy), writes the policy it saw to
# $POLICY_DIR/<pid>, then READY=1.
IDLE_WORKER = """
import os, signal, socket, sys, threading, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
end = time.monotonic() + (10 if os.environ["EXPECT_IDLE"] == "1" else 0)
while os.sched_getscheduler(0) != os.SCHED_IDLE and time.monotonic() < end:
    time.sleep(0.01)
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
with open(os.path.join(os.environ["POLICY_DIR"], str(os.getpid())), "w") as f:
    f.write(str(os.sched_getscheduler(0)))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
    s.sendto(b"WATCHDOG=1", os.environ["NOTIFY_SOCKET"])
"""


@pytest.mark.skipif(not worker_process.may_leave_idle(), reason="SCHED_IDLE could not be left")
async def test_a_worker_started_next_to_a_serving_one_starts_at_idle_priority(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A reload's (or a restart's) new worker starts at SCHED_IDLE, taking no CPU a
    serving worker wants; from READY=1 every thread of it is back at SCHED_OTHER. A
    first start, with nothing serving yet, starts at the normal policy."""
    monkeypatch.setattr(rolling_reload, "RELOAD_SETTLE", 0.0)
    monkeypatch.setenv("POLICY_DIR", str(tmp_path))
    sup, env_file = reloadable_fake(monkeypatch, tmp_path, IDLE_WORKER, "EXPECT_IDLE", "0")
    async with supervising(sup):
        first = sup.workers[0].current
        assert first is not None and first.pid is not None
        assert int((tmp_path / str(first.pid)).read_text()) == os.SCHED_OTHER
        env_file.write_text("EXPECT_IDLE=1\n")
        with trio.fail_after(30):
            assert await sup.reload() is True
        run = sup.workers[0].current
        assert run is not None and run.pid is not None and run is not first
        assert int((tmp_path / str(run.pid)).read_text()) == os.SCHED_IDLE
        tids = [int(t) for t in os.listdir(f"/proc/{run.pid}/task")]
        assert len(tids) == 2
        assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_OTHER] * 2
