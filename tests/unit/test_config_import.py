"""Reading the settings loads no part of the daemon: `import ibex.config` (what `ibex
config`, `ibex check` and the docs' table start from) reads each layer's declarations from
its config module, and none of those loads an I/O library, the HTTP/2 stack or numpy.

Import-linter's contract ("the settings load no I/O library and no numpy") follows import
statements; a package's `__init__` that imports its modules runs too, which only a real
import shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: What the daemon loads and reading the settings must not (each tens of modules or more).
HEAVY = ("numpy", "grpclib", "h2", "prometheus_client", "trio", "trio_asyncio", "redis")


def _run(code: str) -> str:
    """`code`'s output in a fresh interpreter, with no setting of this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_CONTEXT_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _loaded_by(module: str) -> list[str]:
    code = (
        f"import json, sys, {module}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    loaded: list[str] = json.loads(_run(code))
    return loaded


def test_importing_the_settings_loads_no_io_library_nor_numpy() -> None:
    assert _loaded_by("ibex.config") == []


def test_the_edge_config_loads_without_the_edge() -> None:
    """The edge package names its API without importing its modules (grpclib, h2, Trio)."""
    assert _loaded_by("ibex.service.edge.connections_config") == []


def test_ibex_config_loads_no_part_of_the_daemon() -> None:
    """`ibex config` prints the effective values, derived ones included, from the settings
    alone (`ibex.config.effective`), not from the composition root."""
    code = (
        "import contextlib, io, json, sys\n"
        "from ibex.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    status = main(['config'])\n"
        f"print(json.dumps([status, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
    )
    assert json.loads(_run(code)) == [0, []]
