"""The operator's commands (`ibex --version`, `health`, `search`, `directive get|put`) and the
facts `ibex assemble` shows, run as `python -m ibex` against a real daemon and Redis."""

from __future__ import annotations

import json
import socket
import tomllib
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio_asyncio

from ibex.assembly.structs import Directive
from ibex.config import load_settings
from ibex.service.root import redis_directive_source
from ibex.testing.grpc_harness import (
    AGENT,
    ORG,
    ROOT,
    RunningDaemon,
    free_port,
    in_thread,
    run_cli,
    running_daemon,
)
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from ibex.testing.redis_server import RedisServer
from ibex.testing.redis_topology import MASTER_NAME, ClusterSetup, SentinelSetup

SAMPLE = json.loads((ROOT / "ibex/data/sample_memories.json").read_text())
CATALOG = json.loads((ROOT / "ibex/data/catalog.json").read_text())
SERVICE = "ibex.context.v1.ContextAssemblyService"
KEY = f"{ORG}:directive:{AGENT}"
DIRECTIVE = "Answer in French. Never promise a deploy date."
VERSION = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
# Generous branch budgets: these tests are about what the CLI shows, not about latency,
# so a busy machine still gets every branch's real outcome.
RELAXED: dict[str, Any] = dict(
    timeout=2.0, deadline=2.0, directive_timeout=2.0, hot_timeout=2.0, cold_timeout=2.0
)


OTHER_TENANT_MEMORY = next(  # the sample's hit of another tenant, never to be shown
    m["id"]
    for a in SAMPLE["agents"]
    if a["agent_id"] == AGENT
    for m in a["memories"]
    if m.get("agent_id", AGENT) != AGENT or m.get("org_id", ORG) != ORG
)


# -- --version and --help ----------------------------------------------------------------------


