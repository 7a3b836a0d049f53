"""Real stand-ins shared by the tests and the benchmarks; never imported by the daemon.

The memory-service stand-in, `redis-server` / Sentinel / Cluster launchers, the daemon
on a real socket, the sample tenant and the independent grpcio client live here rather
than under `tests/` so `benchmarks/` can use them without importing the test suite.
They need the dev extras (pytest, grpcio) and are left out of the wheel; an
import-linter contract keeps every runtime layer from importing this package.
"""
