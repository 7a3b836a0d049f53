"""The wire contract: field numbers, two independent codecs agreeing, no generator drift.

The betterproto2 code (what the server runs) and the grpcio-tools pb2 code (what
stock gRPC clients such as the Go proxy run) are generated independently from the
same protos; bytes written by one must read back field-for-field in the other.
"""

from __future__ import annotations

import datetime
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from ibex._proto import google_proto_descriptor_pool
from ibex._proto.ibex.auth import v1 as bp_auth
from ibex._proto.ibex.context import v1 as bp
from ibex.assembly import structs
from ibex.service import convert
from ibex.service import pb as upb
from ibex.testing.grpcio_stubs import context_pb2 as pb
from ibex.testing.grpcio_stubs import principal_context_pb2 as pb_auth
from ibex.tools import protogen

UTC = datetime.UTC

# Contract section 1, transcribed: "number name type" per field.
CONTRACT: dict[str, str] = {
    "AssembleContextRequest": "1 agent_id string; 2 org_id string; 3 session_id string; "
    "4 query string; 5 model string; 6 directive_version_id string; 7 available_tokens int32; "
    "8 recent_messages repeated Message; 9 options AssemblyOptions; 10 request_id string; "
    "11 trace_id string; 12 span_id string; 13 principal_context PrincipalContext; "
    "14 tool_schemas repeated string",
    "AssemblyOptions": "1 skip_cold_memories bool; 2 skip_hot_memories bool; "
    "3 recency_weight float; 4 relevance_weight float; 5 usefulness_weight float; "
    "6 confidence_weight float; 7 max_memories int32; 8 reject_history_overflow bool",
    "AssembleContextResponse": "1 assembled_context string; 2 tokens_used int32; "
    "3 memories_included int32; 4 memories_used repeated MemoryUsed; 5 directive_tokens int32; "
    "6 history_tokens int32; 7 memory_tokens int32; 8 metrics AssemblyMetrics; "
    "9 request_id string; 10 trace_id string; 11 span_id string; 12 score_schema string; "
    "13 degradation_level string; 14 branches repeated BranchOutcome; 15 budget TokenBudget; "
    "16 pack PackSummary; 17 excluded repeated MemoryUsed",
    "Message": "1 role string; 2 content string",
    "AssemblyMetrics": "1 budget_calculation_ms int32; 2 directive_load_ms int32; "
    "3 hot_memory_retrieval_ms int32; 4 cold_memory_retrieval_ms int32; 5 ranking_ms int32; "
    "6 packing_ms int32; 7 formatting_ms int32; 8 total_ms int32; 9 candidates_evaluated int32",
    "MemoryUsed": "1 memory_id string; 2 composite_score float; 3 relevance_score float; "
    "4 recency_score float; 5 usefulness_score float; 6 rank int32; 7 category string; "
    "8 exclusion string; 9 similarity float; 10 confidence float; 11 token_estimate int32",
    "BranchOutcome": "1 source string; 2 status string; 3 latency_ms float; 4 detail string",
    "TokenBudget": "1 context_window int32; 2 response_reserve int32; 3 safety_buffer int32; "
    "4 directive_tokens int32; 5 messages_tokens int32; 6 tool_schema_tokens int32; "
    "7 formatter_overhead_tokens int32; 8 usable_budget int32; 9 constrained bool; "
    "10 tokenizer_family string; 11 estimate_kind string; 12 messages_dropped int32; "
    "13 messages_dropped_tokens int32",
    "PackSummary": "1 path string; 2 candidates_evaluated int32; 3 excluded_for_budget int32; "
    "4 budget_reached bool; 5 total_score double; 6 tenant_filtered int32",
    "SearchMemoriesRequest": "1 agent_id string; 2 org_id string; 3 query string; "
    "4 limit int32; 5 min_similarity float; 6 categories repeated string; "
    "7 tags repeated string; 8 session_id string; 9 principal_context PrincipalContext",
    "SearchMemoriesResponse": "1 memories repeated Memory; 2 total_candidates int32; "
    "3 search_time_ms int32",
    "Memory": "1 id string; 2 content string; 3 category string; 4 confidence float; "
    "5 composite_score float; 6 retrieval_count int32; 7 created_at string",
    "RecordMemoryFeedbackRequest": "1 memory_ids repeated string; 2 session_id string; "
    "3 trace_id string; 4 org_id string; 5 feedback string; "
    "6 principal_context PrincipalContext",
    "RecordMemoryFeedbackResponse": "1 success bool; 2 updates repeated MemoryScoreUpdate",
    "MemoryScoreUpdate": "1 memory_id string; 2 previous_score float; 3 new_score float",
    "PrincipalContext": "1 org_id string; 2 principal_id string; 3 agent_id string; "
    "4 principal_type string; 5 authz_snapshot_id string; 6 authz_snapshot_digest string; "
    "7 authority string; 8 issued_at Timestamp; 9 expires_at Timestamp; 10 request_id string; "
    "11 trace_id string; 12 source string; 13 permissions int64; 14 token_id string",
    "PrincipalContextProof": "1 context PrincipalContext; 2 signature_algorithm string; "
    "3 signature bytes; 4 key_id string",
}

