"""`IBEX_CONTEXT_*` names nothing reads: likely typos, each with the closest known name.

Said at start (`unknown_setting`) and by `ibex check`, which fails on one: a
misspelt variable would otherwise leave its setting at the default unseen.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from ibex.config.table import TABLE
from ibex.envvar import PREFIX

__all__ = ["EXTRA_KNOWN", "known_variables", "unknown_variables"]

#: Variables read outside `load_settings` (the CLI client's token), without the prefix.
EXTRA_KNOWN = frozenset({"CLIENT_TOKEN"})


def known_variables() -> frozenset[str]:
    """Every `IBEX_CONTEXT_*` name the daemon or the CLI reads."""
    return frozenset({*TABLE, *(PREFIX + s for s in EXTRA_KNOWN)})


def unknown_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """`IBEX_CONTEXT_*` variables nothing reads (likely typos), each with the closest known name."""
    env = os.environ if env is None else env
    known = sorted(known_variables())
    out: list[tuple[str, str | None]] = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            out.append((name, close[0] if close else None))
    return out
