"""One table of figures: the results file, the generated docs table, the quote check;
and the pure parts of the h2load client (gRPC framing, its summary, status scrapes).

Expected values come from the definitions: a gRPC message is a 0 flag, a
4-byte big-endian length and the bytes; h2load prints "requests: ... N
succeeded ..." and "finished in Xs, Y req/s"; a quoted figure counts when a
current value rounds to it at the quote's own precision.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks import figures
from benchmarks.load import h2load

ROOT = Path(__file__).resolve().parents[2]


def test_docs_current_table_is_generated_from_the_results_file() -> None:
    text = figures.DOC.read_text()
    assert figures.generated(text, figures.load()) == text, (
        "docs/performance.md differs from benchmarks/figures.json: "
        "run python -m benchmarks.figures --write"
    )


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_readme_and_docs_quote_only_current_figures(path: Path) -> None:
    values = figures.current_values(figures.load())
    quotes = figures.quoted_figures(path.read_text())
    assert figures.unknown_figures(quotes, values) == []


def test_quoted_figures_skip_limits_generated_blocks_and_history() -> None:
    text = (
        "# P\n\nCPU is 2.41× the floor (target ≤ 2.0×, <= 2.5×), 598 answers/s, "
        "3.1 ms CPU per answer and 1,234 answers/s.\n"
        f"{figures.CURRENT[0]}\n| x | 9.99× |\n{figures.CURRENT[1]}\n"
        "## History\n\nold: 3.99× and 366 answers/s\n### Sub\n4.58 ms per answer\n"
    )
    assert sorted(figures.quoted_figures(text)) == sorted(["2.41", "598", "1,234", "3.1"])


def test_quoted_figures_resume_after_the_history_at_the_next_section() -> None:
    text = "## History\nold 3.99×\n## Later\nnew 1.50×\n"
    assert figures.quoted_figures(text) == ["1.50"]


def test_unknown_figures_compare_at_the_quotes_precision() -> None:
    values = [2.436, 598.4, 1234.0]
    assert figures.unknown_figures(["2.4", "2.44", "598", "1,234"], values) == []
    assert figures.unknown_figures(["2.43", "3.2", "599"], values) == ["2.43", "3.2", "599"]


def test_record_keeps_one_current_run_per_source_and_moves_the_old_one_to_history(
    tmp_path: Path,
) -> None:
    path = tmp_path / "figures.json"
    first = [figures.Figure("a.ratio", "ratio", 2.5, "×", "bench")]
    second = [figures.Figure("a.ratio", "ratio", 1.9, "×", "bench")]
    when1 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)
    when2 = dt.datetime(2026, 12, 2, 10, 30, tzinfo=dt.UTC)
    speed = {"samples": 3, "median_ms": 20.0, "max_over_min": 1.1}
    figures.record("bench", "cmd 1", speed, first, path=path, when=when1, measured="aaa")
    figures.record("bench", "cmd 2", speed, second, path=path, when=when2, measured="bbb")
    data = json.loads(path.read_text())
    current = data["current"]["bench"]
    assert (current["commit"], current["date"], current["command"]) == (
        "bbb",
        "2026-12-02 10:30 UTC",
        "cmd 2",
    )
    assert [f["value"] for f in current["figures"]] == [1.9]
    assert [(h["source"], h["commit"], h["date"]) for h in data["history"]] == [
        ("bench", "aaa", "2026-12-01 09:00 UTC")
    ]
    assert figures.current_values(data) == [1.9]
    table = figures.render_current(data)
    assert "| ratio | 1.90× | - | 1 |" in table
    assert "2026-12-02 10:30 UTC, commit bbb" in table
    assert "2026-12-01 09:00 UTC" in figures.render_history(data)


def test_splice_replaces_only_between_the_markers() -> None:
    begin, end = figures.CURRENT
    text = f"a\n{begin}\nold\n{end}\nb\n"
    assert figures.splice(text, figures.CURRENT, "new") == f"a\n{begin}\nnew\n{end}\nb\n"
    with pytest.raises(ValueError):
        figures.splice("no markers", figures.CURRENT, "x")


def test_grpc_frame_is_flag_length_and_message() -> None:
    assert h2load.grpc_frame(b"abc") == b"\x00\x00\x00\x00\x03abc"


def test_open_loop_splits_the_rate_over_connections() -> None:
    assert h2load.Load(100, clients=4).args() == ["-c", "4", "-m", "64", "--rps", "25"]
    assert h2load.Load(None, clients=4, streams=8).args() == ["-c", "4", "-m", "8"]
    with pytest.raises(ValueError):
        h2load.Load(101, clients=4).args()


H2LOAD_OUT = """\
finished in 2.00s, 99.50 req/s, 1.2MB/s
requests: 200 total, 200 started, 199 done, 198 succeeded, 1 failed, 0 errored, 0 timeout
status codes: 198 2xx, 0 3xx, 0 4xx, 1 5xx
"""


def test_parse_reads_the_summary_and_the_per_call_log() -> None:
    log = "1700000000000000\t200\t12000\n1700000000010000\t200\t30000\n1700000000020000\t503\t1\n"
    run = h2load.parse(H2LOAD_OUT, log)
    assert (run.done, run.succeeded, run.failed, run.seconds) == (199, 198, 1, 2.0)
    assert run.latency_ms == [12.0, 30.0]
    row = run.summary(0.396, {"OK": 190.0, "DEADLINE_EXCEEDED": 8.0})
    assert row["answers"] == 190
    assert row["answers_per_s"] == 95.0
    assert row["cpu_ms_per_answer"] == pytest.approx(396.0 / 190, abs=1e-3)
    assert row["statuses"] == {"OK": 190, "DEADLINE_EXCEEDED": 8}


def test_parse_refuses_output_it_does_not_understand() -> None:
    with pytest.raises(RuntimeError):
        h2load.parse("nothing useful", "")


def test_grpc_codes_come_from_the_daemons_request_counter() -> None:
    registry = CollectorRegistry()
    c = Counter("ibex_grpc_requests", "x", ["method", "code"], registry=registry)
    c.labels("AssembleContext", "OK").inc(5)
    c.labels("AssembleContext", "CANCELLED").inc(2)
    c.labels("SearchMemories", "OK").inc(7)
    before = h2load.grpc_codes(generate_latest(registry).decode())
    assert before == {"OK": 5.0, "CANCELLED": 2.0}
    c.labels("AssembleContext", "OK").inc(3)
    after = h2load.grpc_codes(generate_latest(registry).decode())
    assert h2load.code_deltas(before, after) == {"OK": 3.0}
