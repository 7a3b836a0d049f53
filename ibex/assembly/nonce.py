"""Session-scoped nonces: the same nonce on every turn of one conversation.

A model provider caches a prompt's *prefix*: with a fresh nonce per assembly
the directive's opening tag already differs between two turns, so nothing is
ever cached. With `IBEX_CONTEXT_NONCE_KEY` set and a request naming a
`session_id`, the nonce is HMAC-SHA256(key, org | agent | session), written in
the same fixed-width decimal as `formatter.new_nonce` (so it costs the same
tokens and never changes what fits). Every replica that shares the key derives
the same nonce, so round robin across workers keeps the prefix.

What changes for safety: the nonce is no longer single-use; it is stable for
the session and anyone who sees one turn's context knows it for the next. It
stays unguessable for any *other* session (HMAC under a secret key, and the
org, agent and session all enter it), so a nonce seen in one conversation is
worth nothing in another. Within the session it was never the defence against
memory text: escaping is (a body holds no ``<`` at all, attribute values are
restricted to a safe set), so no memory, history message or tool schema can
open, close or forge an element whatever nonce it knows. The nonce only tells
the model which sections the service wrote as opposed to text the conversation
carries elsewhere (user turns, tool results), and those come from the same
session's participants, who already see its context.
"""

from __future__ import annotations

import hashlib
import hmac

#: The least key length accepted (characters): 32 random characters are well past brute force.
MIN_KEY_CHARS = 32
_DOMAIN = b"ibex-context-nonce-v1\x00"


class NonceKey:
    """The secret behind session nonces; its repr never shows the key."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the nonce key needs at least {MIN_KEY_CHARS} characters")
        self._key = key.encode("utf-8", "surrogatepass")

    def __repr__(self) -> str:
        return "NonceKey(<redacted>)"

    def nonce(self, org_id: str, agent_id: str, session_id: str, nbytes: int) -> str:
        """`nbytes` derived bytes as fixed-width decimal, like `formatter.new_nonce`.

        org and agent are canonical UUIDs (no ``|``), so ``org|agent|session``
        is unambiguous whatever the session id holds. More than 32 bytes are
        expanded with a counter block, as HKDF-Expand does.
        """
        message = f"{org_id}|{agent_id}|{session_id}".encode("utf-8", "surrogatepass")
        out = b""
        block = 0
        while len(out) < nbytes:
            out += hmac.new(self._key, _DOMAIN + bytes([block]) + message, hashlib.sha256).digest()
            block += 1
        width = len(str(2 ** (8 * nbytes) - 1))
        return f"{int.from_bytes(out[:nbytes], 'big'):0{width}d}"
