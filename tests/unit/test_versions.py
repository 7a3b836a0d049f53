"""Start-up version checks of the patched third-party packages (ibex/versions.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ibex import versions
from ibex.versions import SUPPORTED, UnsupportedVersion, check, release, require

ROOT = Path(__file__).resolve().parents[2]


def test_installed_versions_pass() -> None:
    require(*SUPPORTED)


@pytest.mark.parametrize(
    ("package", "installed"),
    [("grpclib", "0.5.0"), ("grpclib", "0.4.6"), ("h2", "5.0.0"), ("trio-asyncio", "0.17.0"),
     ("redis", "9.0.0rc1"), ("redis", "5.1.1"), ("hpack", "3.0.0"), ("hyperframe", "7.0.0"),
     ("trio", "0.40.0"), ("trio", "0.26.0")],
)  # fmt: skip
def test_a_version_outside_the_range_fails_naming_package_versions_and_patch(
    package: str, installed: str
) -> None:
    low, limit, patcher = SUPPORTED[package]
    with pytest.raises(UnsupportedVersion) as info:
        check(package, installed)
    message = str(info.value)
    assert f"{package} {installed} is installed" in message
    assert f"{package}>={low},<{limit}" in message
    assert patcher in message


@pytest.mark.parametrize(
    ("package", "installed"),
    [("grpclib", "0.4.7"), ("grpclib", "0.4.12.post1"), ("trio-asyncio", "0.16.0"),
     ("redis", "8.1.0"), ("redis", "5.2"), ("h2", "4.1.0"), ("trio", "0.35.0")],
)  # fmt: skip
def test_versions_inside_the_range_pass(package: str, installed: str) -> None:
    check(package, installed)


def test_a_missing_package_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise versions.PackageNotFoundError(name)

    monkeypatch.setattr(versions, "version", missing)
    with pytest.raises(UnsupportedVersion, match=r"redis \(not installed\) is installed"):
        require("redis")


def test_release_numbers() -> None:
    assert release("0.4.9") == (0, 4, 9)
    assert release("0.5.0rc1") == release("0.5") == (0, 5)
    assert release("10.0.1.post2") == (10, 0, 1)
    assert release("garbage") == ()


PATCHERS = [
    ("answer_expired_deadlines", "grpclib"),
    ("lighten_h2", "h2"),
    ("lighten_h2", "hpack"),
    ("lighten_h2", "hyperframe"),
    ("count_open_streams_inline", "h2"),
    ("batch_ready_callbacks", "trio-asyncio"),
    ("honour_cancellation_in_redis_writes", "redis"),
    ("precise_wakeups", "trio"),
]


def test_each_patch_refuses_to_install_with_an_unsupported_version() -> None:
    """Each patch checks its package as it is installed (at start-up, through
    `install_patches`; Trio's as the serving run enters it), in a fresh interpreter each;
    importing the patches applies none."""
    procs = []
    for install, package in PATCHERS:
        fake = ".".join(str(n) for n in release(SUPPORTED[package][1])) + ".0"
        code = (
            "import importlib.metadata as m\n"
            "real = m.version\n"
            f"m.version = lambda name: {fake!r} if name == {package!r} else real(name)\n"
            "import grpclib.utils\n"
            "original = grpclib.utils.DeadlineWrapper.start\n"
            "from ibex import patches\n"
            "assert grpclib.utils.DeadlineWrapper.start is original\n"
            "async def enter():\n"
            "    with patches.precise_wakeups():\n"
            "        pass\n"
        )
        if install == "precise_wakeups":
            code += "import trio\ntrio.run(enter)\n"
        else:
            code += f"patches.{install}()\n"
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        procs.append((proc, package, fake))
    for proc, package, fake in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert f"UnsupportedVersion: {package} {fake} is installed" in stderr


async def test_the_patches_check_every_supported_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """`install_patches` and `precise_wakeups` (what the daemon runs at start-up) ask for
    every package in SUPPORTED, and nothing else."""
    from ibex import patches
    from ibex.patches import grpclib_h2, redis_connection, trio_asyncio_loop, trio_epoll

    asked: set[str] = set()

    def record(*packages: str) -> None:
        asked.update(packages)
        require(*packages)

    for module in (grpclib_h2, redis_connection, trio_asyncio_loop, trio_epoll):
        monkeypatch.setattr(module, "require", record)
    patches.install_patches()
    with patches.precise_wakeups():
        pass
    assert asked == set(SUPPORTED)


def test_direct_dependency_ranges_in_pyproject_are_the_supported_ranges() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package in ("grpclib", "trio-asyncio", "redis", "trio"):
        assert f"{package}{versions.supported_range(package)}" in deps


def test_the_lock_pins_supported_versions() -> None:
    locked = {
        p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]
    }
    for package in SUPPORTED:
        check(package, locked[package])
