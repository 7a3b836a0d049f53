"""Redis Sentinel and Redis Cluster made of real redis-server processes on loopback.

`SentinelSetup`: a master, a replica and three sentinels (`redis-server CONF
--sentinel`) watching them, with `failover()` (`SENTINEL FAILOVER`). `ClusterSetup`:
three masters joined with `redis-cli --cluster create`, with `reshard()` and
`kill()`. Every process runs in its own directory under the test's tmp_path, on a
free port, and `stop()` kills them all. Administration uses redis-py's synchronous
clients: an independent client, not the code under test.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.cluster

from ibex.testing.redis_server import RedisServer, _free_port, find_redis_server

LOOPBACK = "127.0.0.1"
MASTER_NAME = "ibex"
SETUP_TIMEOUT = 30.0


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = SETUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def admin(port: int, password: str | None = None) -> redis.Redis:
    return redis.Redis(LOOPBACK, port, password=password, socket_timeout=2, decode_responses=True)


class SentinelSetup:
    """Master + replica + three sentinels monitoring them as `MASTER_NAME`.

    `password` protects the data nodes (the sentinels use it too), and
    `sentinel_password` the sentinels themselves.
    """

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        exe = find_redis_server()
        self.password = password
        self.sentinel_password = sentinel_password
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        (workdir / "master").mkdir()
        (workdir / "replica").mkdir()
        self.master = RedisServer(exe, workdir / "master", extra_args=auth)
        self.master.start()
        self.replica = RedisServer(
            exe,
            workdir / "replica",
            extra_args=[*auth, "--replicaof", LOOPBACK, str(self.master.port)],
        )
        self.replica.start()
        self.sentinel_ports = [_free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen[bytes]] = []
        for port in self.sentinel_ports:
            home = workdir / f"sentinel-{port}"
            home.mkdir()
            conf = home / "sentinel.conf"
            conf.write_text(
                f"port {port}\n"
                f"bind {LOOPBACK}\n"
                f'dir "{home}"\n'
                f'logfile "{home / "sentinel.log"}"\n'
                f"sentinel monitor {MASTER_NAME} {LOOPBACK} {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
                + (f"sentinel auth-pass {MASTER_NAME} {password}\n" if password else "")
                + (f"requirepass {sentinel_password}\n" if sentinel_password else "")
            )
            self._sentinels.append(
                subprocess.Popen([exe, str(conf), "--sentinel"], stdin=subprocess.DEVNULL)
            )
        wait_until(self._in_sync, "replication and three sentinels that see both servers")

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, p) for p in self.sentinel_ports]

    def _in_sync(self) -> bool:
        replica = admin(self.replica.port, self.password)
        if replica.info("replication")["master_link_status"] != "up":
            return False
        for port in self.sentinel_ports:
            # redis-py types the reply loosely; SENTINEL MASTER answers a field map.
            reply = admin(port, self.sentinel_password).sentinel_master(MASTER_NAME)
            state = cast("dict[str, Any]", reply)
            if state["num-other-sentinels"] < 2 or state["num-slaves"] < 1:
                return False
        return True

    def master_port(self, sentinel_port: int | None = None) -> int:
        port = self.sentinel_ports[0] if sentinel_port is None else sentinel_port
        sentinel = admin(port, self.sentinel_password)
        addr = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
        _, master = cast("tuple[str, str]", addr)
        return int(master)

    def set(self, key: str, value: str, db: int = 0) -> None:
        """Write on the current master and wait until the replica has it too."""
        client = redis.Redis(LOOPBACK, self.master_port(), db=db, password=self.password)
        client.set(key, value)
        client.wait(1, 2000)
        client.close()

    def failover(self) -> None:
        """`SENTINEL FAILOVER`: promote the replica without waiting for the master to fail."""
        old = self.master_port()
        sentinel = admin(self.sentinel_ports[0], self.sentinel_password)
        sentinel.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        wait_until(
            lambda: all(self.master_port(p) != old for p in self.sentinel_ports),
            "every sentinel to name the new master",
        )

    def stop(self) -> None:
        for proc in self._sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        self.replica.stop()
        self.master.stop()


def _cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, 55536)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind((LOOPBACK, candidate))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair for a cluster node")


class ClusterSetup:
    """Three masters joined by `redis-cli --cluster create`, with `replicas` replicas
    each (`nodes[:3]` are the masters, `nodes[3:]` their replicas)."""

    def __init__(self, workdir: Path, replicas: int = 0) -> None:
        exe = find_redis_server()
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            pytest.fail("redis-cli not found on PATH (Debian package redis-tools)", pytrace=False)
        self.nodes: list[RedisServer] = []
        for i in range(3 * (1 + replicas)):
            home = workdir / f"node-{i}"
            home.mkdir()
            node = RedisServer(
                exe,
                home,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", str(home / "nodes.conf"),
                    "--cluster-node-timeout", "1000",
                    # Slots of a failed master fail alone; the others keep answering.
                    "--cluster-require-full-coverage", "no",
                ],
            )  # fmt: skip
            node.port = _cluster_port()
            node.start()
            self.nodes.append(node)
        self._run_cli(
            "--cluster", "create", *(f"{LOOPBACK}:{n.port}" for n in self.nodes),
            "--cluster-replicas", str(replicas), "--cluster-yes",
        )  # fmt: skip
        wait_until(self._healthy, "every node to report cluster_state:ok")
        self.client = redis.cluster.RedisCluster(LOOPBACK, self.nodes[0].port, socket_timeout=2)

    @property
    def seed_url(self) -> str:
        return f"redis://{LOOPBACK}:{self.nodes[0].port}"

    def _run_cli(self, *args: str) -> str:
        assert self.cli is not None
        proc = subprocess.run(
            [self.cli, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    def _healthy(self) -> bool:
        return all(
            admin(n.port).cluster("info")["cluster_state"] == "ok" for n in self.live_nodes()
        )

    def live_nodes(self) -> Iterator[RedisServer]:
        return (n for n in self.nodes if n._proc is not None and n._proc.poll() is None)

    def node_id(self, node: RedisServer) -> str:
        return str(admin(node.port).execute_command("CLUSTER", "MYID"))

    def owners(self, keys: list[str]) -> dict[str, RedisServer]:
        """The node owning each key's slot, from a fresh read of the cluster's slot map."""
        client = redis.cluster.RedisCluster(LOOPBACK, self.nodes[0].port, socket_timeout=2)
        try:
            ports = {key: int(client.get_node_from_key(key).port) for key in keys}
        finally:
            client.close()
        return {key: next(n for n in self.nodes if n.port == port) for key, port in ports.items()}

    def reshard(self, source: RedisServer, target: RedisServer, slots: int) -> None:
        """Move `slots` slots (and their keys) from `source` to `target`: MOVED and ASK live."""
        self._run_cli(
            "--cluster", "reshard", f"{LOOPBACK}:{source.port}",
            "--cluster-from", self.node_id(source),
            "--cluster-to", self.node_id(target),
            "--cluster-slots", str(slots),
            "--cluster-yes",
        )  # fmt: skip

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one master; wait until the others mark it failed."""
        node_id = self.node_id(node)
        node.kill()

        def marked_failed() -> bool:
            for other in self.live_nodes():
                nodes = admin(other.port).execute_command("CLUSTER", "NODES")
                line = next(x for x in nodes.splitlines() if x.startswith(node_id))
                if "fail" not in line.split()[2].split(","):
                    return False
            return True

        wait_until(marked_failed, "the killed master to be marked failed")

    def slot_owner_ports(self) -> set[int]:
        """The ports of the masters serving slots, as the first node that answers
        CLUSTER SLOTS says (a paused node does not)."""
        for node in self.live_nodes():
            try:
                slots = admin(node.port).execute_command("CLUSTER", "SLOTS")
            except (redis.RedisError, OSError):
                continue
            return {int(entry[2][1]) for entry in slots}
        raise AssertionError("no cluster node answers")

    def wait_replicated(self) -> None:
        """Every master's writes so far have reached its replicas (WAIT)."""
        for master in self.nodes[:3]:
            admin(master.port).execute_command("WAIT", len(self.nodes) // 3 - 1, 5000)

    def stop(self) -> None:
        self.client.close()
        for node in self.nodes:
            node.stop()
