"""Shared fixtures: a real redis-server per test that asks for one."""

import pytest

from ibex.patches.redis_connection import honour_cancellation_in_redis_writes

pytest_plugins = ["ibex.testing.redis_server"]


@pytest.fixture(autouse=True, scope="session")
def _redis_patches() -> None:
    """The daemon installs redis-py's patch at start-up (`install_patches`); tests that
    use the Redis source without a daemon get it here, as a serving process has it."""
    honour_cancellation_in_redis_writes()
