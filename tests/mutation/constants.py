"""Hand-made mutants of ibex/assembly's module constants, which mutmut leaves alone.

    python -m tests.mutation.constants

mutmut 3 mutates only code inside functions, so a changed bound, default or
regex at module level is never tried. Each entry below changes one constant in
a copy of the tree (a temporary directory) and runs the fast unit tests there;
every one must be killed. An entry whose text no longer occurs is reported as
STALE: update it after editing the constant.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/unit/test_validation.py",
    "tests/unit/test_budget.py",
    "tests/unit/test_scoring.py",
    "tests/unit/test_packer.py",
    "tests/unit/test_pipeline.py",
    "tests/unit/test_xml_format.py",
    "tests/unit/test_xml_format_golden.py",
    "tests/unit/test_candidates_rules.py",
]
A = "ibex/assembly/"
MUTANTS: list[tuple[str, str, str]] = [
    (A + "budget.py", "MIN_RESPONSE_RESERVE = 500", "MIN_RESPONSE_RESERVE = 501"),
    (A + "budget.py", "MAX_RESPONSE_RESERVE = 4096", "MAX_RESPONSE_RESERVE = 4097"),
    (A + "budget.py", "RESERVE_FRACTION = 0.15", "RESERVE_FRACTION = 0.16"),
    (A + "budget.py", "CONSTRAINED_BELOW = 256", "CONSTRAINED_BELOW = 257"),
    (A + "catalog.py", "UNKNOWN_MODEL_MAX_OUTPUT = 4096", "UNKNOWN_MODEL_MAX_OUTPUT = 4097"),
    (A + "pipeline.py", "[0-9a-f]{2,160}", "[0-9a-f]{1,160}"),
    (A + "pipeline.py", "[0-9a-f]{2,160}", "[0-9a-f]{2,161}"),
    (A + "pipeline_config.py", "DEFAULT_NONCE_BYTES = 16", "DEFAULT_NONCE_BYTES = 17"),
    (A + "packer.py", "DEFAULT_FINE_CELLS = 1 << 16", "DEFAULT_FINE_CELLS = 0"),
    (A + "packer.py", "DEFAULT_BUCKET = 16", "DEFAULT_BUCKET = 8"),
    (
        A + "pipeline_config.py",
        "DEFAULT_DP_CELL_CEILING = 70 * 6251",
        "DEFAULT_DP_CELL_CEILING = 0",
    ),
    (
        A + "pipeline_config.py",
        "DEFAULT_MAX_CONSECUTIVE_SKIPS = 5",
        "DEFAULT_MAX_CONSECUTIVE_SKIPS = 4",
    ),
    (A + "scoring.py", '"episodic": 7.0', '"episodic": 8.0'),
    (A + "scoring.py", '"factual": 180.0', '"factual": 90.0'),
    (A + "scoring.py", "DEFAULT_HALF_LIFE_DAYS = 30.0", "DEFAULT_HALF_LIFE_DAYS = 31.0"),
    (A + "validation.py", "MAX_ID_LENGTH = 256", "MAX_ID_LENGTH = 257"),
    (A + "validation.py", "MAX_ROLE_LENGTH = 64", "MAX_ROLE_LENGTH = 65"),
    (A + "validation.py", "] = 512\n", "] = 513\n"),  # max_history_messages
    (A + "validation.py", "] = 1024 * 1024\n", "] = 1024 * 1025\n"),  # max_text_bytes
    (A + "validation.py", "10_000))] = 128\n", "10_000))] = 129\n"),  # max_tool_schemas
    (A + "candidates.py", "MAX_MEMORIES_HARD_CAP = 100", "MAX_MEMORIES_HARD_CAP = 101"),
    (A + "xml_format.py", '    "&<>"\n', '    "<>"\n'),  # & no longer escaped in bodies
    (A + "xml_format.py", "\\x0b-\\x1f", "\\x0e-\\x1f"),  # VT, FF, CR passed raw
    (A + "xml_format.py", "\\x7f-\\x9f", "\\x80-\\x9f"),  # DEL passed raw
    (A + "xml_format.py", "\\u2028\\u2029", "\\u2028"),
    (A + "xml_format.py", "\\u202a-\\u202e", "\\u202a-\\u202d"),
    (A + "xml_format.py", "\\u2060-\\u206f", "\\u2061-\\u206f"),  # word joiner passed raw
    (A + "xml_format.py", "[^A-Za-z0-9_.:@+\\-]", "[^A-Za-z0-9_.:@+\\- ]"),  # space allowed
    (A + "xml_format.py", '"\'": "&#39;"', '"\'": "\'"'),
    (
        A + "xml_format.py",
        'CATEGORY_ORDER = ("procedural", "factual"',
        'CATEGORY_ORDER = ("factual", "procedural"',
    ),
    (
        A + "xml_format.py",
        "version = f' version=\"{escape_attr(directive.version_id)}\"'",
        "version = ''",
    ),
    (A + "xml_format.py", '.replace("\\r\\n", "\\n")', ""),  # CRLF becomes two line ends
]


def _run_tests(cwd: Path) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, check=False).returncode


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="ibex-constants-") as tmp:
        work = Path(tmp)
        for name in ("ibex", "tests"):
            shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")
        if _run_tests(work) != 0:
            print("the unmutated copy fails its tests: nothing to compare against")
            return 2
        for rel, old, new in MUTANTS:
            path = work / rel
            src = path.read_text()
            if old not in src:
                print(f"STALE     {rel}: {old!r} not found")
                failures += 1
                continue
            path.write_text(src.replace(old, new, 1))
            try:
                killed = _run_tests(work) != 0
            finally:
                path.write_text(src)
            failures += not killed
            print(f"{'killed  ' if killed else 'SURVIVED'}  {rel}: {old!r} -> {new!r}")
    print(f"{len(MUTANTS) - failures} of {len(MUTANTS)} constant mutants killed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