_SCALAR_NAMES = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_DOUBLE: "double",
}


def _describe(descriptor: Descriptor) -> str:
    parts = []
    for field in sorted(descriptor.fields, key=lambda f: f.number):
        kind = field.message_type.name if field.message_type else _SCALAR_NAMES[field.type]
        repeated = "repeated " if field.is_repeated else ""
        parts.append(f"{field.number} {field.name} {repeated}{kind}")
    return "; ".join(parts)


def _descriptor(name: str) -> Descriptor:
    module = pb_auth if name.startswith("PrincipalContext") else pb
    return module.DESCRIPTOR.message_types_by_name[name]


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_messages_match_the_contract_table(name: str) -> None:
    assert _describe(_descriptor(name)) == CONTRACT[name]


def test_every_message_is_in_the_contract_table() -> None:
    declared = {*pb.DESCRIPTOR.message_types_by_name, *pb_auth.DESCRIPTOR.message_types_by_name}
    assert declared == set(CONTRACT)


def test_service_paths_are_the_contract_paths() -> None:
    service = pb.DESCRIPTOR.services_by_name["ContextAssemblyService"]
    expected = {
        f"/ibex.context.v1.ContextAssemblyService/{m}"
        for m in ("AssembleContext", "SearchMemories", "RecordMemoryFeedback")
    }
    assert {f"/{service.full_name}/{m.name}" for m in service.methods} == expected
    assert set(bp.ContextAssemblyServiceBase().__mapping__()) == expected


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def assert_same(bp_msg: Any, pb_msg: Any, path: str) -> None:
    """Every field equal in both codecs, and every field set (so none can hide)."""
    fields = pb_msg.DESCRIPTOR.fields
    unset = {f.name for f in fields} - {f.name for f, _ in pb_msg.ListFields()}
    assert not unset, f"{path}: fixture leaves {sorted(unset)} at default"
    for field in fields:
        where = f"{path}.{field.name}"
        pb_value, bp_value = getattr(pb_msg, field.name), getattr(bp_msg, field.name)
        message = field.message_type
        if message is not None and message.full_name == "google.protobuf.Timestamp":
            assert pb_value.ToDatetime(tzinfo=UTC) == bp_value, where
        elif message is not None and field.is_repeated:
            assert len(pb_value) == len(bp_value), where
            for i, (b, p) in enumerate(zip(bp_value, pb_value, strict=True)):
                assert_same(b, p, f"{where}[{i}]")
        elif message is not None:
            assert bp_value is not None, where
            assert_same(bp_value, pb_value, where)
        elif field.is_repeated:
            assert list(pb_value) == list(bp_value), where
        elif field.type == FieldDescriptor.TYPE_FLOAT:
            assert pb_value == _f32(bp_value), where
        else:
            assert pb_value == bp_value, where


