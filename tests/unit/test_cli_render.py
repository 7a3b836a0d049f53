"""What `ibex search` and `ibex directive get` print of text that comes from other systems."""

from __future__ import annotations

from ibex.cli.common import printable
from ibex.cli.render import render_search
from ibex.wire import Memory, SearchMemoriesResponse


def test_control_and_format_characters_never_reach_the_terminal() -> None:
    hostile = "ok\x1b[2J\x1b]0;owned\x07 \u202eevil\u200b"
    assert printable(hostile) == "ok\ufffd[2J\ufffd]0;owned\ufffd \ufffdevil\ufffd"
    assert printable("line one\nline two\tend", keep="\n\t") == "line one\nline two\tend"
    assert printable("plain text, ünïcödé") == "plain text, ünïcödé"


def test_a_search_row_is_one_line_of_cut_and_cleaned_text() -> None:
    response = SearchMemoriesResponse(
        memories=[
            Memory(
                id="10000000-0000-4000-8000-000000000001",
                content="Deploy\nwith care:\x1b[31m red " + "x" * 100,
                category="procedural\x1b",
                confidence=0.9,
                composite_score=0.75,
            )
        ],
        total_candidates=4,
        search_time_ms=2,
    )
    lines = render_search(response, width=30).splitlines()
    assert lines[0] == "1 memories of 4 candidates (2 ms)"
    assert lines[1].split() == ["id", "score", "conf", "category", "content"]
    assert len(lines) == 3
    row = lines[2]
    assert row.split()[:4] == [
        "10000000-0000-4000-8000-000000000001", "0.750", "0.90", "procedural\ufffd",
    ]  # fmt: skip
    assert row.endswith(" Deploy with care:\ufffd[31m red xx…")  # 30 characters
    assert "\x1b" not in row
