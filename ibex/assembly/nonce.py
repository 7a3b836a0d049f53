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

A session nonce still has a maximum lifetime (`max_age`, IBEX_CONTEXT_NONCE_MAX_AGE,
30 minutes by default): a nonce that leaks (a tool result that gets the model to
repeat it) lets third-party text claim a service section only until it rotates.
The rotation is stateless, so every replica agrees without talking: the wall
clock is cut into windows of `max_age`, and the window's number (the *epoch*)
enters the HMAC. Each session's windows are shifted by a phase derived from the
key and the session, so sessions rotate at different moments and a provider's
caches are not all cold at once. At a window's end the next turn gets a new
nonce: its context no longer starts with the previous turn's (one cold prefix
per lifetime), and a context of an earlier window that the conversation still
carries names the old nonce, so the new safety sentence calls it forged. Two
replicas whose clocks differ by d can disagree for d around the boundary: a turn
may get the older nonce after the newer one, one more cold prefix, no harm.

A lifetime in turns would need a turn counter: the request's history is no such
counter (a caller may send a sliding window of it), and a stored one would be
state that every replica must share. The lifetime is therefore in time only.
"""

from __future__ import annotations

import hashlib
import hmac

#: The least key length accepted (characters): 32 random characters are well past brute force.
MIN_KEY_CHARS = 32
#: A session nonce's default lifetime (seconds). Short enough that a leaked nonce is worth at
#: most half an hour; long enough that the rotation costs a session one cold prefix per half
#: hour, which at a turn a minute is one turn in thirty, and providers drop an idle cached
#: prefix after minutes to an hour anyway.
DEFAULT_MAX_AGE = 1800.0
#: The bounds IBEX_CONTEXT_NONCE_MAX_AGE accepts (seconds): a minute to 30 days.
MIN_MAX_AGE = 60.0
MAX_MAX_AGE = 30 * 86400.0
_DOMAIN = b"ibex-context-nonce-v2\x00"
_PHASE_DOMAIN = b"ibex-context-nonce-phase-v1\x00"


class NonceKey:
    """The secret behind session nonces and their lifetime; its repr never shows the key."""

    __slots__ = ("_key", "_max_age_ms", "max_age")

    def __init__(self, key: str, max_age: float = DEFAULT_MAX_AGE) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the nonce key needs at least {MIN_KEY_CHARS} characters")
        if not MIN_MAX_AGE <= max_age <= MAX_MAX_AGE:
            raise ValueError(f"the nonce lifetime must be {MIN_MAX_AGE:g}..{MAX_MAX_AGE:g}s")
        self._key = key.encode("utf-8", "surrogatepass")
        self.max_age = max_age
        self._max_age_ms = round(max_age * 1000)

    def __repr__(self) -> str:
        return f"NonceKey(<redacted>, max_age={self.max_age:g})"

    def epoch(self, org_id: str, agent_id: str, session_id: str, now: float) -> int:
        """The number of the session's lifetime window holding `now` (Unix seconds).

        Windows are `max_age` long, shifted by a phase in [0, max_age) that the
        key and the session give, so sessions do not all rotate at once. Integer
        milliseconds, so every replica computes the same window from the same clock.
        """
        phase = int.from_bytes(
            self._digest(_PHASE_DOMAIN, _session(org_id, agent_id, session_id)), "big"
        )
        return (int(now * 1000) + phase % self._max_age_ms) // self._max_age_ms

    def nonce(self, org_id: str, agent_id: str, session_id: str, nbytes: int, now: float) -> str:
        """`nbytes` derived bytes as fixed-width decimal, like `formatter.new_nonce`.

        HMAC-SHA256 over ``epoch|org|agent|session``: org and agent are canonical
        UUIDs and the epoch a decimal (none holds ``|``), so the message is
        unambiguous whatever the session id holds. More than 32 bytes are
        expanded with a counter block, as HKDF-Expand does.
        """
        epoch = self.epoch(org_id, agent_id, session_id, now)
        message = f"{epoch}|".encode() + _session(org_id, agent_id, session_id)
        out = b""
        block = 0
        while len(out) < nbytes:
            out += self._digest(_DOMAIN + bytes([block]), message)
            block += 1
        width = len(str(2 ** (8 * nbytes) - 1))
        return f"{int.from_bytes(out[:nbytes], 'big'):0{width}d}"

    def _digest(self, prefix: bytes, message: bytes) -> bytes:
        return hmac.new(self._key, prefix + message, hashlib.sha256).digest()


def _session(org_id: str, agent_id: str, session_id: str) -> bytes:
    return f"{org_id}|{agent_id}|{session_id}".encode("utf-8", "surrogatepass")