_ISSUED = datetime.datetime(2025, 3, 4, 5, 6, 7, 891000, tzinfo=UTC)


def _bp_request() -> bp.AssembleContextRequest:
    return bp.AssembleContextRequest(
        agent_id="7d2f4e18-3a9b-4f0c-8e6d-5b1a2c3d4e5f",
        org_id="0b3c8a52-6f0e-4c47-9d2a-1f6f8f6b2a11",
        session_id="session-1",
        query="what changed in the deploy?",
        model="gpt-4o",
        directive_version_id="5a8e3c2b-1d4f-4e6a-9b7c-0f1e2d3c4b5a",
        available_tokens=32000,
        recent_messages=[
            bp.Message(role="user", content="hello ✓ 日本"),
            bp.Message(role="assistant", content="hi"),
        ],
        options=bp.AssemblyOptions(
            skip_cold_memories=True,
            skip_hot_memories=True,
            recency_weight=0.25,
            relevance_weight=0.5,
            usefulness_weight=0.125,
            confidence_weight=0.1,
            max_memories=40,
            reject_history_overflow=True,
        ),
        request_id="req-1",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        principal_context=bp_auth.PrincipalContext(
            org_id="org-p",
            principal_id="principal-p",
            agent_id="agent-p",
            principal_type="service",
            authz_snapshot_id="snap-1",
            authz_snapshot_digest="sha256:abc",
            authority="proxy",
            issued_at=_ISSUED,
            expires_at=_ISSUED + datetime.timedelta(minutes=5),
            request_id="req-p",
            trace_id="trace-p",
            source="gateway",
            permissions=2**40 + 7,
            token_id="tok-1",
        ),
        tool_schemas=['{"name": "a"}', '{"name": "b"}'],
    )


def _pb_memory_used(i: int, exclusion: str) -> Any:
    return pb.MemoryUsed(
        memory_id=f"mem-{i}",
        composite_score=0.5 + i / 64,
        relevance_score=0.25,
        recency_score=0.75,
        usefulness_score=0.125,
        rank=i + 1,
        category="factual",
        exclusion=exclusion,
        similarity=0.875,
        confidence=0.9,
        token_estimate=100 + i,
    )


def _pb_response() -> Any:
    return pb.AssembleContextResponse(
        assembled_context="<ctx>…</ctx>",
        tokens_used=3100,
        memories_included=2,
        memories_used=[_pb_memory_used(0, "included"), _pb_memory_used(1, "included")],
        directive_tokens=400,
        history_tokens=480,
        memory_tokens=1900,
        metrics=pb.AssemblyMetrics(
            budget_calculation_ms=1,
            directive_load_ms=2,
            hot_memory_retrieval_ms=3,
            cold_memory_retrieval_ms=4,
            ranking_ms=5,
            packing_ms=6,
            formatting_ms=7,
            total_ms=8,
            candidates_evaluated=9,
        ),
        request_id="req-1",
        trace_id="trace-1",
        span_id="span-1",
        score_schema="interim_v1",
        degradation_level="L1",
        branches=[
            pb.BranchOutcome(source="directive", status="success", latency_ms=0.5, detail="ok"),
            pb.BranchOutcome(source="hot", status="error", latency_ms=3.25, detail="http 503"),
            pb.BranchOutcome(source="cold", status="timeout", latency_ms=45.0, detail="wall"),
        ],
        budget=pb.TokenBudget(
            context_window=128000,
            response_reserve=4096,
            safety_buffer=512,
            directive_tokens=400,
            messages_tokens=480,
            tool_schema_tokens=260,
            formatter_overhead_tokens=60,
            usable_budget=122192,
            constrained=True,
            tokenizer_family="o200k",
            estimate_kind="exact",
            messages_dropped=3,
            messages_dropped_tokens=912,
        ),
        pack=pb.PackSummary(
            path="greedy",
            candidates_evaluated=30,
            excluded_for_budget=18,
            budget_reached=True,
            total_score=9.876543210123,
            tenant_filtered=2,
        ),
        excluded=[_pb_memory_used(2, "budget"), _pb_memory_used(3, "truncated")],
    )


