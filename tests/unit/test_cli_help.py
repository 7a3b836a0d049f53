"""Every `ibex` option with a default shows it in `--help`, in every subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from ibex.cli import build_parser


def parsers(
    parser: argparse.ArgumentParser, name: str = "ibex"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_every_default_is_in_the_help() -> None:
    checked = 0
    for name, parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            # Unset (None), off (False), empty: nothing to show.
            if action.default in (None, False, [], "", argparse.SUPPRESS):
                continue
            assert f"(default: {action.default})" in text, (name, action.option_strings)
            checked += 1
    assert checked >= 20  # every subcommand's options, not a parser that lost them


def test_every_command_is_registered() -> None:
    names = {name for name, _ in parsers(build_parser())}
    assert {
        "ibex serve", "ibex assemble", "ibex feedback", "ibex config", "ibex check",
        "ibex health", "ibex search", "ibex directive get", "ibex directive put",
    } <= names  # fmt: skip
