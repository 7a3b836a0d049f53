"""docs/directives.md agrees with the decoder the daemon uses (ibex.sources.directive_envelope)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ibex.assembly.structs import Directive
from ibex.errors import SourceError
from ibex.sources.directive_envelope import ENVELOPE_VERSION, MAX_VALUE_BYTES, decode_directive

PAGE = Path(__file__).resolve().parents[2] / "docs" / "directives.md"
TEXT = PAGE.read_text(encoding="utf-8")

# One value of each kind the page's table describes, keyed by the row's first cell.
EXAMPLES = {
    "plain text, or JSON that is not an object": b"Answer in French.",
    "an object without `v` or `content`": b'{"v": 1}',
    "a field of the wrong type": b'{"v": 1, "content": 5}',
    "a `version_id` that is not a UUID": b'{"v": 1, "content": "x", "version_id": "v2"}',
    "`v` other than 1": b'{"v": 7, "content": "x"}',
    "not UTF-8": b'{"v": 1, "content": "caf\xe9"}',
    "over 1 MiB": b'{"v": 1, "content": "' + b"x" * MAX_VALUE_BYTES + b'"}',
}
PLACEHOLDERS = {"`v` other than 1": "7", "over 1 MiB": str(len(EXAMPLES["over 1 MiB"]))}


def table_rows() -> dict[str, str]:
    """First cell -> second cell of the table under "What the daemon does with a value"."""
    section = TEXT.split("## What the daemon does with a value", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("value in Redis", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_table_covers_each_kind_of_value() -> None:
    assert set(table_rows()) == {"no key", "a valid envelope", *EXAMPLES}


@pytest.mark.parametrize("row", sorted(EXAMPLES))
def test_each_documented_error_detail_is_the_decoders(row: str) -> None:
    cell = table_rows()[row]
    detail = re.fullmatch(r"`error`, detail ``?(.+?)``?", cell)
    assert detail is not None, cell
    expected = detail[1].strip().replace(" N", " " + PLACEHOLDERS.get(row, "N"))
    with pytest.raises(SourceError) as info:
        decode_directive(EXAMPLES[row])
    assert str(info.value) == expected


def test_the_example_envelope_and_the_limit() -> None:
    example = re.search(r"```json\n(.+?)```", TEXT, re.DOTALL)
    assert example is not None
    raw = example[1].encode()
    fields = json.loads(raw)
    assert fields["v"] == ENVELOPE_VERSION
    assert decode_directive(raw) == Directive(
        content=fields["content"],
        injection_mode=fields["injection_mode"],
        version_id=fields["version_id"],
    )
    assert f"at most 1 MiB ({MAX_VALUE_BYTES:,} bytes)" in TEXT
    assert decode_directive(None) is None  # "no key": success without a directive