def test_request_written_by_betterproto_reads_back_in_grpcio() -> None:
    sent = _bp_request()
    received = pb.AssembleContextRequest.FromString(bytes(sent))
    assert_same(sent, received, "AssembleContextRequest")


def test_response_written_by_grpcio_reads_back_in_betterproto() -> None:
    sent = _pb_response()
    received = bp.AssembleContextResponse.parse(sent.SerializeToString())
    assert_same(received, sent, "AssembleContextResponse")
    assert received.pack is not None and received.pack.total_score == 9.876543210123


def test_response_written_by_betterproto_reads_back_in_grpcio() -> None:
    original = bp.AssembleContextResponse.parse(_pb_response().SerializeToString())
    assert_same(original, pb.AssembleContextResponse.FromString(bytes(original)), "roundtrip")


def test_descriptor_set_serves_the_service_with_its_imports() -> None:
    data = (protogen.BETTERPROTO_DIR / protogen.DESCRIPTOR_SET).read_bytes()
    names = [f.name for f in descriptor_pb2.FileDescriptorSet.FromString(data).file]
    assert names == [
        "google/protobuf/timestamp.proto",
        "ibex/auth/v1/principal_context.proto",
        "ibex/context/v1/context.proto",
    ]
    pool = google_proto_descriptor_pool.default_google_proto_descriptor_pool
    service = pool.FindServiceByName("ibex.context.v1.ContextAssemblyService")
    assert [m.name for m in service.methods] == [
        "AssembleContext",
        "SearchMemories",
        "RecordMemoryFeedback",
    ]


def test_grpcio_client_does_not_shadow_the_ibex_package() -> None:
    import ibex

    assert Path(ibex.__file__).parent == protogen.REPO_ROOT / "ibex"
    assert pb.__name__ == "ibex.testing._grpcio_client.ibex.context.v1.context_pb2"


# --- drift check ----------------------------------------------------------------------


def test_committed_generated_code_has_no_drift() -> None:
    assert protogen.check() == []


def test_drift_check_reports_tampered_missing_and_stale_files(tmp_path: Path) -> None:
    bp_dir = tmp_path / "bp"
    protogen.generate_betterproto(bp_dir)
    assert protogen.check(bp_dir) == []

    module = bp_dir / "ibex" / "context" / "v1" / "__init__.py"
    module.write_text(
        module.read_text().replace("betterproto2.field(14,", "betterproto2.field(15,")
    )
    (bp_dir / "ibex" / "auth" / "v1" / "__init__.py").unlink()
    (bp_dir / "leftover.py").write_text("")

    problems = protogen.check(bp_dir)
    assert len(problems) == 3
    assert problems[0].endswith("ibex/auth/v1/__init__.py: missing")
    assert problems[1].endswith("leftover.py: not produced by the generator (stale?)")
    assert "ibex/context/v1/__init__.py: differs" in problems[2]
    assert "betterproto2.field(14," in problems[2]


def test_drift_check_catches_a_proto_edited_without_regenerating(tmp_path: Path) -> None:
    protos = tmp_path / "protos"
    shutil.copytree(protogen.PROTO_ROOT, protos)
    proto = protos / "ibex" / "context" / "v1" / "context.proto"
    proto.write_text(
        proto.read_text().replace("string detail = 4;", "string detail = 4;\n  int32 x = 5;")
    )

    problems = protogen.check(proto_root=protos)
    assert any(p.startswith("ibex/_proto/ibex/context/v1/__init__.py: differs") for p in problems)
    assert any("descriptors.binpb: differs" in p for p in problems)


