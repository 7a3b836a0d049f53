"""deploy/bootstrap.sh: `run` installs the runtime lock and starts the daemon; any other
recipe installs the full lock (dev extras, `just`); the stamp knows which set is in .venv.

The script runs for real in a copy of the files it reads, with a stand-in interpreter
and `just` that record their arguments instead of installing anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = "requirements-image.lock"
FULL = "requirements.lock"
DEV_ONLY = ("mypy==", "ruff==", "grpcio-tools==", "pytest==", "rust-just==", "uv==")

# Stands in for `python3 -m venv .venv` (makes .venv/bin/python and .venv/bin/just),
# and, as .venv/bin/python, records every command (pip, `-m ibex serve`).
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"
    cp "$0" "$3/bin/python"
    printf '#!/bin/sh\\necho "just $*" >>"$BOOT_LOG"\\n' >"$3/bin/just"
    chmod +x "$3/bin/just"
    exit 0
fi
echo "python $*" >>"$BOOT_LOG"
"""

INSTALL_RUNTIME = [
    f"python -m pip install --require-hashes -r {RUNTIME}",
    "python -m pip install --no-deps -e .",
]
INSTALL_FULL = [
    f"python -m pip install --require-hashes -r {FULL}",
    "python -m pip install --no-deps -e .",
]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in ("deploy/bootstrap.sh", "pyproject.toml", RUNTIME, FULL):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def bootstrap(repo: Path, *args: str) -> tuple[list[str], str]:
    """Run the script; the commands it ran (in order) and what it printed on stderr."""
    log = repo / "boot.log"
    log.unlink(missing_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(repo / "fake-python"),
        "BOOT_LOG": str(log),
    }
    done = subprocess.run(
        ["sh", "deploy/bootstrap.sh", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    ran = log.read_text().splitlines() if log.exists() else []
    return ran, done.stderr


def stamp(repo: Path) -> str:
    return (repo / ".venv" / ".ibex-installed").read_text().strip()


def test_the_runtime_lock_holds_no_dev_tool_and_the_full_lock_holds_them() -> None:
    runtime = (ROOT / RUNTIME).read_text()
    full = (ROOT / FULL).read_text()
    for name in DEV_ONLY:
        assert f"\n{name}" not in runtime, name
        assert f"\n{name}" in full, name


def test_run_installs_the_runtime_lock_only_and_execs_the_daemon(repo: Path) -> None:
    ran, said = bootstrap(repo, "run", "--workers", "2")
    assert ran == [*INSTALL_RUNTIME, "python -m ibex serve --workers 2"]
    assert stamp(repo) == "runtime"
    # a line per step, and pip is not silenced
    steps = [line for line in said.splitlines() if line.startswith("bootstrap: ")]
    assert len(steps) == 4, said  # venv, the lock, the project, the start
    assert RUNTIME in steps[1]
    assert not any("--quiet" in command or " -q" in command for command in ran)


def test_run_again_installs_nothing(repo: Path) -> None:
    bootstrap(repo, "run")
    ran, said = bootstrap(repo, "run")
    assert ran == ["python -m ibex serve"]
    assert "nothing to do" in said


def test_a_recipe_installs_the_full_lock_and_runs_just(repo: Path) -> None:
    ran, _ = bootstrap(repo, "--list")
    assert ran == [*INSTALL_FULL, "just --list"]
    assert stamp(repo) == "dev"


def test_a_recipe_after_run_adds_the_dev_extras_and_run_keeps_them(repo: Path) -> None:
    bootstrap(repo, "run")
    ran, _ = bootstrap(repo, "test")
    assert ran == [*INSTALL_FULL, "just test"]
    assert stamp(repo) == "dev"
    ran, _ = bootstrap(repo, "run")  # the full set contains the runtime set
    assert ran == ["python -m ibex serve"]
    assert stamp(repo) == "dev"


def test_a_newer_lock_reinstalls_the_installed_set(repo: Path) -> None:
    bootstrap(repo, "run")
    later = (repo / ".venv" / ".ibex-installed").stat().st_mtime + 10
    os.utime(repo / RUNTIME, (later, later))
    ran, _ = bootstrap(repo, "run")
    assert ran == [*INSTALL_RUNTIME, "python -m ibex serve"]

    bootstrap(repo, "--list")
    later = (repo / ".venv" / ".ibex-installed").stat().st_mtime + 10
    os.utime(repo / FULL, (later, later))
    ran, _ = bootstrap(repo, "run")  # the dev set stays: it is reinstalled whole
    assert ran == [*INSTALL_FULL, "python -m ibex serve"]
    assert stamp(repo) == "dev"


def test_an_empty_stamp_means_the_full_set(repo: Path) -> None:
    """`just setup` and earlier bootstraps installed requirements.lock and left an empty stamp."""
    bootstrap(repo, "--list")
    (repo / ".venv" / ".ibex-installed").write_text("")
    ran, _ = bootstrap(repo, "test")
    assert ran == ["just test"]
