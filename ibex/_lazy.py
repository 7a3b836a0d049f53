"""Public names of a package, imported from their module only when first used.

A package's `__init__` names its public API (`__all__`) without importing the
modules that define it, because importing a package runs its `__init__` first:
`import ibex.client` must load no server module, prometheus_client must not be
imported before the supervisor sets PROMETHEUS_MULTIPROC_DIR, and a client
must not pull numpy in through the pure core.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: `where` maps each public name to the
    submodule (relative to the package) that defines it. A name is imported once,
    then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
