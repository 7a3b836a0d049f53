"""`ibex.wire` exports every message of the contract by its proto name, and the server's
`ibex.service.pb` serves the very same classes."""

from __future__ import annotations

import ibex.service.pb as pb
import ibex.wire as wire


def test_every_contract_message_is_exported_by_its_name() -> None:
    context = wire.POOL.FindFileByName("ibex/context/v1/context.proto")
    names = set(context.message_types_by_name)
    assert {"Message", "AssemblyOptions", "AssembleContextRequest", "BranchOutcome"} <= names
    for name in names:
        cls = getattr(wire, name)
        assert cls.DESCRIPTOR.full_name == f"ibex.context.v1.{name}"
        assert getattr(pb, name) is cls
    assert wire.PrincipalContext.DESCRIPTOR.full_name == "ibex.auth.v1.PrincipalContext"


def test_a_request_built_from_typed_parts_round_trips() -> None:
    request = wire.AssembleContextRequest(
        org_id="o",
        recent_messages=[wire.Message(role="user", content="hi")],
        options=wire.AssemblyOptions(max_memories=3),
    )
    again = wire.AssembleContextRequest.FromString(request.SerializeToString())
    assert again.recent_messages[0].content == "hi" and again.options.max_memories == 3
