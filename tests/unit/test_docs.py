"""The documentation agrees with the code: every setting is documented, every link resolves."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ibex.config import EXTRA_KNOWN, PREFIX, TABLE, WITH_UNIT, known_variables

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
ENV_EXAMPLE = ROOT / "deploy" / "ibex-context.env.example"


def documented_variables() -> set[str]:
    """Variable names in the first column of configuration.md's tables."""
    names: set[str] = set()
    for line in CONFIGURATION.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `IBEX_CONTEXT_"):
            first = line.split("|")[1]
            names.update(re.findall(r"IBEX_CONTEXT_[A-Z0-9_]+", first))
    return names


def documented_defaults() -> dict[str, str]:
    """Variable -> the text of its row's default column in configuration.md."""
    cells: dict[str, str] = {}
    for line in CONFIGURATION.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `IBEX_CONTEXT_"):
            first, default = line.split("|")[1:3]
            for name in re.findall(r"IBEX_CONTEXT_[A-Z0-9_]+", first):
                cells[name] = default.strip()
    return cells


def documented_value(variable: str, cell: str) -> Any:
    """A default cell read as the variable's parser reads a value: `—` is none (off),
    `16 MiB` a byte count, anything else (a remark in brackets dropped) goes through the
    variable's own parser, so a cell in the wrong unit reads as another value or fails."""
    if cell.startswith("—"):
        return None
    if m := re.fullmatch(r"(\d+) (MiB|GiB)", cell):
        return int(m[1]) * 1024 ** {"MiB": 2, "GiB": 3}[m[2]]
    return TABLE[variable].parse(variable, re.sub(r"\s*\(.*\)$", "", cell))


#: The variables whose default the composition root computes at start, or a bundled file
#: gives: the docs say how, in these words.
COMPUTED = {
    "MAX_CALLER_IN_FLIGHT_BYTES": "a quarter of MAX_IN_FLIGHT_BYTES",
    "MAX_ORG_ASSEMBLIES": "half of MAX_CONCURRENT_ASSEMBLIES (at least 1)",
    "MAX_CONNECTIONS": "min(1024, NOFILE − 64)",
    "MAX_CONNECTIONS_PER_PEER": "MAX_CONNECTIONS / 4 (at least 1)",
    "MAX_CONNECTION_AGE_GRACE": "DRAIN_GRACE",
    "LOCAL_SOURCE_PATH": "bundled sample",
    "TIKTOKEN_DIR": "bundled",
}


@pytest.mark.parametrize("variable", list(TABLE))
def test_the_documented_default_is_the_declared_default(variable: str) -> None:
    """Every default is written once, beside the variable's declaration; the docs table
    must show that value, in a unit the variable's parser reads back to it."""
    row, cell = TABLE[variable], documented_defaults()[variable]
    if row.suffix in COMPUTED:
        assert row.default is None and cell == COMPUTED[row.suffix]
        return
    default = None if row.default in ((), "") else row.default
    shown = documented_value(variable, cell)
    assert shown == (default if not isinstance(default, float) else pytest.approx(default))


def test_the_durations_rule_names_the_settings_that_refuse_a_bare_number() -> None:
    """configuration.md's rule for durations lists exactly the settings whose parser
    refuses a bare number (each also shows its default with a unit: the test above)."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    rule = text[text.index("**Durations**") :].split("\n\n", 1)[0]
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", rule))
    refusing = {row.suffix for row in TABLE.values() if row.parse is WITH_UNIT}
    assert named == refusing


def test_every_setting_the_parser_reads_is_documented_and_nothing_else() -> None:
    known = known_variables()
    documented = documented_variables()
    assert sorted(known - documented) == [], "settings missing from docs/configuration.md"
    assert sorted(documented - known) == [], "docs/configuration.md names unknown settings"


def test_env_example_docs_table_and_settings_table_agree() -> None:
    """The settings table (ibex.config.Settings) is the one list: the env example names
    exactly its variables, the docs table those plus the CLI client's own."""
    table = {PREFIX + row.suffix for row in TABLE.values()}
    example = set(
        re.findall(r"^(?:# )?(IBEX_CONTEXT_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.MULTILINE)
    )
    assert sorted(table - example) == [], "settings missing from the env example"
    assert sorted(example - table) == [], "the env example names unknown settings"
    assert documented_variables() == table | {PREFIX + s for s in EXTRA_KNOWN}


def test_relative_links_in_readme_and_docs_resolve() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    assert len(pages) >= 7
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
