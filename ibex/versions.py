"""The third-party versions whose private parts ibex patches, checked at start-up.

Every patch of a private API lives in the `ibex.patches` package, one module
per patched library, and is installed at start-up by `install_patches` (Trio's,
`precise_wakeups`, as the serving Trio run starts).
A private API can change in any release, so each install function calls
`require` first: an installed version outside the range the patch was written
and tested for stops the daemon with a message naming the package, the
installed version and the supported range, instead of misbehaving at run time.
The lock (uv.lock) pins versions inside these ranges; the direct dependencies'
ranges in pyproject.toml are the same (tests/unit/test_versions.py checks both).

Ranges are [minimum, limit): release numbers compared as integer tuples, so a
pre-release of the limit (e.g. 0.5.0rc1 for limit 0.5) is refused too.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

#: distribution -> (minimum, limit, who patches it)
SUPPORTED: dict[str, tuple[str, str, str]] = {
    "grpclib": ("0.4.7", "0.5", "ibex/patches/grpclib_h2.py"),
    "h2": ("4.1", "5", "ibex/patches/grpclib_h2.py"),
    "hpack": ("4.0", "5", "ibex/patches/grpclib_h2.py"),
    "hyperframe": ("6.0", "7", "ibex/patches/grpclib_h2.py"),
    "trio-asyncio": ("0.15", "0.17", "ibex/patches/trio_asyncio_loop.py"),
    "redis": ("5.2", "9", "ibex/patches/redis_connection.py"),
    "trio": ("0.27", "0.40", "ibex/patches/trio_epoll.py"),
}


class UnsupportedVersion(RuntimeError):
    """An installed package is outside the range an ibex patch of its private API supports."""


def release(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("0.4.9.post1" -> (0, 4, 9))."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    if match is None:
        return ()
    numbers = [int(part) for part in match.group().split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()  # 0.5.0 == 0.5
    return tuple(numbers)


def supported_range(package: str) -> str:
    """The range as a PEP 440 specifier, as pyproject.toml writes it."""
    low, limit, _ = SUPPORTED[package]
    return f">={low},<{limit}"


def check(package: str, installed: str | None) -> None:
    """Raise `UnsupportedVersion` unless `installed` lies in `package`'s supported range."""
    low, limit, patcher = SUPPORTED[package]
    if installed is not None and release(low) <= release(installed) < release(limit):
        return
    raise UnsupportedVersion(
        f"{package} {installed or '(not installed)'} is installed, but {patcher} patches "
        f"its private API and supports {package}{supported_range(package)} only; "
        "install the locked versions (pip install --require-hashes -r requirements.lock)"
    )


def require(*packages: str) -> None:
    """Check each package's installed version (as a patch of it is installed)."""
    for package in packages:
        try:
            installed: str | None = version(package)
        except PackageNotFoundError:
            installed = None
        check(package, installed)
