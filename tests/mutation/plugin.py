"""pytest plugin loaded only by `just mutate` (see [tool.mutmut] in pyproject.toml).

mutmut runs the tests that reach a mutated function once per mutant, stopping
at the first failure. Two things make that affordable on a small machine
without changing any test:

* every hypothesis test runs derandomized (the same examples for every
  mutant, so a verdict is reproducible) with at most ``MAX_EXAMPLES``
  examples: a surviving mutant costs seconds instead of the minute the
  tiktoken-backed property tests take at their full example counts;
* test files that load the exact tokenizers run last, so a mutant that a
  fast unit test kills never waits for them.

The ordinary test run (`just test`, CI) never loads this plugin.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

MAX_EXAMPLES = 12
SLOW_LAST = frozenset(
    {
        "tests/unit/test_pipeline.py",
        "tests/unit/test_retrieval.py",
        "tests/unit/test_tokens.py",
    }
)


def _cap_examples(fn: object) -> None:
    current = getattr(fn, "_hypothesis_internal_use_settings", None)
    if current is None or getattr(fn, "hypothesis", None) is None:
        return
    fn._hypothesis_internal_use_settings = settings(  # type: ignore[attr-defined]
        current,
        max_examples=min(current.max_examples, MAX_EXAMPLES),
        derandomize=True,
        database=None,
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _cap_examples(getattr(item, "obj", None))
    # Stable sort: order inside each group is pytest's own.
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] in SLOW_LAST)
