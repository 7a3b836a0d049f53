"""Session-scoped nonces (IBEX_CONTEXT_NONCE_KEY): derived, stable per session, never shown."""

from __future__ import annotations

import hashlib
import hmac
import logging

import pytest

from ibex.assembly.catalog import Catalog
from ibex.assembly.nonce import MIN_KEY_CHARS, NonceKey
from ibex.assembly.structs import AssemblyRequest
from ibex.assembly.tokens import Tokenizers
from ibex.config import NONCE_KEY_MIN_CHARS, ConfigError, Settings, load_settings
from ibex.service.assembler import Assembler
from ibex.service.root import load_static, open_assembler
from ibex.testing.samples import AGENT, ORG

KEY = "k" * 31 + "!"  # 32 characters
OTHER_ORG = "00000000-0000-4000-8000-000000000002"


def test_the_nonce_is_hmac_sha256_of_org_agent_session_in_fixed_width_decimal() -> None:
    nonce = NonceKey(KEY).nonce(ORG, AGENT, "s-1", 16)
    message = b"ibex-context-nonce-v1\x00\x00" + f"{ORG}|{AGENT}|s-1".encode()
    digest = hmac.new(KEY.encode(), message, hashlib.sha256).digest()
    assert nonce == f"{int.from_bytes(digest[:16], 'big'):039d}"
    assert len(nonce) == 39 and nonce.isdigit()


@pytest.mark.parametrize("nbytes", [8, 16, 32, 33, 64])
def test_every_nonce_size_has_the_random_nonces_width(nbytes: int) -> None:
    nonce = NonceKey(KEY).nonce(ORG, AGENT, "s", nbytes)
    assert len(nonce) == len(str(2 ** (8 * nbytes) - 1)) and nonce.isdigit()


def test_stable_within_a_session_and_distinct_across_sessions_tenants_and_keys() -> None:
    key = NonceKey(KEY)
    same = {key.nonce(ORG, AGENT, "s-1", 16) for _ in range(3)}
    assert len(same) == 1
    others = {
        key.nonce(ORG, AGENT, "s-2", 16),
        key.nonce(OTHER_ORG, AGENT, "s-1", 16),
        key.nonce(ORG, OTHER_ORG, "s-1", 16),
        NonceKey(KEY + "x").nonce(ORG, AGENT, "s-1", 16),
    }
    assert len(others) == 4 and same.isdisjoint(others)


def test_the_key_is_never_shown() -> None:
    key = NonceKey(KEY)
    assert KEY not in repr(key) and KEY not in str(key)
    with pytest.raises(ValueError, match="32"):
        NonceKey("short")


def test_settings_validate_and_redact_the_key() -> None:
    settings = load_settings({"IBEX_CONTEXT_NONCE_KEY": KEY})
    assert settings.nonce_key == KEY
    assert settings.redacted()["nonce_key"] == "<redacted>"
    assert load_settings({"IBEX_CONTEXT_NONCE_KEY": ""}).nonce_key is None
    with pytest.raises(ConfigError) as info:
        load_settings({"IBEX_CONTEXT_NONCE_KEY": "too-short-secret"})
    assert "IBEX_CONTEXT_NONCE_KEY" in str(info.value)
    assert "too-short-secret" not in str(info.value)
    assert NONCE_KEY_MIN_CHARS == MIN_KEY_CHARS


@pytest.fixture(scope="module")
def static() -> tuple[Catalog, Tokenizers]:
    return load_static(Settings())


def _request(session: str) -> AssemblyRequest:
    return AssemblyRequest(agent_id=AGENT, org_id=ORG, model="gpt-4o", session_id=session)


async def test_the_assembler_uses_the_session_nonce_only_with_a_key_and_a_session(
    caplog: pytest.LogCaptureFixture, static: tuple[Catalog, Tokenizers]
) -> None:
    caplog.set_level(logging.DEBUG)
    catalog, tokenizers = static
    with_key = load_settings({"IBEX_CONTEXT_NONCE_KEY": KEY})
    async with (
        open_assembler(with_key, catalog=catalog, tokenizers=tokenizers) as a,
        open_assembler(with_key, catalog=catalog, tokenizers=tokenizers) as b,
    ):
        assert isinstance(a, Assembler)
        # Two replicas with the same key: the same nonce for the session.
        assert a.nonce(_request("s-1")) == b.nonce(_request("s-1"))
        assert a.nonce(_request("s-1")) == NonceKey(KEY).nonce(ORG, AGENT, "s-1", 16)
        # No session: random per assembly.
        assert a.nonce(_request("")) != a.nonce(_request(""))
        result = await a.assemble(_request("s-1"))
        assert f'nonce="{a.nonce(_request("s-1"))}"' in result.assembled_context
    async with open_assembler(Settings(), catalog=catalog, tokenizers=tokenizers) as plain:
        assert plain.nonce(_request("s-1")) != plain.nonce(_request("s-1"))
    assert KEY not in caplog.text


@pytest.mark.parametrize("nbytes", [64, 96])
def test_nonces_past_one_digest_continue_with_counter_blocks_1_2(nbytes: int) -> None:
    """More than 32 bytes: the digests of blocks 0, 1, 2... concatenated (HKDF-Expand-like)."""
    message = f"{ORG}|{AGENT}|s".encode()
    out = b"".join(
        hmac.new(
            KEY.encode(), b"ibex-context-nonce-v1\x00" + bytes([b]) + message, hashlib.sha256
        ).digest()
        for b in range(-(-nbytes // 32))
    )
    width = len(str(2 ** (8 * nbytes) - 1))
    assert (
        NonceKey(KEY).nonce(ORG, AGENT, "s", nbytes) == f"{int.from_bytes(out[:nbytes]):0{width}d}"
    )


def test_a_key_or_session_that_is_not_valid_unicode_still_derives_a_nonce() -> None:
    """An environment value that is not UTF-8 reaches Python as lone surrogates."""
    key = NonceKey("k" * 31 + "\udcff")
    assert repr(key) == "NonceKey(<redacted>)"
    assert key.nonce(ORG, AGENT, "s\ud800", 16) != key.nonce(ORG, AGENT, "s", 16)