# --- the grpcio client, made on first use ------------------------------------------------


def _client_modules(tree: Path) -> dict[str, bytes]:
    return {
        p.relative_to(tree).as_posix(): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_grpcio_client_is_not_committed() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--", "ibex/testing/_grpcio_client"],
        cwd=protogen.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert tracked == ""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "ibex/testing/_grpcio_client/ibex/context/v1/context_pb2.py"],
        cwd=protogen.REPO_ROOT,
    )
    assert ignored.returncode == 0


def test_the_grpcio_client_in_use_is_made_from_the_protos_being_tested() -> None:
    stamp = (protogen.GRPCIO_DIR / protogen.GRPCIO_STAMP).read_text().strip()
    assert stamp == protogen.grpcio_source_digest()
    assert Path(pb.__file__).is_relative_to(protogen.GRPCIO_DIR)


def test_the_grpcio_client_is_made_once_and_remade_when_a_proto_changes(tmp_path: Path) -> None:
    protos, tree = tmp_path / "protos", tmp_path / "testing" / "_grpcio_client"
    shutil.copytree(protogen.PROTO_ROOT, protos)

    assert protogen.ensure_grpcio_client(tree, protos) is True
    made = _client_modules(tree)
    assert "ibex/context/v1/context_pb2_grpc.py" in made
    assert "ibex/auth/v1/principal_context_pb2.py" in made
    # The same protos: nothing is made again.
    assert protogen.ensure_grpcio_client(tree, protos) is False
    assert _client_modules(tree) == made

    proto = protos / "ibex" / "context" / "v1" / "context.proto"
    proto.write_text(
        proto.read_text().replace("string detail = 4;", "string detail = 4;\n  int32 x = 5;")
    )
    assert protogen.ensure_grpcio_client(tree, protos) is True
    remade = _client_modules(tree)
    assert remade["ibex/context/v1/context_pb2.py"] != made["ibex/context/v1/context_pb2.py"]
    assert remade[protogen.GRPCIO_STAMP] != made[protogen.GRPCIO_STAMP]
    # Only the tree and its lock stay beside it: the scratch directories are gone.
    assert sorted(p.name for p in tree.parent.iterdir()) == [
        "._grpcio_client.lock",
        "_grpcio_client",
    ]


def test_a_client_tree_with_a_damaged_stamp_is_made_again(tmp_path: Path) -> None:
    tree = tmp_path / "_grpcio_client"
    assert protogen.ensure_grpcio_client(tree) is True
    (tree / "ibex" / "context" / "v1" / "context_pb2.py").write_text("broken = True\n")
    (tree / protogen.GRPCIO_STAMP).write_text("not a digest\n")

    assert protogen.ensure_grpcio_client(tree) is True
    assert "broken" not in (tree / "ibex" / "context" / "v1" / "context_pb2.py").read_text()


