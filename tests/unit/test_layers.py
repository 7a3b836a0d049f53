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


def loaded_after(imports: str) -> set[str]:
    """Every module a fresh interpreter holds after `import <imports>`."""
    probe = f"import json, sys\nimport {imports}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out))


def among(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(n for n in loaded for p in packages if n == p or n.startswith(p + "."))


def test_importing_the_pure_core_loads_no_io_library() -> None:
    loaded = loaded_after(
        "ibex.assembly.pipeline, ibex.assembly.candidates, ibex.assembly.validation"
    )
    assert "ibex.assembly.pipeline" in loaded  # the probe did import the core
    assert among(loaded, IO_LIBRARIES) == []


def test_the_client_library_loads_neither_the_pipeline_nor_numpy() -> None:
    """Proxies embed the client: it formats the fallback history and nothing more."""
    loaded = loaded_after("ibex.client")
    assert "ibex.client" in loaded
    heavy = ("numpy", "ibex.assembly.pipeline", "ibex.assembly.packer", "tiktoken")
    assert among(loaded, heavy) == []
