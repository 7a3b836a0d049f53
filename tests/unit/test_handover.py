"""The reload's directive handover: a worker's report, bounded, read back by its successor.

`ibex.ops.handover` is the codec both ends use; `report_recent` (a worker tells
its supervisor the agents its directive cache served last) and
`prime_directives` (a new worker reads them before serving) are its two ends.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import trio

from ibex.assembly.structs import Directive
from ibex.ops import handover
from ibex.ops.sdnotify import Notifier
from ibex.service.dependencies import prime_directives, report_recent
from ibex.sources.directive_cache import DirectiveCache, DirectiveCacheConfig

ORG = "0b6f8f1e-5c3a-4f51-9a8e-0d6f1c2b3a4d"
AGENTS = [str(uuid.UUID(int=i + 1, version=4)) for i in range(40)]


class Store:
    """A directive source that counts its reads."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        self.reads.append((org_id, agent_id))
        await trio.lowlevel.checkpoint()
        return Directive(content=f"for {agent_id}", version_id=None)

    async def aclose(self) -> None:
        pass


def test_the_codec_keeps_uuid_pairs_in_order_within_both_bounds() -> None:
    keys = [(ORG, agent) for agent in AGENTS]
    text = handover.encode(keys)
    assert len(text) <= handover.MAX_BYTES
    assert handover.decode(text) == keys[: handover.MAX_KEYS]
    hostile = f"{ORG}/{AGENTS[0]} {ORG}/{AGENTS[0]} x/y {ORG} {ORG}/{AGENTS[1]}/z {'a' * 9000}"
    assert handover.decode(hostile) == [(ORG, AGENTS[0])]  # repeats and malformed dropped
    assert handover.decode("a" * handover.MAX_BYTES + f" {ORG}/{AGENTS[0]}") == []  # past the cap


async def test_a_worker_reports_the_agents_its_cache_served_last(tmp_path: Path) -> None:
    address = str(tmp_path / "notify.sock")
    supervisor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    supervisor.bind(address)
    supervisor.setblocking(False)
    store = Store()
    async with DirectiveCache(store, DirectiveCacheConfig()) as cache:  # type: ignore[arg-type]
        for agent in AGENTS[:3]:
            await cache.fetch(ORG, agent, "")
        await cache.fetch(ORG, AGENTS[0], "")  # the latest used comes first
        async with trio.open_nursery() as nursery:
            nursery.start_soon(report_recent, Notifier(address), cache, 0.01)
            with trio.fail_after(10):
                await trio.lowlevel.wait_readable(supervisor)
            nursery.cancel_scope.cancel()
    (line,) = supervisor.recv(4096).decode().splitlines()
    field, _, text = line.partition("=")
    assert field == handover.NOTIFY_FIELD
    assert handover.decode(text) == [(ORG, AGENTS[0]), (ORG, AGENTS[2]), (ORG, AGENTS[1])]
    supervisor.close()


async def test_priming_reads_the_handed_agents_so_their_first_call_is_a_hit() -> None:
    store = Store()
    async with DirectiveCache(store, DirectiveCacheConfig()) as cache:  # type: ignore[arg-type]
        await prime_directives(cache, [(ORG, AGENTS[0]), (ORG, AGENTS[1])])
        assert sorted(store.reads) == sorted([(ORG, AGENTS[0]), (ORG, AGENTS[1])])
        hit = cache.cached(ORG, AGENTS[1], "")
        assert hit is not None and hit.detail == "cache"
        assert cache.cached(ORG, AGENTS[2], "") is None