def test_processes_that_start_together_share_one_client_tree(tmp_path: Path) -> None:
    tree = tmp_path / "_grpcio_client"
    code = (
        "import sys; from pathlib import Path; from ibex.tools import protogen; "
        "print(protogen.ensure_grpcio_client(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tree)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    made = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(made) == ["False", "False", "True"]
    stamp = (tree / protogen.GRPCIO_STAMP).read_text().strip()
    assert stamp == protogen.grpcio_source_digest()


def test_cli_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert protogen.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert protogen.main(["--grpcio-out", str(tmp_path)]) == 0
    generated = (tmp_path / "ibex" / "context" / "v1" / "context_pb2_grpc.py").read_text()
    assert "from ....ibex.context.v1 import context_pb2" in generated
    assert "\nfrom ibex." not in generated


@pytest.mark.parametrize(
    "struct_type", ["MemoryUsed", "AssemblyMetrics", "BranchOutcome", "TokenBudget", "PackSummary"]
)
def test_nested_response_structs_mirror_their_messages(struct_type: str) -> None:
    # ibex.service.convert sends these structs across as dicts of their fields.
    fields = [f.name for f in msgspec.structs.fields(getattr(structs, struct_type))]
    message = upb.message_class(f"ibex.context.v1.{struct_type}")
    assert fields == [f.name for f in message.DESCRIPTOR.fields]


@pytest.mark.parametrize(
    ("struct_type", "message"),
    [
        (structs.AssemblyRequest, "AssembleContextRequest"),
        (structs.SearchRequest, "SearchMemoriesRequest"),
        (structs.AssemblyOptions, "AssemblyOptions"),
        (structs.Message, "Message"),
    ],
)
def test_request_structs_name_fields_of_their_messages(struct_type: Any, message: str) -> None:
    # ibex.service.convert reads each struct field from the message field of its name.
    fields = upb.message_class(f"ibex.context.v1.{message}").DESCRIPTOR.fields_by_name
    assert set(struct_type.__struct_fields__) <= set(fields)


@pytest.mark.parametrize(
    ("struct_type", "message"),
    [
        (structs.AssemblyOptions, "AssemblyOptions"),
        (structs.AssemblyRequest, "AssembleContextRequest"),
        (structs.SearchRequest, "SearchMemoriesRequest"),
    ],
)
def test_a_field_the_caller_leaves_unset_reads_as_the_structs_default(
    struct_type: Any, message: str
) -> None:
    # convert reads an unset field (a request without `options` included) as protobuf's
    # zero value, so every default must be that zero: else a caller who sends nothing
    # would get other behaviour than the struct's default.
    empty = upb.message_class(f"ibex.context.v1.{message}")()
    for f in msgspec.structs.fields(struct_type):
        if f.default is msgspec.NODEFAULT:
            continue
        assert _plain(getattr(empty, f.name)) == _plain_default(f.default), f.name


def _plain_default(value: Any) -> Any:
    """A struct default as `_plain` reads the matching message field."""
    if isinstance(value, msgspec.Struct):
        return {name: _plain_default(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, tuple):
        return tuple(_plain_default(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """A upb field's value as plain data, each message read through its descriptor."""
    if isinstance(value, str | int | float):
        return value
    if hasattr(value, "DESCRIPTOR"):
        return {f.name: _plain(getattr(value, f.name)) for f in value.DESCRIPTOR.fields}
    return tuple(_plain(v) for v in value)


def _search_request() -> Any:
    """Every SearchMemoriesRequest field the server reads set; ids and text from `_bp_request`."""
    req = _bp_request()
    shared = {n: getattr(req, n) for n in ("agent_id", "org_id", "query", "session_id")}
    return upb.SearchMemoriesRequest(
        **shared, limit=7, min_similarity=0.5, categories=["factual", "procedural"], tags=["ops"]
    )


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (convert.request_from_proto, upb.AssembleContextRequest.FromString(bytes(_bp_request()))),
        (convert.request_from_proto, upb.AssembleContextRequest()),
        (convert.search_from_proto, _search_request()),
        (convert.search_from_proto, upb.SearchMemoriesRequest()),
    ],
    ids=["assemble", "assemble-empty", "search", "search-empty"],
)
def test_a_request_struct_holds_its_message_fields_of_the_same_name(
    read: Any, message: Any
) -> None:
    struct = read(message)
    names = struct.__struct_fields__
    assert msgspec.to_builtins(struct) == {n: _plain(getattr(message, n)) for n in names}


def test_response_to_proto_sends_every_result_field_the_message_has() -> None:
    """The result holding `_pb_response`'s figures encodes to its very bytes:
    memories_included counted, the result's tool and formatter tokens left out."""
    sent = _pb_response()
    figures = json_format.MessageToDict(sent, preserving_proto_field_name=True)
    result = msgspec.convert(
        {**figures, "tool_tokens": 260, "formatter_tokens": 60}, structs.AssemblyResult
    )
    assert convert.response_to_proto(result).SerializeToString() == sent.SerializeToString()
