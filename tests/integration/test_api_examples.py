"""The Python examples in docs/api.md run as written against a real daemon (the bundled
sample), each in its own process as a proxy would run it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ibex.testing.grpc_harness import ROOT, child_env, in_thread, running_daemon

PAGE = ROOT / "docs" / "api.md"
DOCUMENTED_ADDR = "127.0.0.1:9092"
# Fail-open statuses: a loaded machine may answer an example with the fallback.
STATUSES = {"OK", "DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}


def examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 2, "docs/api.md: an asyncio and a Trio example"
    return blocks


def run_example(code: str, target: str) -> subprocess.CompletedProcess[str]:
    assert DOCUMENTED_ADDR in code
    return subprocess.run(
        [sys.executable, "-c", code.replace(DOCUMENTED_ADDR, target)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("index", [0, 1], ids=["asyncio", "trio"])
async def test_the_api_examples_run(index: int) -> None:
    code = examples()[index]
    assert ("asyncio.run(main())" in code) == (index == 0)
    assert ("trio.run(main)" in code) == (index == 1)
    async with running_daemon() as d:
        out = await in_thread(run_example, code, d.target)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    status = lines[0].split()
    assert status[0] == "status:" and status[1] in STATUSES, out.stdout
    if status[1] == "OK":
        # The sample answers with memories, so the example also sent its feedback.
        assert lines[-1].startswith("feedback: ") and lines[-1].endswith(" updates")
        assert int(lines[-1].split()[1]) >= 1
