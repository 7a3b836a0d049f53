"""The `ibex` command: `main` parses the arguments and runs one subcommand.

Subcommands, one module per kind:

- `ibex.cli.serve`: serve, config, check (this host's daemon and its settings);
- `ibex.cli.calls`: assemble, feedback, health, search (a running daemon, through
  `ibex.client`, never loading the server), printed by `ibex.cli.render`;
- `ibex.cli.directive`: directive get|put (the directive cache in Redis, in the
  daemon's format).

Exit statuses (`ibex.cli.common`): 0 success; 1 the daemon or Redis answered an
error (or a value the daemon would refuse); 2 a usage or configuration error;
3 nothing to show (no answer from the daemon, no directive). `ibex serve` ends
with a start-up error's own status (docs/operations.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ibex.cli import calls, directive, serve
from ibex.cli.common import SAMPLE_AGENT, SAMPLE_ORG, DefaultsFormatter, VersionAction

__all__ = ["SAMPLE_AGENT", "SAMPLE_ORG", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """`ibex` and every subcommand, each option's default shown in its `--help`."""
    p = argparse.ArgumentParser(
        prog="ibex", description="Ibex context-assembly daemon", formatter_class=DefaultsFormatter
    )
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    for commands in (serve, calls, directive):
        commands.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
