"""Real stand-ins shared by the tests and the benchmarks; never imported by the daemon.

The memory-service stand-in, `redis-server` / Sentinel / Cluster launchers, the daemon
on a real socket, the sample tenant and the independent grpcio client live here rather
than under `tests/` so `benchmarks/` can use them without importing the test suite.
They need the dev extras (pytest, grpcio) and are left out of the wheel; an
import-linter contract keeps every runtime layer from importing this package.

- `memory_server`: the memory service on loopback HTTP with per-endpoint latency,
  errors, hangs and resets (`FakeMemoryServer`, or `MemoryServerProcess`);
- `redis_server`, `redis_topology`: `redis-server` on a free port (`RedisServer`),
  Sentinel and Cluster set-ups (`SentinelSetup`, `ClusterSetup`);
- `grpc_harness`: the daemon in-process (`running_daemon`) or as a process
  (`DaemonProcess`), settings for a test (`test_settings`);
- `grpcio_stubs`: the stock grpcio client generated from the same protos;
- `noisy_tenant`: one tenant keeping large calls in flight while another calls at
  a steady rate (`NoisyTenant`);
- `samples`: the sample tenant (`ORG`, `AGENT`) and scored memories.

Each name is imported from its module on first use.
"""

from ibex._lazy import lazy_exports

__all__ = [
    "AGENT",
    "ORG",
    "ClusterSetup",
    "DaemonProcess",
    "FakeMemoryServer",
    "MemoryServerProcess",
    "NoisyTenant",
    "RedisServer",
    "SentinelSetup",
    "running_daemon",
    "running_memory_server",
    "test_settings",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "AGENT": "samples",
        "ORG": "samples",
        "ClusterSetup": "redis_topology",
        "SentinelSetup": "redis_topology",
        "DaemonProcess": "grpc_harness",
        "running_daemon": "grpc_harness",
        "test_settings": "grpc_harness",
        "FakeMemoryServer": "memory_server",
        "MemoryServerProcess": "memory_server",
        "running_memory_server": "memory_server",
        "RedisServer": "redis_server",
        "NoisyTenant": "noisy_tenant",
    },
)
