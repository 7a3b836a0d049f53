"""What a worker hands its successor: the agents whose directives it served recently.

A new worker's directive cache is empty, so its first call for each agent
reads Redis inside the 5 ms directive budget, at the moment a reload starts
the next worker and takes a core. Each worker tells the supervisor, over its
notify socket (`X_IBEX_DIRECTIVES=...`, a field systemd would ignore), the
keys its cache served most recently; the supervisor gives a new worker the
union of every live worker's keys in its environment (`IBEX_WORKER_DIRECTIVES`),
and the new worker reads them in one batched read before it says READY=1.

Both ends bound what they take: at most `MAX_KEYS` keys and `MAX_BYTES`
bytes (one datagram), each id a UUID as a directive's key needs (one key that
is not would fail the batched read of all). A key that does not parse is
dropped, never an error: the handover only saves reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

__all__ = ["ENV", "MAX_BYTES", "MAX_KEYS", "NOTIFY_FIELD", "decode", "encode", "merge"]

ENV: Final = "IBEX_WORKER_DIRECTIVES"  # supervisor -> new worker (not a setting)
NOTIFY_FIELD: Final = "X_IBEX_DIRECTIVES"  # worker -> supervisor, on its notify socket
MAX_KEYS: Final = 32
# Under the supervisor's 4096-byte notify read, with the field name and other lines.
MAX_BYTES: Final = 3072
_ID: Final = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")

Key = tuple[str, str]  # (org_id, agent_id)


def encode(keys: Iterable[Key]) -> str:
    """`org/agent` tokens separated by spaces, in the order given, within both bounds."""
    out: list[str] = []
    size = 0
    for key in merge(keys):
        token = f"{key[0]}/{key[1]}"
        if size + len(token) + 1 > MAX_BYTES:
            break
        out.append(token)
        size += len(token) + 1
    return " ".join(out)


def decode(text: str) -> list[Key]:
    """The keys of `encode`'s text; malformed tokens dropped, both bounds applied."""
    keys: list[Key] = []
    for token in text[:MAX_BYTES].split():
        org, sep, agent = token.partition("/")
        if sep and _ID.fullmatch(org) and _ID.fullmatch(agent):
            keys.append((org, agent))
    return merge(keys)


def merge(*lists: Iterable[Key]) -> list[Key]:
    """The keys of every list, first come first kept, no repeats, at most `MAX_KEYS`."""
    seen: dict[Key, None] = {}
    for keys in lists:
        for key in keys:
            if len(seen) >= MAX_KEYS:
                return list(seen)
            seen.setdefault(key, None)
    return list(seen)
