"""Directives from Redis Sentinel and Redis Cluster, real processes on loopback, under traffic.

Many tenants' directives are read concurrently while some reads are cut off by
tiny cancel scopes (a reply left mid-wire on a reused connection would be read
by the next tenant). Through a Sentinel failover, a cluster resharding and a
failed cluster master, no read ever returns another tenant's directive, and the
branch recovers by itself.
"""

from __future__ import annotations

import collections
import gc
import random
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import trio
import trio.lowlevel
import trio_asyncio

from ibex.config import load_settings
from ibex.service.root import redis_directive_source
from ibex.sources.base import SourceError
from ibex.sources.redis_directive import (
    RedisDirectiveSource,
    _CloseOnInterrupt,
    _GuardedConnection,
    directive_key,
)
from ibex.testing.redis_server import RedisServer, _free_port
from ibex.testing.redis_topology import MASTER_NAME, ClusterSetup, SentinelSetup, admin, wait_until

TENANTS = [
    (str(uuid.UUID(int=0x1000 + i, version=4)), str(uuid.UUID(int=0x2000 + i, version=4)))
    for i in range(48)
]
KEYS = [directive_key(org, agent) for org, agent in TENANTS]
READERS = 8
# Loopback on a loaded 2-core machine: the source's 0.1 s backstops are for production.
TIMEOUTS = {"connect_timeout": 2.0, "socket_timeout": 2.0}
# A liveness guard, not a speed assertion: "recovers by itself within a few seconds".
RECOVERY = 20.0


def content(i: int) -> str:
    # Every fourth directive spans many TCP segments, so cancellations land mid-reply.
    filler = "x" * (60_000 if i % 4 == 0 else 40)
    return f"directive of tenant {i}: {filler}"


def envelope(i: int) -> str:
    return msgspec.json.encode({"v": 1, "content": content(i)}).decode()


@dataclass
class Tally:
    ok: collections.Counter[int] = field(default_factory=collections.Counter)
    errors: collections.Counter[int] = field(default_factory=collections.Counter)
    cancelled: int = 0
    wrong: list[tuple[int, str]] = field(default_factory=list)

    @property
    def total_ok(self) -> int:
        return sum(self.ok.values())

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


async def reader(source: RedisDirectiveSource, tally: Tally, tenants: list[int], seed: int) -> None:
    rng = random.Random(seed)
    while True:
        i = rng.choice(tenants)
        budget = rng.choice([None, None, None, 0.0002, 0.001, 0.003])
        with trio.move_on_after(budget or 30.0) as scope:
            try:
                got = await source.get_directive(*TENANTS[i])
            except SourceError:
                tally.errors[i] += 1
                await trio.sleep(0.002)
                continue
        if scope.cancelled_caught:
            tally.cancelled += 1
            continue
        if got is None or got.content != content(i):
            tally.wrong.append((i, "<missing>" if got is None else got.content[:40]))
        else:
            tally.ok[i] += 1
        await trio.lowlevel.checkpoint()


async def until(predicate: Callable[[], bool], tally: Tally, what: str) -> None:
    """Poll the readers' tally (they update it between reads) until `predicate` holds."""
    with trio.move_on_after(RECOVERY):
        while not predicate():  # noqa: ASYNC110  (a tally, not an event)
            await trio.sleep(0.01)
        return
    raise AssertionError(
        f"no {what} within {RECOVERY}s: ok={tally.total_ok} errors={dict(tally.errors)} "
        f"cancelled={tally.cancelled} wrong={tally.wrong[:3]}"
    )


async def more_ok(tally: Tally, n: int, what: str) -> None:
    target = tally.total_ok + n
    await until(lambda: tally.total_ok >= target, tally, what)


# -- Sentinel ----------------------------------------------------------------------------------


