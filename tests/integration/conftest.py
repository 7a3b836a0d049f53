"""Fixtures for this package. Redis ones come from tests/redis_server.py."""

from tests.redis_server import redis_server, redis_tls_server, trio_asyncio_loop

__all__ = ["redis_server", "redis_tls_server", "trio_asyncio_loop"]
