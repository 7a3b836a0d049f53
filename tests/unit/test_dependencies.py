"""Dependency warming and state (`ibex.service.dependencies`), on a mock clock.

What the design asks: warming is bounded per dependency (a dependency down at
start does not hold the start), a down dependency is retried with a growing,
capped, jittered backoff, and each change of state is logged once at warning,
with the error, and reported once (the gauge).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import trio
import trio.testing

from ibex.config import Settings
from ibex.errors import SourceError
from ibex.service.dependencies import (
    Dependency,
    DependencyConfig,
    DependencyStates,
    keep,
    warm_all,
)
from ibex.service.root import redis_target

CONFIG = DependencyConfig(
    start_timeout=3.0, probe_interval=1.0, probe_timeout=1.0, backoff_min=0.1, backoff_max=5.0
)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    clock = trio.testing.MockClock(autojump_threshold=0)
    clock.jump(1000.0)
    return clock


class Scripted:
    """A dependency's `warm`: each call takes the next step ("ok", "fail", "hang")."""

    def __init__(self, *steps: str, then: str = "ok") -> None:
        self.steps = list(steps)
        self.then = then
        self.calls: list[float] = []

    async def __call__(self) -> None:
        self.calls.append(trio.current_time())
        step = self.steps.pop(0) if self.steps else self.then
        if step == "hang":
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        if step == "fail":
            raise SourceError("redis: connection failed")


def recorder() -> tuple[list[tuple[str, bool]], Callable[[str, bool], None]]:
    seen: list[tuple[str, bool]] = []
    return seen, lambda name, up: seen.append((name, up))


async def warm_then_keep(
    dep: Dependency, states: DependencyStates, script: Scripted, calls: int
) -> None:
    """Warm `dep`, then keep it (probes and retries) until `script` has run `calls` times."""
    await warm_all([dep], states, CONFIG)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep, dep, states, CONFIG)
        while len(script.calls) < calls:  # noqa: ASYNC110  (mock clock)
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


def state_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, dict[str, object]]]:
    return [
        (
            r.getMessage(),
            r.levelno,
            {k: getattr(r, k) for k in ("dependency", "error", "starting") if hasattr(r, k)},
        )
        for r in caplog.records
        if r.getMessage().startswith("dependency_")
    ]


async def test_warming_is_bounded_per_dependency(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A hanging dependency is given up on after its own start_timeout; the other one is
    warmed meanwhile; the hanging one is logged down with why, at warning."""
    caplog.set_level(logging.INFO)
    seen, on_change = recorder()
    states = DependencyStates(on_change)
    hang, ok = Scripted("hang"), Scripted("ok")
    deps = [Dependency("redis", "redis://h:1/0", hang), Dependency("memory", "http://m", ok)]
    t0 = trio.current_time()
    took = await warm_all(deps, states, CONFIG)
    assert trio.current_time() - t0 == pytest.approx(CONFIG.start_timeout)
    assert took == {"redis": pytest.approx(3.0), "memory": 0.0}
    assert (states.up("redis"), states.up("memory")) == (False, True)
    assert states.down() == ["redis"]
    assert sorted(seen) == [("memory", True), ("redis", False)]
    assert state_lines(caplog) == [
        (
            "dependency_down",
            logging.WARNING,
            {"dependency": "redis", "error": "no answer within 3000ms", "starting": True},
        )
    ]


async def test_a_down_dependency_is_retried_with_backoff_and_logged_up_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    seen, on_change = recorder()
    states = DependencyStates(on_change)
    warm = Scripted("fail", "fail", "fail", "fail", "fail", "fail", "fail", "ok")
    dep = Dependency("redis", "redis://h:1/0", warm)
    await warm_then_keep(dep, states, warm, 9)
    gaps = [b - a for a, b in zip(warm.calls, warm.calls[1:], strict=False)]
    # Retries while down: 0.1, 0.2, 0.4, ... doubled up to 5 s, each jittered to 50-100 %.
    nominal = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
    assert all(n / 2 <= g <= n for g, n in zip(gaps[:7], nominal, strict=True)), gaps
    assert gaps[7] == pytest.approx(CONFIG.probe_interval)  # up: probed every interval
    assert seen == [("redis", False), ("redis", True)]
    assert [(event, level) for event, level, _ in state_lines(caplog)] == [
        ("dependency_down", logging.WARNING),
        ("dependency_up", logging.WARNING),
    ]


async def test_an_up_dependency_that_fails_a_probe_is_logged_down_once_with_the_error(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    states = DependencyStates()
    warm = Scripted("ok", "ok", "fail", "hang", "fail", then="ok")
    dep = Dependency("memory", "https://memory.example", warm)
    await warm_then_keep(dep, states, warm, 7)
    assert state_lines(caplog) == [
        (
            "dependency_down",
            logging.WARNING,
            {"dependency": "memory", "error": "redis: connection failed", "starting": False},
        ),
        ("dependency_up", logging.WARNING, {"dependency": "memory"}),
    ]
    assert states.up("memory") is True


def test_the_redis_target_in_logs_carries_no_password() -> None:
    url = Settings(redis_url="redis://:hunter2@10.0.0.5:6379/0")
    cluster = Settings(redis_url="rediss://user:hunter2@10.0.0.5:6379/0", redis_cluster=True)
    sentinel = Settings(
        redis_url="redis://:hunter2@ignored:1/0",
        redis_sentinels=("10.0.0.1:26379", "10.0.0.2:26379"),
        redis_sentinel_master="main",
        redis_sentinel_password="hunter3",
    )
    assert redis_target(url) == "redis://<redacted>@10.0.0.5:6379/0"
    assert redis_target(cluster) == "cluster rediss://<redacted>@10.0.0.5:6379/0"
    assert redis_target(sentinel) == "sentinel 10.0.0.1:26379,10.0.0.2:26379 master main"


async def test_while_serving_a_dependency_is_probed_with_its_check_not_its_warm(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Start-up warms (for Redis: every connection a burst needs); the probe every interval
    runs `check`, which holds less (one connection), and a failed check is a down state
    like a failed warm."""
    states = DependencyStates()
    warm = Scripted()
    check = Scripted("ok", "ok", "fail")
    dep = Dependency("redis", "redis://h:1/0", warm, check=check)
    await warm_then_keep(dep, states, check, 3)
    assert len(warm.calls) == 1
    assert states.up("redis") is False
