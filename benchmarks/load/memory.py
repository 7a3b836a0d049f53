"""The memory stand-in for the load benchmark, run as its own process.

`ibex.testing.memory_server.FakeMemoryServer` serves one list per agent to both
endpoints; the benchmark wants distinct hot and cold sets (20 hot + 10 cold per
tenant), so this subclass serves items by their `source` and caches each
encoded answer: the stand-in shares the 2-core box with the daemon, and every
millisecond it spends encoding JSON is a millisecond the daemon does not get.

Control is a line protocol on stdin (`stats`, `latency hot|cold <ms>`), one
JSON line back per command; stdin EOF stops the process.

    python -m benchmarks.load.memory --tenants 4
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from ibex.testing.memory_server import (
    DEFAULT_TOKEN,
    FakeMemoryServer,
    freeze_heap,
    make_memories,
)

HOT_PER_TENANT = 20
COLD_PER_TENANT = 10
HOT_SOURCE = "hot"
COLD_SOURCE = "vector"


def tenants(n: int) -> list[tuple[str, str]]:
    """Deterministic (org_id, agent_id) pairs, lower-case canonical UUIDs."""
    return [
        (
            str(uuid.UUID(int=0x0B3C8A52_6F0E_4C47_9D2A_1F6F8F6B0000 + i, version=4)),
            str(uuid.UUID(int=0x7D2F4E18_3A9B_4F0C_8E6D_5B1A2C3D0000 + i, version=4)),
        )
        for i in range(n)
    ]


class SplitMemoryServer(FakeMemoryServer):
    """Hot answers carry only hot items, cold answers only cold ones; answers are cached."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._answers: dict[tuple[str, str, int, float], bytes] = {}

    def _results(self, name: str, agent_id: str, limit: int, min_conf: float) -> bytes:
        key = (name, agent_id, limit, min_conf)
        cached = self._answers.get(key)
        if cached is not None:
            return cached
        want = HOT_SOURCE if name == "hot" else COLD_SOURCE
        with self._lock:
            items = [i for i in self._items.get(agent_id, ()) if i["source"] == want]
        items = [i for i in items if float(i["memory"]["confidence"]) >= min_conf]
        field = "confidence" if name == "hot" else "similarity"
        items.sort(
            key=lambda i: (
                -float(i["memory"][field] if field == "confidence" else i[field]),
                i["memory"]["id"],
            )
        )
        results = [{**item, "rank": n} for n, item in enumerate(items[:limit], start=1)]
        payload = json.dumps({"data": {"results": results}}, ensure_ascii=False).encode()
        self._answers[key] = payload
        return payload


def build(args: argparse.Namespace) -> SplitMemoryServer:
    server = SplitMemoryServer(token=args.token, host="127.0.0.1", port=args.port, seed=args.seed)
    server.hot.latency_ms, server.cold.latency_ms = args.hot_latency_ms, args.cold_latency_ms
    for i, (org, agent) in enumerate(tenants(args.tenants)):
        memories = make_memories(org, agent, args.hot + args.cold, seed=args.seed + i)
        server.add_memories(org, agent, memories[: args.hot], source=HOT_SOURCE)
        server.add_memories(org, agent, memories[args.hot :], source=COLD_SOURCE)
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Memory stand-in for benchmarks.load.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=DEFAULT_TOKEN)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--hot-latency-ms", type=float, default=2.0)
    parser.add_argument("--cold-latency-ms", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hot", type=int, default=HOT_PER_TENANT, help="hot memories per tenant")
    parser.add_argument(
        "--cold", type=int, default=COLD_PER_TENANT, help="cold memories per tenant"
    )
    args = parser.parse_args(argv)
    server = build(args)
    with server:
        freeze_heap()
        print(f"memory server listening on {server.url}", flush=True)
        for line in sys.stdin:
            words = line.split()
            reply: dict[str, Any]
            if words == ["stats"]:
                reply = {
                    "requests": server.requests,
                    "open_connections": server.open_connections,
                    "accepted_connections": server.accepted_connections,
                }
            elif len(words) == 3 and words[0] == "latency" and words[1] in ("hot", "cold"):
                endpoint = server.hot if words[1] == "hot" else server.cold
                endpoint.latency_ms = float(words[2])
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {line.strip()[:40]!r}"}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
