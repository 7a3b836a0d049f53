"""The edge's import contract (pyproject.toml) names every serving module.

`lint-imports` enforces "the edge imports nothing of serving" only for the modules the
contract lists; a serving module added without being listed would be importable
from the edge unseen. This keeps the list whole.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "ibex" / "service"


def _contract() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"] == "the edge imports nothing of serving"
    ]
    return contract


def test_every_serving_module_is_forbidden_to_the_edge() -> None:
    serving = {
        f"ibex.service.{path.stem if path.is_file() else path.name}"
        for path in SERVICE.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__")
        or (path.is_dir() and (path / "__init__.py").exists())
    } - {"ibex.service.edge"}
    contract = _contract()
    assert contract["source_modules"] == ["ibex.service.edge"]
    assert serving <= set(contract["forbidden_modules"])
    assert "ibex.config" in contract["forbidden_modules"]


def test_the_edge_names_its_public_api() -> None:
    import ibex.service.edge as edge

    assert edge.__doc__ is not None
    for name in edge.__all__:
        assert f"`{name}`" in edge.__doc__, name
