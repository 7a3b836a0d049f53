"""The modules README.md and docs/ name exist: a path, a dotted name, a mutation-table row.

A rename that leaves a doc naming the old module sends a reader to nothing;
these fail on the first such name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("assembly", "cli", "config", "ops", "service", "sources", "testing", "tools")
# Every module's file name, for the docs that name a module by its last part.
MODULE_NAMES = {p.stem for p in (ROOT / "ibex").rglob("*.py")}


def _quoted(pattern: str) -> list[tuple[str, str]]:
    found = {(doc.name, m) for doc in DOCS for m in re.findall(pattern, doc.read_text())}
    return sorted(found)


@pytest.mark.parametrize(("doc", "path"), _quoted(r"\bibex/[\w/]+\.py\b"))
def test_a_quoted_module_path_exists(doc: str, path: str) -> None:
    assert (ROOT / path).is_file(), f"{doc} names {path}, which does not exist"


@pytest.mark.parametrize(
    ("doc", "name"), _quoted(r"`(ibex\.(?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")
)
def test_a_dotted_module_name_exists(doc: str, name: str) -> None:
    """`ibex.service.root` or `ibex.service.root.uses_local_sample`: the longest module
    prefix exists, and a name after it is defined there."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[cut:]
            break
    else:
        pytest.fail(f"{doc} names {name}: no such module")
    if rest:
        defined = rf"^\s*(?:async def|def|class)\s+{rest[0]}\b|^\s*{rest[0]}\b.*="
        assert re.search(defined, module.read_text(), re.MULTILINE), (
            f"{doc} names {name}: {module.relative_to(ROOT)} defines no {rest[0]}"
        )


def test_the_mutation_tables_name_modules_that_exist() -> None:
    """docs/testing.md's score rows (`| module | mutants |`) and equivalent-mutant rows
    (`| \\`module.function\\` line |`) name today's modules."""
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = re.findall(r"^\| ([a-z_ +]+) \| [\d,]+ \|", text, re.MULTILINE)
    named = [n.strip() for row in rows for n in row.split("+")]
    named += re.findall(r"^\| `([a-z_]+)\.", text, re.MULTILINE)
    assert rows, "no mutation table found in docs/testing.md"
    assert [n for n in named if n not in MODULE_NAMES] == []
