"""The daemon's dependencies (Redis, the memory service): warmed before serving, kept warm,
and their up/down state.

Before Health says SERVING, each dependency's `warm` makes the connections a call
needs (Redis: connected and PINGed, Sentinel's master found, Cluster's slot map
read; the memory service: one idle connection per read pool, TLS handshake
done), each under its own cancel scope of `start_timeout`, all at once. A
dependency that does not answer in time does not hold the start: the daemon
serves degraded and the `dependency_down` warning says which and why.

While serving, `keep` probes each dependency every `probe_interval` with the same
`warm` (bounded by `probe_timeout`): an up dependency stays warm (the memory pools
never fall to zero idle connections, Redis's pooled connection never waits for a
health-check PING on a call's path), and a down one is retried with a jittered
exponential backoff until it answers. Its task lives in the daemon's nursery and
ends with it.

State: unknown until the first warm, then up or down. Each change is logged once
at warning (`dependency_down` with the error, `dependency_up` with how long it was
down), and reported to `on_change` (the `ibex_dependency_up` gauge). Probes, not
calls, decide the state: a branch timing out under load does not mean its
dependency is down; calls' errors are counted apart (`ibex.ops.branch_errors`).
Targets are logged redacted (the root passes them so), errors are SourceError
texts, which hold no secret.

A dependency may also have a `prime`, run once at start after its first warm
succeeded and within the same `start_timeout`: Redis's reads the directives of
the agents the workers being replaced served last (`ibex.ops.handover`), so a
reload's new worker answers its first calls from its cache. `report_recent`
is the other end: a supervised worker tells its supervisor those agents.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from ibex.errors import SourceError
from ibex.ops import handover
from ibex.ops.sdnotify import Notifier
from ibex.service.daemon_config import DependencyConfig
from ibex.sources.directive_cache import DirectiveCache

__all__ = [
    "Dependency",
    "DependencyConfig",
    "DependencyStates",
    "keep",
    "prime_directives",
    "report_recent",
    "warm_all",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Dependency:
    """One dependency: its name (`redis`, `memory`), where it is (redacted, for logs),
    and `warm`, which makes its connections or raises SourceError."""

    name: str
    target: str
    warm: Callable[[], Awaitable[None]]
    prime: Callable[[], Awaitable[None]] | None = None  # once, after the first warm at start
    # The probe while serving (`warm` when None). A probe holds what it checks, so one
    # that leased every warmed connection at once would send a call arriving meanwhile
    # to open a new connection on its path.
    check: Callable[[], Awaitable[None]] | None = None


class DependencyStates:
    """Each dependency's state (None: not yet known), changes logged once and reported."""

    def __init__(self, on_change: Callable[[str, bool], None] | None = None) -> None:
        self._up: dict[str, bool] = {}
        self._since: dict[str, float] = {}
        self._on_change = on_change

    def up(self, name: str) -> bool | None:
        return self._up.get(name)

    def down(self) -> list[str]:
        """Names of the dependencies known to be down."""
        return [name for name, up in self._up.items() if not up]

    def set(self, dep: Dependency, up: bool, error: str = "", *, starting: bool = False) -> None:
        """Record a probe's result; a change of state is logged at warning and reported."""
        was = self._up.get(dep.name)
        if was is up:
            return
        now = trio.current_time()
        self._up[dep.name] = up
        since, self._since[dep.name] = self._since.get(dep.name), now
        if up and was is False:
            down_for = round(now - since, 3) if since is not None else None
            log.warning(
                "dependency_up",
                extra={"dependency": dep.name, "target": dep.target, "down_for_s": down_for},
            )
        elif not up:
            log.warning(
                "dependency_down",
                extra={
                    "dependency": dep.name,
                    "target": dep.target,
                    "error": error,
                    # At start: serving without it, degraded, until a probe reaches it.
                    "starting": starting,
                },
            )
        if self._on_change is not None:
            self._on_change(dep.name, up)


async def probe(dep: Dependency, within: float, *, serving: bool = False) -> str:
    """One `warm` (`check` when `serving` and the dependency has one) bounded to `within`
    seconds: "" when it answered, else why not (no secret)."""
    attempt = dep.check if serving and dep.check is not None else dep.warm
    with trio.move_on_after(within):
        try:
            await attempt()
        except SourceError as exc:
            return str(exc)[:200]
        except Exception as exc:  # a bug or an unexpected library error: contained, logged
            log.exception("dependency_probe_failed", extra={"dependency": dep.name})
            return f"unexpected {type(exc).__name__}"
        return ""
    return f"no answer within {within * 1000:.0f}ms"


async def warm_all(
    deps: Sequence[Dependency], states: DependencyStates, config: DependencyConfig
) -> dict[str, float]:
    """Warm every dependency at once, each within `start_timeout`; seconds each took."""
    took: dict[str, float] = {}

    async def one(dep: Dependency) -> None:
        t0 = trio.current_time()
        error = await probe(dep, config.start_timeout)
        if not error and dep.prime is not None:
            with trio.move_on_at(t0 + config.start_timeout):
                await dep.prime()
        took[dep.name] = round(trio.current_time() - t0, 4)
        states.set(dep, not error, error, starting=True)

    async with trio.open_nursery() as nursery:
        for dep in deps:
            nursery.start_soon(one, dep)
    return took


async def keep(dep: Dependency, states: DependencyStates, config: DependencyConfig) -> None:
    """Probe `dep` for ever: every `probe_interval` while up, with backoff while down."""
    backoff = config.backoff_min
    while True:
        if states.up(dep.name):
            backoff = config.backoff_min
            await trio.sleep(config.probe_interval)
        else:
            # Jittered, so the workers of a host do not reconnect in step.
            await trio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(config.backoff_max, backoff * 2)
        error = await probe(dep, config.probe_timeout, serving=True)
        states.set(dep, not error, error)


async def prime_directives(cache: DirectiveCache, keys: Sequence[handover.Key]) -> None:
    """Read `keys` into the cache before serving; never raises (a key not read is read by
    its first call, as without the handover). Started together, the reads queue before
    the cache's read task runs, so they are one batched read (one MGET)."""

    errors: list[str] = []

    async def one(org: str, agent: str) -> None:
        try:
            await cache.fetch(org, agent, "")
        except SourceError as exc:
            errors.append(str(exc)[:200])

    async with trio.open_nursery() as nursery:
        for org, agent in keys[: handover.MAX_KEYS]:
            nursery.start_soon(one, org, agent)
    log.info(
        "directives_primed",
        extra={"agents": len(keys), "cached": len(cache), "error": errors[0] if errors else ""},
    )


async def report_recent(notifier: Notifier, cache: object, interval: float = 2.0) -> None:
    """In a supervised worker: every `interval`, when they changed, send the supervisor the
    agents whose directives the cache served last (a reload's next worker reads them)."""
    if not isinstance(cache, DirectiveCache) or not notifier.enabled:
        return
    sent = ""
    while True:
        await trio.sleep(interval)
        text = handover.encode(cache.recent(handover.MAX_KEYS))
        if text and text != sent and notifier.notify(f"{handover.NOTIFY_FIELD}={text}"):
            sent = text
