"""Reading the settings loads no part of the daemon: `import ibex.config` (what `ibex
config`, `ibex check` and the docs' table start from) reads each layer's declarations from
its config module, and none of those loads an I/O library, the HTTP/2 stack or numpy.

Import-linter's contract ("the settings load no I/O library and no numpy") follows import
statements; a package's `__init__` that imports its modules runs too, which only a real
import shows.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: What the daemon loads and reading the settings must not (each tens of modules or more).
HEAVY = ("numpy", "grpclib", "h2", "prometheus_client", "trio", "trio_asyncio", "redis")


def _loaded_by(module: str) -> list[str]:
    code = (
        f"import json, sys, {module}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded: list[str] = json.loads(proc.stdout)
    return loaded


def test_importing_the_settings_loads_no_io_library_nor_numpy() -> None:
    assert _loaded_by("ibex.config") == []


def test_the_edge_config_loads_without_the_edge() -> None:
    """The edge package names its API without importing its modules (grpclib, h2, Trio)."""
    assert _loaded_by("ibex.service.edge.connections_config") == []
