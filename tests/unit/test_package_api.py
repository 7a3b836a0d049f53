"""Every package's `__init__` names its public API, and importing it loads nothing else."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

PACKAGES = [
    "ibex",
    "ibex.assembly",
    "ibex.ops",
    "ibex.patches",
    "ibex.service",
    "ibex.testing",
    "ibex.tools",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_each_public_name_resolves_to_what_its_module_defines(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__doc__ and len(package.__doc__.splitlines()) > 2, name
    assert package.__all__ == sorted(package.__all__, key=lambda n: (not n.isupper(), n))
    for public in package.__all__:
        value = getattr(package, public)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert f"{value.__module__}.".startswith(f"{name}."), (public, value.__module__)
    with pytest.raises(AttributeError):
        _ = package.no_such_name


def test_package_loads_only_itself() -> None:
    """A package's names are imported on first use: `import ibex.ops` must not import
    prometheus_client (the supervisor sets PROMETHEUS_MULTIPROC_DIR first), nor
    `import ibex.assembly` numpy, nor `import ibex.service` Trio, nor `import ibex.patches`
    grpclib (a source takes redis-py's tap from it)."""
    probe = (
        "import sys\n"
        f"import {', '.join(PACKAGES)}\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('ibex')"
        " or m.split('.')[0] in ('numpy', 'prometheus_client', 'trio', 'grpclib'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert sorted(out) == sorted([*PACKAGES, "ibex._lazy"])
