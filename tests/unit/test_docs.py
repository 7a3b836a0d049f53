"""The documentation agrees with the code: every setting is documented, every link resolves."""

from __future__ import annotations

import re
from pathlib import Path

from ibex.config import EXTRA_KNOWN, PREFIX, TABLE, known_variables

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
