"""`ibex serve --workers 2` with IBEX_CONTEXT_NONCE_KEY: round robin keeps a session's prefix.

Two worker processes, one grpcio channel balancing calls over both: every turn
of one session carries the same nonce whichever worker served it (the one
HMAC-SHA256 of the key, lifetime window, org, agent and session gives), so each turn's context
starts with the previous turn's directive, safety sentence and history. Other
sessions and calls without a session get other nonces, and the key never
reaches the log.
"""

from __future__ import annotations

import collections
import itertools
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ibex.assembly.nonce import NonceKey
from ibex.cli import SAMPLE_AGENT, SAMPLE_ORG
from ibex.testing.grpcio_stubs import context_pb2, context_pb2_grpc
from tests.integration.test_workers import ROUND_ROBIN, _supervisor, free_port_run, wait_ready

KEY = "integration-nonce-key-0123456789abcdef"
# The longest lifetime: the test's turns fall into one window but for a few seconds in 30 days.
MAX_AGE = 30 * 86400.0


@pytest.fixture
def keyed_workers(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], int, socket.socket, Path]]:
    base = free_port_run(2)
    env = {
        "IBEX_CONTEXT_WORKER_PORT_BASE": str(base),
        "IBEX_CONTEXT_NONCE_KEY": KEY,
        "IBEX_CONTEXT_NONCE_MAX_AGE": "720h",
        # The prefix compares whole contexts: a branch timed out on a loaded machine would
        # leave out the directive or memories, so give every branch time to answer.
        "IBEX_CONTEXT_TIMEOUT": "5s",
        "IBEX_CONTEXT_DEADLINE_MS": "5000",
        "IBEX_CONTEXT_DIRECTIVE_TIMEOUT_MS": "5000",
        "IBEX_CONTEXT_HOT_TIMEOUT_MS": "5000",
        "IBEX_CONTEXT_COLD_TIMEOUT_MS": "5000",
        "IBEX_CONTEXT_PIPELINE_HEADROOM_MS": "1000",
    }
    for proc, _port, _metrics, notify, log in _supervisor(tmp_path, env):
        yield proc, base, notify, log


def _nonces(text: str) -> set[str]:
    return set(re.findall(r'nonce="([0-9]+)"', text))


def test_a_sessions_turns_share_nonce_and_prefix_across_workers(
    keyed_workers: tuple[subprocess.Popen[str], int, socket.socket, Path],
) -> None:
    proc, base, notify, log_path = keyed_workers
    wait_ready(notify)
    target = f"ipv4:127.0.0.1:{base},127.0.0.1:{base + 1}"
    options = [("grpc.service_config", ROUND_ROBIN), ("grpc.enable_retries", 0)]
    expected = NonceKey(KEY, MAX_AGE).nonce(SAMPLE_ORG, SAMPLE_AGENT, "session-1", 16, time.time())
    served: collections.Counter[str] = collections.Counter()
    texts: list[str] = []
    with grpc.insecure_channel(target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = context_pb2_grpc.ContextAssemblyServiceStub(channel)
        history: list[context_pb2.Message] = []

        def call(session: str, query: str) -> str:
            request = context_pb2.AssembleContextRequest(
                org_id=SAMPLE_ORG,
                agent_id=SAMPLE_AGENT,
                model="gpt-4o",
                query=query,
                session_id=session,
                recent_messages=history,
            )
            response, rpc = stub.AssembleContext.with_call(request, timeout=10)
            served[dict(rpc.trailing_metadata())["x-ibex-worker"]] += 1
            return str(response.assembled_context)

        for turn in range(6):
            query = f"how do I deploy billing, step {turn}?"
            texts.append(call("session-1", query))
            history += [
                context_pb2.Message(role="user", content=query),
                context_pb2.Message(role="assistant", content=f"Answer {turn}: run the deploy."),
            ]
        other = call("session-2", "deploy")
        unscoped = {n for _ in range(2) for n in _nonces(call("", "deploy"))}
    assert set(served) == {"0", "1"}, served  # both workers served the session
    assert set().union(*map(_nonces, texts)) == {expected}
    for prev, cur in itertools.pairwise(texts):
        ends = [i for i in (prev.find("</history>\n"), prev.find("<memories ")) if i >= 0]
        assert cur.startswith(prev[: min(ends)])
    assert _nonces(other) and expected not in _nonces(other)
    assert len(unscoped) == 2 and expected not in unscoped
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert KEY not in log_path.read_text()