async def test_sentinel_failover_during_traffic(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path)
    try:
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.set, key, envelope(i))
        source = RedisDirectiveSource.sentinel(setup.sentinels, MASTER_NAME, **TIMEOUTS)
        tally = Tally()
        try:
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, tally, list(range(len(TENANTS))), k)
                await more_ok(tally, 100, "answers before the failover")

                old = setup.master
                await trio.to_thread.run_sync(setup.failover)  # during traffic
                # The demoted master now replicates from the promoted one; kill it, so
                # only the new master (found through the sentinels) can answer.
                await trio.to_thread.run_sync(
                    wait_until,
                    lambda: admin(old.port).role()[0] == "slave",
                    "the old master to become a replica",
                )
                old.kill()
                await more_ok(tally, 100, "recovery after the failover")

                steady_errors = tally.total_errors
                await more_ok(tally, 300, "steady answers after the failover")
                assert tally.total_errors == steady_errors
                nursery.cancel_scope.cancel()
        finally:
            await source.aclose()
        assert setup.master_port() == setup.replica.port
        assert tally.wrong == []
        assert tally.cancelled > 0  # the cancellation path was exercised
    finally:
        setup.stop()


async def test_sentinel_passwords_and_db_from_the_settings(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """REDIS_URL gives the data nodes' password and db (its host is ignored); the
    sentinels get their own password."""
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path, "data-pw", "sentinel-pw")
    try:
        await trio.to_thread.run_sync(setup.set, KEYS[1], envelope(1), 3)
        url = "redis://:data-pw@192.0.2.1:1/3"  # TEST-NET host: never dialled

        async def read(**kw: Any) -> str | None:
            source = RedisDirectiveSource.sentinel(setup.sentinels, MASTER_NAME, **TIMEOUTS, **kw)
            try:
                got = await source.get_directive(*TENANTS[1])
                return None if got is None else got.content
            finally:
                await source.aclose()

        assert await read(url=url, sentinel_password="sentinel-pw") == content(1)
        # The same through the settings and the composition root.
        settings = load_settings(
            {
                "IBEX_CONTEXT_REDIS_SENTINELS": ",".join(f"{h}:{p}" for h, p in setup.sentinels),
                "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": MASTER_NAME,
                "IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
                "IBEX_CONTEXT_REDIS_URL": url,
            }
        )
        source, kind = redis_directive_source(settings)
        try:
            got = await source.get_directive(*TENANTS[1])
            assert kind == "redis-sentinel" and got is not None and got.content == content(1)
        finally:
            await source.aclose()
        # db 0 of the same master has no such key: the db came from the URL.
        assert await read(url=url.replace("/3", "/0"), sentinel_password="sentinel-pw") is None
        for wrong in (
            {"url": url},  # the sentinels refuse to name the master
            {"url": url.replace("data-pw", "nope"), "sentinel_password": "sentinel-pw"},
        ):
            with pytest.raises(SourceError):
                await read(**wrong)
    finally:
        setup.stop()