async def test_version_names_the_distribution_version_and_the_interfaces() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = await in_thread(run_cli, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        f"{project['name']} {project['version']} "
        "(gRPC API ibex.context.v1, directive envelope v1)\n"
    )


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (["assemble"], ["(default: 127.0.0.1:9092)", "(default: gpt-4o)", "(default: 2.0)"]),
        (["feedback"], ["(default: 127.0.0.1:9092)", f"(default: {ORG})"]),
        (["health"], ["(default: 127.0.0.1:9092)", "(default: '')", "(default: 2.0)"]),
        (["search"], ["(default: 127.0.0.1:9092)", f"(default: {AGENT})", "(default: 0.0)"]),
        (["directive", "put"], ["(default: system_first)", "(default: 0)", "new random UUID"]),
        (["directive", "get"], [f"(default: {ORG})", f"(default: {AGENT})"]),
    ],
)
async def test_help_shows_every_default(command: list[str], shown: list[str]) -> None:
    out = await in_thread(run_cli, *command, "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for default in shown:
        assert default in text, (default, out.stdout)


# -- health ------------------------------------------------------------------------------------


async def test_health_exits_0_only_when_serving() -> None:
    async with running_daemon() as d:
        serving = await in_thread(run_cli, "health", "--addr", d.target)
        assert (serving.returncode, serving.stdout, serving.stderr) == (0, "SERVING\n", "")
        named = await in_thread(run_cli, "health", "--addr", d.target, "--service", SERVICE)
        assert (named.returncode, named.stdout) == (0, "SERVING\n")

        d.daemon.health_status.set(False)  # as while draining
        down = await in_thread(run_cli, "health", "--addr", d.target)
        assert down.returncode == 1
        assert down.stdout == ""
        assert down.stderr == f"ibex health: {d.target}: NOT_SERVING\n"

        unknown = await in_thread(run_cli, "health", "--addr", d.target, "--service", "nope")
        assert unknown.returncode == 1
        assert unknown.stderr.count("\n") == 1
        assert "unknown service 'nope'" in unknown.stderr and SERVICE in unknown.stderr


async def test_health_of_an_address_nobody_listens_on_is_one_line_and_exit_3() -> None:
    addr = f"127.0.0.1:{free_port()}"
    out = await in_thread(run_cli, "health", "--addr", addr)
    assert out.returncode == 3
    assert out.stdout == ""
    assert out.stderr.startswith(f"ibex health: cannot reach {addr}: ")
    assert out.stderr.count("\n") == 1  # one line, no traceback


async def test_health_of_a_listener_that_never_answers_is_one_line_and_exit_3() -> None:
    """The kernel accepts the connection, nothing speaks HTTP/2: no answer in --timeout."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        addr = f"127.0.0.1:{mute.getsockname()[1]}"
        out = await in_thread(run_cli, "health", "--addr", addr, "--timeout", "0.5")
    assert out.returncode == 3
    assert out.stderr == f"ibex health: {addr}: no answer within 0.5s\n"


async def test_a_malformed_address_is_a_usage_error() -> None:
    out = await in_thread(run_cli, "health", "--addr", "localhost")
    assert out.returncode == 2
    assert "--addr" in out.stderr and "host:port" in out.stderr
    assert "Traceback" not in out.stderr
    missing = await in_thread(run_cli, "health", "--ca", "/nonexistent/ca.pem")
    assert missing.returncode == 2
    assert missing.stderr == (
        "ibex health: --ca/--cert/--key: No such file or directory (PEM files)\n"
    )


# -- search ------------------------------------------------------------------------------------


def stock_search(target: str, **fields: Any) -> Any:
    """SearchMemories from the stock grpcio client: what the CLI must show."""
    with grpc.insecure_channel(target) as channel:
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        request = context_pb2.SearchMemoriesRequest(org_id=ORG, agent_id=AGENT, **fields)
        return stub.SearchMemories(request, timeout=10)


async def test_search_prints_the_memories_as_a_table_and_as_json() -> None:
    query = "deploy the billing service to production"
    async with running_daemon() as d:
        expected = await in_thread(stock_search, d.target, query=query, limit=50)
        table = await in_thread(
            run_cli, "search", "--addr", d.target, "--query", query, "--limit", "50"
        )
        as_json = await in_thread(
            run_cli, "search", "--addr", d.target, "--query", query, "--limit", "50", "--json"
        )
    assert expected.memories  # the sample has memories for this query
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith(
        f"{len(expected.memories)} memories of {expected.total_candidates} candidates ("
    )
    assert lines[1].split() == ["id", "score", "conf", "category", "content"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (m.id, f"{m.composite_score:.3f}", f"{m.confidence:.2f}", m.category)
        for m in expected.memories
    ]
    assert OTHER_TENANT_MEMORY not in table.stdout
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert [m["id"] for m in body["memories"]] == [m.id for m in expected.memories]
    assert body["memories"][0]["content"] == expected.memories[0].content


async def test_search_passes_every_filter_and_shows_refusals() -> None:
    query = "deploy the billing service to production"
    fields = dict(
        query=query,
        limit=3,
        min_similarity=0.05,
        categories=["procedural", "factual"],
        tags=["deploy"],
        session_id="s-1",
    )
    async with running_daemon() as d:
        expected = await in_thread(stock_search, d.target, **fields)
        out = await in_thread(
            run_cli,
            "search", "--addr", d.target, "--query", query, "--limit", "3",
            "--min-similarity", "0.05", "--category", "procedural", "--category", "factual",
            "--tag", "deploy", "--session", "s-1", "--json",
        )  # fmt: skip
        bad = await in_thread(
            run_cli, "search", "--addr", d.target, "--query", query, "--min-similarity", "2"
        )
    assert out.returncode == 0, out.stderr
    assert expected.memories
    assert [m["id"] for m in json.loads(out.stdout)["memories"]] == [
        m.id for m in expected.memories
    ]
    assert bad.returncode == 1
    assert bad.stderr == (
        "ibex search: INVALID_ARGUMENT: limit: must be >= 0 and min_similarity in [0, 1]\n"
    )


async def test_search_without_a_daemon_says_so_in_one_line() -> None:
    addr = f"127.0.0.1:{free_port()}"
    out = await in_thread(run_cli, "search", "--addr", addr, "--query", "deploy")
    assert out.returncode == 1
    assert out.stderr.startswith(f"ibex search: cannot reach {addr}: ")
    assert out.stderr.count("\n") == 1


async def test_feedback_without_a_daemon_says_so_in_one_line() -> None:
    addr = f"127.0.0.1:{free_port()}"
    out = await in_thread(
        run_cli, "feedback", "--addr", addr, "--memory", str(uuid.uuid4()), "--feedback", "neutral"
    )
    assert out.returncode == 1
    assert out.stderr.startswith(f"ibex feedback: cannot reach {addr}: ")
    assert out.stderr.count("\n") == 1


# -- unknown model -----------------------------------------------------------------------------


async def test_an_unknown_model_error_lists_the_known_models_and_the_catalog_setting() -> None:
    async with running_daemon() as d:
        out = await in_thread(run_cli, "assemble", "--addr", d.target, "--model", "gpt-9")
    assert out.returncode == 1
    known = ", ".join(sorted(CATALOG["models"]))
    assert out.stderr == (
        "ibex assemble: INVALID_ARGUMENT: model: unknown model 'gpt-9' and available_tokens "
        f"not set; known models: {known} (a dated id resolves to the known id it starts "
        "with); add models with IBEX_CONTEXT_CATALOG_PATH, or send available_tokens\n"
    )


# -- directive get / put -----------------------------------------------------------------------


def redis_env(redis: RedisServer) -> dict[str, str]:
    return {"IBEX_CONTEXT_REDIS_URL": redis.url}


async def test_directive_put_then_get_then_assemble_uses_it(redis_server: RedisServer) -> None:
    env = redis_env(redis_server)
    put = await in_thread(
        run_cli,
        "directive", "put", "--content", DIRECTIVE, "--version-id", VERSION,
        "--injection-mode", "system_append",
        env=env,
    )  # fmt: skip
    assert put.returncode == 0, put.stderr
    assert put.stdout.startswith(f"put {KEY}: version_id {VERSION}")
    # The value is the documented envelope (contract section 3), byte for byte JSON.
    stored = json.loads(redis_server.command("GET", KEY))
    assert stored == {
        "v": 1,
        "content": DIRECTIVE,
        "injection_mode": "system_append",
        "version_id": VERSION,
    }

    got = await in_thread(run_cli, "directive", "get", env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        f"key: {KEY}",
        f"version_id: {VERSION}",
        "injection_mode: system_append",
        f"bytes: {len(json.dumps(stored, separators=(',', ':')))}",
        "content:",
        DIRECTIVE,
    ]
    as_json = await in_thread(run_cli, "directive", "get", "--json", env=env)
    assert json.loads(as_json.stdout) == stored

    async with running_daemon(redis_url=redis_server.url, **RELAXED) as d:
        shown = await _assemble(d)
    assert DIRECTIVE in shown
    assert "directive=success (" in shown


async def test_directive_put_reads_a_file_or_stdin_and_makes_a_version(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = redis_env(redis_server)
    text = tmp_path / "directive.txt"
    text.write_text("Be brief.\nCite the runbook.", encoding="utf-8")
    put = await in_thread(run_cli, "directive", "put", "--file", str(text), env=env)
    assert put.returncode == 0, put.stderr
    got = json.loads((await in_thread(run_cli, "directive", "get", "--json", env=env)).stdout)
    assert got["content"] == "Be brief.\nCite the runbook."
    assert got["injection_mode"] == "system_first"
    assert str(uuid.UUID(got["version_id"])) == got["version_id"]  # a fresh version

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    bad = await in_thread(run_cli, "directive", "put", "--file", str(latin1), env=env)
    assert bad.returncode == 2
    assert "not UTF-8" in bad.stderr


async def test_a_plain_text_directive_is_an_error_shown_with_its_reason(
    redis_server: RedisServer,
) -> None:
    redis_server.set(KEY, "Answer in French.")
    env = redis_env(redis_server)
    got = await in_thread(run_cli, "directive", "get", env=env)
    assert got.returncode == 1
    assert got.stdout == ""
    assert got.stderr.count("\n") == 1
    assert f"{KEY}: the daemon answers directive=error (directive value: malformed JSON" in (
        got.stderr
    )
    assert "ibex directive put" in got.stderr and '"v": 1' in got.stderr
    raw = await in_thread(run_cli, "directive", "get", "--raw", env=env)
    assert raw.stdout == "Answer in French."

    async with running_daemon(redis_url=redis_server.url, **RELAXED) as d:
        shown = await _assemble(d)
    branches = next(x for x in shown.splitlines() if x.startswith("branches: "))
    assert "directive=error (" in branches
    assert "; directive value: malformed JSON or not an object)" in branches
    assert "Answer in French." not in shown


async def test_directive_get_of_a_missing_key_and_without_redis(
    redis_server: RedisServer,
) -> None:
    missing = await in_thread(run_cli, "directive", "get", env=redis_env(redis_server))
    assert missing.returncode == 3
    assert "no value at" in missing.stderr and "directive=success with no directive" in (
        missing.stderr
    )
    unset = await in_thread(run_cli, "directive", "get")
    assert unset.returncode == 2
    assert "IBEX_CONTEXT_REDIS_URL" in unset.stderr
    down = await in_thread(
        run_cli,
        "directive",
        "get",
        env={"IBEX_CONTEXT_REDIS_URL": f"redis://:pw-x@127.0.0.1:{free_port()}/0"},
    )
    assert down.returncode == 1
    assert down.stderr.startswith("ibex directive get: redis (IBEX_CONTEXT_REDIS_URL): ")
    assert "pw-x" not in down.stderr and down.stderr.count("\n") == 1


async def test_directive_put_refuses_what_the_daemon_would_not_read(
    redis_server: RedisServer,
) -> None:
    env = redis_env(redis_server)
    bad_id = await in_thread(run_cli, "directive", "put", "--content", "x", "--org", "o", env=env)
    assert bad_id.returncode == 2 and "--org and --agent must be UUIDs" in bad_id.stderr
    bad_version = await in_thread(
        run_cli, "directive", "put", "--content", "x", "--version-id", "v1", env=env
    )
    assert bad_version.returncode == 2 and "is not a UUID" in bad_version.stderr
    bad_mode = await in_thread(
        run_cli, "directive", "put", "--content", "x", "--injection-mode", "first", env=env
    )
    assert bad_mode.returncode == 2
    assert "'system_first', 'system_append', 'user_prepend'" in bad_mode.stderr
    assert redis_server.command("EXISTS", KEY) == b":0"  # nothing was written


async def _assemble(d: RunningDaemon) -> str:
    out = await in_thread(run_cli, "assemble", "--addr", d.target)
    assert out.returncode == 0, out.stderr
    return out.stdout


# -- directive through Sentinel and Cluster, read back by the daemon's own reader ----------------


async def _the_daemon_reads(env: dict[str, str]) -> Directive | None:
    """The directive as the daemon's composition root builds its Redis reader from `env`."""
    source, _ = redis_directive_source(load_settings(env))
    try:
        return await source.get_directive(ORG, AGENT)
    finally:
        await source.aclose()


async def test_directive_put_and_get_through_sentinel(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    """Sentinel with a password of its own, the data nodes' password and db from the URL
    (its host is never dialled), as the daemon's settings describe it."""
    setup = await trio.to_thread.run_sync(SentinelSetup, tmp_path, "data-pw", "sentinel-pw")
    try:
        env = {
            "IBEX_CONTEXT_REDIS_SENTINELS": ",".join(f"{h}:{p}" for h, p in setup.sentinels),
            "IBEX_CONTEXT_REDIS_SENTINEL_MASTER": MASTER_NAME,
            "IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
            "IBEX_CONTEXT_REDIS_URL": "redis://:data-pw@192.0.2.1:1/3",
        }
        put = await in_thread(
            run_cli, "directive", "put", "--content", DIRECTIVE, "--version-id", VERSION, env=env
        )
        assert put.returncode == 0, put.stderr
        got = await in_thread(run_cli, "directive", "get", "--json", env=env)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["content"] == DIRECTIVE
        assert await _the_daemon_reads(env) == Directive(DIRECTIVE, "system_first", VERSION)
        wrong = await in_thread(
            run_cli,
            "directive", "get",
            env={**env, "IBEX_CONTEXT_REDIS_SENTINEL_PASSWORD": "nope"},
        )  # fmt: skip
        assert wrong.returncode == 1
        assert wrong.stderr.startswith(
            f"ibex directive get: redis (sentinel master {MASTER_NAME} via "
            "IBEX_CONTEXT_REDIS_SENTINELS): "
        )
        assert "nope" not in wrong.stderr and "data-pw" not in wrong.stderr
    finally:
        await trio.to_thread.run_sync(setup.stop)


async def test_directive_put_and_get_through_a_cluster(
    tmp_path: Path, trio_asyncio_loop: trio_asyncio.TrioEventLoop
) -> None:
    setup = await trio.to_thread.run_sync(ClusterSetup, tmp_path)
    try:
        env = {"IBEX_CONTEXT_REDIS_URL": setup.seed_url, "IBEX_CONTEXT_REDIS_CLUSTER": "true"}
        put = await in_thread(
            run_cli, "directive", "put", "--content", DIRECTIVE, "--version-id", VERSION, env=env
        )
        assert put.returncode == 0, put.stderr
        got = await in_thread(run_cli, "directive", "get", env=env)
        assert got.returncode == 0, got.stderr
        assert got.stdout.splitlines()[-1] == DIRECTIVE
        assert await _the_daemon_reads(env) == Directive(DIRECTIVE, "system_first", VERSION)
    finally:
        await trio.to_thread.run_sync(setup.stop)
