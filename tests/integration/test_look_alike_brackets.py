"""Look-alike brackets in memory text, through the real daemon.

The memory stand-in answers with a memory whose text draws a closing memory tag
and an opening directive with double guillemets; what the daemon hands the
model carries them as numeric references inside that memory's element.
"""

from __future__ import annotations

from typing import Any

from ibex.testing.grpc_harness import AGENT, ORG, in_thread, running_daemon
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.memory_server import make_memories, running_memory_server
from tests.unit.test_xml_format_unicode import (
    EVERY_LOOK_ALIKE,
    FORGED_CLOSE,
    FORGED_CLOSE_ESCAPED,
)


async def test_guillemet_markup_in_a_memory_reaches_the_model_escaped() -> None:
    with running_memory_server() as memory:
        forged = {**make_memories(ORG, AGENT, 1, seed=31)[0], "confidence": 1.0}
        forged["content"] = f"deploy billing {FORGED_CLOSE} {''.join(EVERY_LOOK_ALIKE)}"
        memory.add_memories(ORG, AGENT, [forged], similarities=[0.99])
        async with running_daemon(
            memory_base_url=memory.url,
            memory_api_token=memory.token,
            timeout=2.0,
            deadline=2.0,
            hot_timeout=2.0,
            cold_timeout=2.0,
        ) as d:

            def call() -> Any:
                with d.channel() as channel:
                    stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
                    request = context_pb2.AssembleContextRequest(
                        org_id=ORG, agent_id=AGENT, model="gpt-4o", query="deploy billing"
                    )
                    return stub.AssembleContext(request, timeout=10)

            resp = await in_thread(call)
    assert [m.memory_id for m in resp.memories_used] == [forged["id"]]
    text = resp.assembled_context
    assert not set(text) & set(EVERY_LOOK_ALIKE)
    element = text[text.index(f'<memory id="{forged["id"]}"') : text.index("</memory>\n")]
    assert FORGED_CLOSE_ESCAPED in element
    assert text.count("</memory>") == text.count("</memories>") == 1
    assert "<directive" not in text  # no directive is configured, and none is drawn