async def fake_sentinel(
    received: list[bytes], *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A plain TCP listener posing as a sentinel: records what each client sends first."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        with trio.move_on_after(1.0):
            while len(data) < 4096 and (chunk := await stream.receive_some(4096)):
                data += chunk
                if b"\r\n" in data and not data.startswith(b"\x16"):
                    break  # a whole RESP line in clear is enough to judge
        received.append(data)
        await stream.aclose()

    await trio.serve_listeners(handle, listeners)


@pytest.mark.parametrize("scheme", ["rediss", "redis"])
async def test_sentinels_are_asked_over_tls_when_the_data_nodes_are(
    scheme: str, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """With a `rediss://` URL the sentinel connection starts with a TLS handshake: the
    sentinel password never crosses the wire in clear. (With `redis://` it does: the
    fake sentinel would have seen it, which shows the check can fail.)"""
    received: list[bytes] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(fake_sentinel, received)
        source = RedisDirectiveSource.sentinel(
            [("127.0.0.1", port)],
            MASTER_NAME,
            url=f"{scheme}://:data-pw@192.0.2.1:1/0",
            sentinel_password="sentinel-secret",
            **TIMEOUTS,
        )
        try:
            with pytest.raises(SourceError):
                await source.get_directive(*TENANTS[0])
        finally:
            await source.aclose()
        nursery.cancel_scope.cancel()
    assert received
    if scheme == "rediss":
        assert all(r.startswith(b"\x16\x03") for r in received)  # TLS handshake records
        assert not any(b"sentinel-secret" in r or b"AUTH" in r for r in received)
    else:
        assert any(b"AUTH" in r and b"sentinel-secret" in r for r in received)


def start_tls_sentinel(server: RedisServer, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """One sentinel on a TLS port only (with the server's certificate), password
    `sentinel-pw`, monitoring `server`'s TLS port over TLS; returns once it names it."""
    home = tmp_path / "tls-sentinel"
    home.mkdir()
    port = _free_port()
    tls = server.workdir
    (home / "sentinel.conf").write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\n"
        f'dir "{home}"\nlogfile "{home / "sentinel.log"}"\n'
        f"tls-cert-file {tls / 'server.pem'}\ntls-key-file {tls / 'server.key'}\n"
        f"tls-ca-cert-file {server.ca_path}\ntls-auth-clients no\n"
        "tls-replication yes\nrequirepass sentinel-pw\n"
        f"sentinel monitor {MASTER_NAME} 127.0.0.1 {server.tls_port} 1\n"
    )
    proc = subprocess.Popen(
        [server.executable, str(home / "sentinel.conf"), "--sentinel"], stdin=subprocess.DEVNULL
    )

    def names_the_master() -> bool:
        client = redis.Redis(
            "127.0.0.1", port, password="sentinel-pw", ssl=True,
            ssl_ca_certs=str(server.ca_path), socket_timeout=2,
        )  # fmt: skip
        try:
            return client.sentinel_get_master_addr_by_name(MASTER_NAME) is not None
        finally:
            client.close()

    try:
        wait_until(names_the_master, "the TLS sentinel")
    except BaseException:
        proc.kill()
        proc.wait(timeout=5)
        raise
    return proc, port


async def test_a_tls_only_sentinel_names_a_tls_master(
    redis_tls_server: RedisServer, tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """A real sentinel listening on TLS only (`port 0`), with a password, monitoring the
    master's TLS port: the URL an operator writes in REDIS_URL (`rediss://` with the CA as a
    query option) reaches the directive; without the CA the sentinel is not trusted."""
    redis_tls_server.set(KEYS[2], envelope(2))
    proc, port = await trio.to_thread.run_sync(start_tls_sentinel, redis_tls_server, tmp_path)
    try:
        # As an operator writes it: the CA as a URL option. The timeouts are widened
        # for TLS handshakes on a loaded machine.
        url = f"rediss://192.0.2.1:1/0?ssl_ca_certs={redis_tls_server.ca_path}"
        source = RedisDirectiveSource.sentinel(
            [("127.0.0.1", port)],
            MASTER_NAME,
            url=url,
            sentinel_password="sentinel-pw",
            connect_timeout=5.0,
            socket_timeout=5.0,
        )
        untrusted = RedisDirectiveSource.sentinel(
            [("127.0.0.1", port)],
            MASTER_NAME,
            url="rediss://192.0.2.1:1/0",
            sentinel_password="sentinel-pw",
            connect_timeout=5.0,
            socket_timeout=5.0,
        )
        try:
            got = await source.get_directive(*TENANTS[2])
            assert got is not None and got.content == content(2)
            with pytest.raises(SourceError, match=r"master|connection"):
                await untrusted.get_directive(*TENANTS[2])
        finally:
            await source.aclose()
            await untrusted.aclose()
    finally:
        proc.kill()
        proc.wait(timeout=5)


# -- Cluster -----------------------------------------------------------------------------------


@pytest.mark.slow  # ~20-40 s: cluster creation, a 1000-slot resharding, a node failure
async def test_cluster_tenants_resharding_and_a_failed_master(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path)
    try:
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.client.set, key, envelope(i))
        owners = await trio.to_thread.run_sync(setup.owners, KEYS)
        assert len({n.port for n in owners.values()}) == 3  # keys on every master
        source = RedisDirectiveSource.cluster(setup.seed_url, **TIMEOUTS)
        everyone = list(range(len(TENANTS)))
        tally = Tally()
        try:
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, tally, everyone, k)
                await more_ok(tally, 200, "answers from the cluster")
                # Node connections are the guarded kind (the cancel-safety of this module).
                cluster = source._cluster
                assert cluster is not None
                conns = [c for n in cluster.get_nodes() for c in n._connections]
                assert conns and all(isinstance(c, _CloseOnInterrupt) for c in conns)

                # Resharding during traffic: MOVED and ASK, keys migrating under the reads.
                a, b, c = setup.nodes
                await trio.to_thread.run_sync(setup.reshard, a, b, 1000)
                await more_ok(tally, 200, "answers after the resharding")
                steady_errors = tally.total_errors
                await more_ok(tally, 300, "steady answers after the resharding")
                assert tally.total_errors == steady_errors
                nursery.cancel_scope.cancel()

            # A failed master (no replica): its tenants get errors, everyone else answers.
            owners = await trio.to_thread.run_sync(setup.owners, KEYS)
            victims = [i for i, key in enumerate(KEYS) if owners[key] is c]
            healthy = [i for i in everyone if i not in victims]
            assert victims and healthy
            await trio.to_thread.run_sync(setup.kill, c)
            during = Tally()
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(reader, source, during, everyone, 100 + k)
                await until(
                    lambda: all(during.ok[i] >= 2 for i in healthy), during, "healthy answers"
                )
                mark = {i: during.errors[i] for i in healthy}
                await more_ok(during, 300, "steady healthy answers")
                nursery.cancel_scope.cancel()
            # Healthy tenants recovered and stay served; the victims never got an answer.
            assert {i: during.errors[i] for i in healthy} == mark
            assert all(during.ok[i] == 0 for i in victims)
            assert sum(during.errors[i] for i in victims) > 0
            tally.wrong += during.wrong
        finally:
            await source.aclose()
        assert tally.wrong == []
        assert tally.cancelled > 0
    finally:
        setup.stop()


async def test_guarded_connection_closes_on_a_cancelled_read_without_redis_py_help(
    redis_server: RedisServer, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """The cluster's connection class closes a connection whose reply was cut off,
    even when redis-py's own close-on-error is turned off for the read."""
    redis_server.set(KEYS[0], envelope(0))
    conn = _GuardedConnection(host="127.0.0.1", port=redis_server.port, socket_timeout=5)

    async def get_cut_off() -> None:
        await conn.send_command("GET", KEYS[0])
        await conn.read_response(disable_decoding=True, disconnect_on_error=False)

    await trio_asyncio.aio_as_trio(conn.connect)()
    async with trio.open_nursery() as nursery:
        await nursery.start(redis_server.debug_sleep, 0.3)
        with trio.move_on_after(0.05) as scope:
            await trio_asyncio.aio_as_trio(get_cut_off)()
    assert scope.cancelled_caught
    assert not conn.is_connected  # the unread reply went with the socket


# The directive branch's cancel scope, widened from 5 ms for a loaded 2-core machine:
# the mechanism, a caller's deadline cutting a GET off, is the same.
BRANCH = 0.1
# From this long after a master stops, every read of a healthy master's key succeeds.
SETTLE = 3.0
# How long reads go on after the stop.
WATCH = 6.5
# A gap this long between two wake-ups of a task that sleeps 2 ms means the process
# itself did not run (other tenants of the machine): reads spanning it prove nothing.
STALL = 0.03


@dataclass
class Read:
    start: float
    end: float
    tenant: int
    outcome: str  # "ok", "timeout", "error" or "wrong"


async def branch_reader(source: RedisDirectiveSource, reads: list[Read], seed: int) -> None:
    """One read at a time, each under the branch's cancel scope, as the daemon does them."""
    rng = random.Random(seed)
    while True:
        i = rng.randrange(len(TENANTS))
        start = trio.current_time()
        with trio.move_on_after(BRANCH) as scope:
            try:
                got = await source.get_directive(*TENANTS[i])
                outcome = "ok" if got is not None and got.content == content(i) else "wrong"
            except SourceError:
                outcome = "error"
        if scope.cancelled_caught:
            outcome = "timeout"
        reads.append(Read(start, trio.current_time(), i, outcome))
        await trio.sleep(0.01)


async def stall_watch(stalls: list[tuple[float, float]]) -> None:
    while True:
        before = trio.current_time()
        await trio.sleep(0.002)
        if (after := trio.current_time()) - before > STALL:
            stalls.append((before, after))


async def test_a_stopped_cluster_master_fails_only_its_own_keys(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """Three masters, no replicas; the seed master is stopped under traffic (SIGSTOP:
    connections hang, the harder case; a killed master refuses at once). Reads of keys
    on the two others keep succeeding: from SETTLE seconds after the stop, every one of
    them does. Reads of the dead master's keys end within their branch as errors or
    timeouts, never as answers."""
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path)
    try:
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.client.set, key, envelope(i))
        owners = await trio.to_thread.run_sync(setup.owners, KEYS)
        dead = setup.nodes[0]  # the seed node the source was built from
        victims = {i for i, key in enumerate(KEYS) if owners[key] is dead}
        assert victims and len(victims) < len(KEYS)
        source = RedisDirectiveSource.cluster(setup.seed_url, **TIMEOUTS)
        reads: list[Read] = []
        stalls: list[tuple[float, float]] = []
        # A full collection of this test process's heap (pytest's, mostly) holds the loop
        # for hundreds of milliseconds on a loaded 2-core machine.
        gc.disable()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stall_watch, stalls)
                for k in range(READERS):
                    nursery.start_soon(branch_reader, source, reads, 200 + k)
                with trio.fail_after(RECOVERY):  # warmed up: every node has served reads
                    while sum(r.outcome == "ok" for r in reads) < 50:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                dead.pause()
                stopped = trio.current_time()
                await trio.sleep(WATCH)
                nursery.cancel_scope.cancel()
        finally:
            gc.enable()
            dead.resume()
            await source.aclose()

        def spans_a_stall(r: Read) -> bool:
            return any(a < r.end and b > r.start for a, b in stalls)

        healthy_late = [r for r in reads if r.tenant not in victims and r.start >= stopped + SETTLE]
        judged = [r for r in healthy_late if not spans_a_stall(r)]
        assert len(judged) >= 50 and len(judged) >= 0.75 * len(healthy_late), (
            f"{len(judged)} of {len(healthy_late)} reads clear of {len(stalls)} process stalls"
        )
        failed = [(round(r.end - stopped, 2), r.outcome) for r in judged if r.outcome != "ok"]
        assert not failed, f"{len(failed)} of {len(judged)} failed: {failed}"
        victim_reads = [r for r in reads if r.tenant in victims and r.start > stopped]
        assert victim_reads and all(r.outcome in ("error", "timeout") for r in victim_reads)
        assert not [r for r in reads if r.outcome == "wrong"]
    finally:
        setup.stop()


