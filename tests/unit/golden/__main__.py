"""`python -m tests.unit.golden [--update]`: report or rewrite the golden blocks."""

from __future__ import annotations

import argparse
import sys

from tests.unit.golden import CASES, path_for, read_golden, write_golden


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.unit.golden")
    parser.add_argument("--update", action="store_true", help="rewrite every golden file")
    args = parser.parse_args(argv)
    stale = []
    for name, render in CASES.items():
        current = render()
        path = path_for(name)
        if path.exists() and read_golden(name) == current:
            continue
        stale.append(name)
        if args.update:
            write_golden(name)
            print(f"updated {path}")
        else:
            print(f"differs: {path}")
    if stale and not args.update:
        print("run `python -m tests.unit.golden --update` and review the diff", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
