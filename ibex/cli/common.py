"""What every `ibex` subcommand shares: exit statuses, the sample tenant, the help
formatter, `--version`, and the one-line usage error."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

#: The bundled sample's org and agent (ibex/data/sample_memories.json), the commands' defaults.
SAMPLE_ORG = "00000000-0000-4000-8000-000000000001"
SAMPLE_AGENT = "00000000-0000-4000-8000-0000000000a1"
DISTRIBUTION = "ibex-context"

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to every option that has a default worth showing; an unset
    option (None), an off switch (False) or an empty list shows none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or default == "":
            return action.help
        return super()._get_help_string(action)


def version_text() -> str:
    """The installed distribution's version and the interface versions it speaks."""
    from importlib.metadata import PackageNotFoundError, version

    from ibex import __version__
    from ibex.sources.directive_envelope import ENVELOPE_VERSION

    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that is not installed
        installed = __version__
    return (
        f"{DISTRIBUTION} {installed} "
        f"(gRPC API ibex.context.v1, directive envelope v{ENVELOPE_VERSION})"
    )


class VersionAction(argparse.Action):
    """`--version`: prints `version_text()`, computed only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and the interface versions, then exit")
        super().__init__(
            option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_text())
        parser.exit()


def add_tenant_flags(p: argparse.ArgumentParser, *, agent: bool = True) -> None:
    """`--org` (and `--agent`), the sample tenant by default."""
    p.add_argument("--org", default=SAMPLE_ORG, help="org UUID")
    if agent:
        p.add_argument("--agent", default=SAMPLE_AGENT, help="agent UUID")


def add_json_flag(p: argparse.ArgumentParser, what: str = "the whole response") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def usage(args: argparse.Namespace, message: str) -> int:
    """One line on stderr naming the command; the usage exit status."""
    print(f"ibex {args.command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def printable(text: str, keep: str = "") -> str:
    """`text` safe for a terminal: a control or format character (ESC sequences, bidi
    overrides) becomes U+FFFD, except those in `keep`. Memory and directive text comes
    from other systems and is shown to an operator, never executed by their terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else "\ufffd" for ch in text)
