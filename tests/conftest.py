"""Shared fixtures: a real redis-server per test that asks for one."""

pytest_plugins = ["ibex.testing.redis_server"]