@pytest.mark.slow  # ~20-30 s: six nodes, a failover
async def test_a_stopped_master_s_keys_come_back_once_its_replica_is_promoted(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """Refreshes run off the request path, asked for by the GETs a stopped master
    leaves unanswered (cut off by their branch, never timed out by redis-py): the
    source still learns the promoted replica, and the stopped master's tenants are
    answered again without operator action."""
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path, 1)
    try:
        masters = setup.nodes[:3]
        assert await trio.to_thread.run_sync(setup.slot_owner_ports) == {n.port for n in masters}
        for i, key in enumerate(KEYS):
            await trio.to_thread.run_sync(setup.client.set, key, envelope(i))
        await trio.to_thread.run_sync(setup.wait_replicated)
        owners = await trio.to_thread.run_sync(setup.owners, KEYS)
        dead = masters[0]
        victims = {i for i, key in enumerate(KEYS) if owners[key] is dead}
        assert victims
        source = RedisDirectiveSource.cluster(setup.seed_url, **TIMEOUTS)
        reads: list[Read] = []
        try:
            async with trio.open_nursery() as nursery:
                for k in range(READERS):
                    nursery.start_soon(branch_reader, source, reads, 300 + k)
                with trio.fail_after(RECOVERY):
                    while sum(r.outcome == "ok" for r in reads) < 50:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                dead.pause()
                stopped = trio.current_time()
                await trio.to_thread.run_sync(
                    wait_until,
                    lambda: dead.port not in setup.slot_owner_ports(),
                    "a replica to take over the stopped master's slots",
                )
                promoted = trio.current_time()

                def victims_answered() -> int:
                    return sum(
                        r.outcome == "ok" and r.start > promoted and r.tenant in victims
                        for r in reads
                    )

                with trio.fail_after(RECOVERY):
                    while victims_answered() < 20:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        finally:
            dead.resume()
            await source.aclose()
        assert any(r.tenant in victims and r.outcome != "ok" and r.start > stopped for r in reads)
        assert not [r for r in reads if r.outcome == "wrong"]
    finally:
        setup.stop()
