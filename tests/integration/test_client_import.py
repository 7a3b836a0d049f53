"""`ibex.client` from an asyncio proxy: it loads no server module and no Trio, and leaves the
process's event loop and event-loop policy as it found them, also across a real call."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ibex.testing.grpc_harness import AGENT, ORG, ROOT, child_env, in_thread, running_daemon

# A proxy's process: its own policy (or asyncio's default), then `import ibex.client`, then
# a call on its running loop. It reports what changed, as JSON.
PROXY = """
import asyncio, json, sys

target, custom = sys.argv[1], sys.argv[2] == "custom"
if custom:
    class ProxyPolicy(asyncio.DefaultEventLoopPolicy):
        pass
    asyncio.set_event_loop_policy(ProxyPolicy())
policy = asyncio.get_event_loop_policy()
functions = (asyncio.get_event_loop_policy, asyncio.set_event_loop_policy, asyncio.new_event_loop)


def server_modules():
    roots = {"trio", "trio_asyncio", "redis", "httptools", "prometheus_client"}
    ours = {"ibex.service", "ibex.sources", "ibex.ops", "ibex.cli", "ibex.config"}
    return sorted(
        m for m in sys.modules
        if m.split(".")[0] in roots or ".".join(m.split(".")[:2]) in ours
    )


import ibex.client

after_import = server_modules()

from ibex.wire import AssembleContextRequest, AssemblyOptions, Message

# Made at import time, outside any loop, as a proxy module might: no loop may be created
# and installed for the process by that (asyncio's policy keeps it in `_local._loop`).
client = ibex.client.ContextClient(addresses=[target], deadline=5.0)
no_loop_installed = policy._local._loop is None


async def main():
    loop = asyncio.get_running_loop()
    async with client:
        request = AssembleContextRequest(
            org_id=sys.argv[3], agent_id=sys.argv[4], model="gpt-4o", query="deploy billing",
            recent_messages=[Message(role="user", content="Can I deploy on Friday?")],
            options=AssemblyOptions(max_memories=3),
        )
        result = await client.assemble(request)
        health = await client.health()
    return {
        "status": result.status,
        "health": health,
        "memories": result.response.memories_included if result.response else -1,
        "same_loop": asyncio.get_running_loop() is loop,
        "same_policy_inside": asyncio.get_event_loop_policy() is policy,
    }


report = asyncio.run(main())
report.update(
    no_loop_installed=no_loop_installed,
    after_import=after_import,
    after_call=server_modules(),
    same_policy=asyncio.get_event_loop_policy() is policy,
    same_functions=functions == (
        asyncio.get_event_loop_policy, asyncio.set_event_loop_policy, asyncio.new_event_loop
    ),
)
print(json.dumps(report))
"""


def run_proxy(target: str, policy: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROXY, target, policy, ORG, AGENT],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, object] = json.loads(out.stdout)
    return report


@pytest.mark.parametrize("policy", ["default", "custom"])
async def test_the_client_leaves_an_asyncio_process_as_it_found_it(policy: str) -> None:
    async with running_daemon() as d:
        report = await in_thread(run_proxy, d.target, policy)
    assert report == {
        "status": "OK",
        "health": "SERVING",
        "memories": report["memories"],
        "same_loop": True,
        "same_policy_inside": True,
        "no_loop_installed": True,
        "after_import": [],
        "after_call": [],
        "same_policy": True,
        "same_functions": True,
    }
    assert isinstance(report["memories"], int) and 1 <= report["memories"] <= 3
