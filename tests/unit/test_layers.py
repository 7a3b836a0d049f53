"""The layers hold at run time too: importing the pure core loads no I/O library.

`just lint` checks the import graph statically (import-linter contracts in
pyproject.toml); this checks what a real import drags in, transitively, in a
fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

IO_LIBRARIES = (
    "trio",
    "trio_asyncio",
    "asyncio",
    "grpclib",
    "h2",
    "redis",
    "httptools",
    "prometheus_client",
    "sniffio",
    "ibex.config",
    "ibex.service",
    "ibex.sources",
    "ibex.ops",
)

PROBE = """
import json, sys
import ibex.assembly.pipeline, ibex.assembly.candidates, ibex.assembly.validation
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_the_pure_core_loads_no_io_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    loaded = set(json.loads(out))
    assert "ibex.assembly.pipeline" in loaded  # the probe did import the core
    leaked = sorted(
        name for name in loaded for lib in IO_LIBRARIES if name == lib or name.startswith(lib + ".")
    )
    assert leaked == []


CLIENT_PROBE = """
import json, sys
import ibex.client
print(json.dumps(sorted(sys.modules)))
"""


def test_the_client_library_loads_neither_the_pipeline_nor_numpy() -> None:
    """Proxies embed the client: it formats the fallback history and nothing more."""
    out = subprocess.run(
        [sys.executable, "-c", CLIENT_PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    loaded = set(json.loads(out))
    assert "ibex.client" in loaded
    heavy = ("numpy", "ibex.assembly.pipeline", "ibex.assembly.packer", "tiktoken")
    assert sorted(n for n in loaded for h in heavy if n == h or n.startswith(h + ".")) == []
