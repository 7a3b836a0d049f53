"""Per-module mutation scores from a finished `just mutate` run (reads mutants/**/*.meta).

    python -m tests.mutation.report [--equivalent tests/mutation/equivalent.txt] [--survivors]

Score = killed / all mutants, with a survivor, a "no tests" mutant and a
timeout-free hang alike counted as not killed. With --equivalent, the named
mutants (one per line, ``name  # why``) are also left out of a second score.
Mutant names carry a per-function number that shifts when the function
changes: re-check the list after editing a mutated module.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 36, -24, 24, 152, 255, 37}  # failing tests, pytest errors, timeouts, type check


def _load(root: Path) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for meta in sorted(root.glob("**/*.py.meta")):
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def _module(name: str) -> str:
    """A function's mutant (`ibex.sources.memory_schema.x_to_hit__mutmut_3`) and a method's
    (`ibex.service.admission.xǁAdmissionǁgate__mutmut_8`) name their module before `.x`."""
    head = re.split(r"\.x[_ǁ]", name, maxsplit=1)[0]
    return head.rsplit(".", 1)[-1]


def _equivalent(path: Path | None) -> set[str]:
    if path is None:
        return set()
    names = set()
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.add(name)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation.report")
    parser.add_argument("--root", type=Path, default=Path("mutants"))
    parser.add_argument("--equivalent", type=Path)
    parser.add_argument("--survivors", action="store_true", help="list surviving mutants")
    args = parser.parse_args(argv)
    codes = _load(args.root)
    equivalent = _equivalent(args.equivalent)
    per: dict[str, Counter[str]] = {}
    survivors = []
    for name, code in sorted(codes.items()):
        module = _module(name)
        c = per.setdefault(module, Counter())
        c["total"] += 1
        if code is None:
            c["unchecked"] += 1
        elif code in KILLED:
            c["killed"] += 1
        else:
            c["survived" if code == 0 else "no_tests" if code in (5, 33) else "other"] += 1
            if name in equivalent:
                c["equivalent"] += 1
            else:
                survivors.append(name)
    header = (
        f"{'module':<12}{'mutants':>8}{'killed':>8}{'survived':>9}{'no tests':>9}"
        f"{'equiv':>6}{'score':>8}{'w/o equiv':>10}"
    )
    print(header)
    total: Counter[str] = Counter()
    for module, c in [*sorted(per.items()), ("TOTAL", None)]:
        if c is None:
            c = total
        else:
            total.update(c)
        checked = c["total"] - c["unchecked"]
        score = c["killed"] / checked if checked else 0.0
        rest = checked - c["equivalent"]
        score_ne = c["killed"] / rest if rest else 0.0
        print(
            f"{module:<12}{c['total']:>8}{c['killed']:>8}{c['survived']:>9}{c['no_tests']:>9}"
            f"{c['equivalent']:>6}{score:>8.1%}{score_ne:>10.1%}"
            + (f"  ({c['unchecked']} not checked)" if c["unchecked"] else "")
        )
    if args.survivors:
        print("\nsurvivors (not listed as equivalent):")
        for name in survivors:
            print("  " + name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
