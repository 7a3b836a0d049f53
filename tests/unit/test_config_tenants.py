"""IBEX_CONTEXT_AUTH_TOKEN_ORGS and IBEX_CONTEXT_REQUIRE_PRINCIPAL, as docs/configuration.md
describes them: `sha256=org-uuid[+org-uuid...]` entries, each hash one of
AUTH_TOKENS_SHA256, refused at start with a message naming the variable."""

from __future__ import annotations

import hashlib

import pytest

from ibex.config import ConfigError, load_settings
from ibex.service.auth import Authenticator

A = "00000000-0000-4000-8000-0000000000a0"
B = "00000000-0000-4000-8000-0000000000b0"
H1 = hashlib.sha256(b"token-one").hexdigest()
H2 = hashlib.sha256(b"token-two").hexdigest()
VAR = "IBEX_CONTEXT_AUTH_TOKEN_ORGS"


def env(orgs: str, hashes: str = f"{H1},{H2}") -> dict[str, str]:
    return {"IBEX_CONTEXT_AUTH_TOKENS_SHA256": hashes, VAR: orgs}


def test_entries_bind_tokens_to_canonical_org_ids() -> None:
    settings = load_settings(env(f"{H1.upper()}={A.upper()}+{{{B}}}, {H2}={B}+{B}"))
    assert settings.auth_token_orgs == ((H1, (A, B)), (H2, (B,)))
    assert load_settings({}).auth_token_orgs == ()
    assert load_settings({}).require_principal is False
    assert load_settings({"IBEX_CONTEXT_REQUIRE_PRINCIPAL": "true"}).require_principal is True


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (f"{H1}", "must be sha256=org-uuid"),
        (f"{H1[:-1]}={A}", "must be sha256=org-uuid"),
        (f"{H1}=", "is not an org UUID"),
        (f"{H1}={A}+acme", "'acme' is not an org UUID"),
        (f"{H1}={A}+", "is not an org UUID"),
        (f"{H1}={A},{H1}={B}", "entry 2 names a token hash already bound"),
        (f"{hashlib.sha256(b'other').hexdigest()}={A}", "not in IBEX_CONTEXT_AUTH_TOKENS_SHA256"),
    ],
)
def test_a_wrong_entry_stops_start_up_naming_the_variable(raw: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env(raw))
    assert str(info.value).startswith(VAR) and why in str(info.value)


def test_a_bound_hash_without_accepted_tokens_is_refused() -> None:
    with pytest.raises(ConfigError, match=f"^{VAR}: .*AUTH_TOKENS_SHA256"):
        load_settings({VAR: f"{H1}={A}"})


def test_the_hashes_are_never_shown() -> None:
    settings = load_settings(env(f"{H1}={A}"))
    assert H1 not in repr(settings.redacted())
    with pytest.raises(ConfigError) as info:
        load_settings(env(f"{hashlib.sha256(b'x').hexdigest()}={A}"))
    assert hashlib.sha256(b"x").hexdigest() not in str(info.value)


def test_a_bound_callers_fairness_key_is_its_whole_scope() -> None:
    auth = Authenticator(token_hashes=(H1, H2), token_orgs={H1: (B, A)})
    bound = auth.caller({"authorization": "Bearer token-one"}, None)
    free = auth.caller({"authorization": "Bearer token-two"}, None)
    assert bound.may_act_for(A) and bound.may_act_for(B) and not bound.may_act_for("c")
    assert bound.fairness_key(A) == bound.fairness_key(B) == f"{A}+{B}"
    assert free.may_act_for(B) and free.fairness_key(B) == B
    # One org in scope: the key is that org, shared with every other caller acting for it.
    single = Authenticator(token_hashes=(H1,), token_orgs={H1: (A,)})
    assert single.caller({"authorization": "Bearer token-one"}, None).fairness_key(A) == A
