"""Session-scoped nonces (IBEX_CONTEXT_NONCE_KEY): derived, stable per session for at most
their lifetime (IBEX_CONTEXT_NONCE_MAX_AGE), never shown."""

from __future__ import annotations

import hashlib
import hmac
import logging

import pytest

from ibex.assembly.catalog import Catalog
from ibex.assembly.nonce import DEFAULT_MAX_AGE, MAX_MAX_AGE, MIN_KEY_CHARS, MIN_MAX_AGE, NonceKey
from ibex.assembly.structs import AssemblyRequest
from ibex.assembly.tokens import Tokenizers
from ibex.config import (
    NONCE_KEY_MIN_CHARS,
    NONCE_MAX_AGE_DEFAULT,
    NONCE_MAX_AGE_MAX,
    NONCE_MAX_AGE_MIN,
    ConfigError,
    Settings,
    load_settings,
)
from ibex.service.assembler import Assembler
from ibex.service.root import load_static, open_assembler
from ibex.testing.samples import AGENT, ORG

KEY = "k" * 31 + "!"  # 32 characters
OTHER_ORG = "00000000-0000-4000-8000-000000000002"
NOW = 1_800_000_000.0  # a Unix time (2027-01-15)


def _phase_ms(session: str, max_age: float, key: str = KEY) -> int:
    """The session's window shift: HMAC(key, phase domain | org|agent|session) mod max age."""
    message = b"ibex-context-nonce-phase-v1\x00" + f"{ORG}|{AGENT}|{session}".encode()
    digest = hmac.new(key.encode(), message, hashlib.sha256).digest()
    return int.from_bytes(digest, "big") % round(max_age * 1000)


def _window_start(session: str, max_age: float, now: float) -> float:
    """Unix time at which the session's window holding `now` began."""
    max_ms, phase = round(max_age * 1000), _phase_ms(session, max_age)
    epoch = (int(now * 1000) + phase) // max_ms
    return (epoch * max_ms - phase) / 1000


def test_the_nonce_is_hmac_sha256_of_epoch_org_agent_session_in_fixed_width_decimal() -> None:
    nonce = NonceKey(KEY).nonce(ORG, AGENT, "s-1", 16, NOW)
    epoch = (int(NOW * 1000) + _phase_ms("s-1", DEFAULT_MAX_AGE)) // 1_800_000
    message = b"ibex-context-nonce-v2\x00\x00" + f"{epoch}|{ORG}|{AGENT}|s-1".encode()
    digest = hmac.new(KEY.encode(), message, hashlib.sha256).digest()
    assert nonce == f"{int.from_bytes(digest[:16], 'big'):039d}"
    assert len(nonce) == 39 and nonce.isdigit()


@pytest.mark.parametrize("nbytes", [8, 16, 32, 33, 64])
def test_every_nonce_size_has_the_random_nonces_width(nbytes: int) -> None:
    nonce = NonceKey(KEY).nonce(ORG, AGENT, "s", nbytes, NOW)
    assert len(nonce) == len(str(2 ** (8 * nbytes) - 1)) and nonce.isdigit()


def test_stable_within_a_session_and_distinct_across_sessions_tenants_and_keys() -> None:
    key = NonceKey(KEY)
    same = {key.nonce(ORG, AGENT, "s-1", 16, NOW) for _ in range(3)}
    assert len(same) == 1
    others = {
        key.nonce(ORG, AGENT, "s-2", 16, NOW),
        key.nonce(OTHER_ORG, AGENT, "s-1", 16, NOW),
        key.nonce(ORG, OTHER_ORG, "s-1", 16, NOW),
        NonceKey(KEY + "x").nonce(ORG, AGENT, "s-1", 16, NOW),
    }
    assert len(others) == 4 and same.isdisjoint(others)


@pytest.mark.parametrize("max_age", [MIN_MAX_AGE, DEFAULT_MAX_AGE, 86400.0, MAX_MAX_AGE])
def test_a_session_nonce_is_stable_for_its_lifetime_then_rotates(max_age: float) -> None:
    """Same nonce from its window's first to its last millisecond; another in the next
    window, and another again in the one after."""
    key = NonceKey(KEY, max_age)
    start = _window_start("s-1", max_age, NOW)
    assert start <= NOW < start + max_age

    def at(t: float) -> str:
        return key.nonce(ORG, AGENT, "s-1", 16, t)

    # Times a millisecond or more inside a window: the derivation truncates to milliseconds.
    current = at(start + 0.001)
    assert {at(NOW), at(start + max_age - 0.002)} == {current}
    before = at(start - 0.002)
    after, later = at(start + max_age + 0.001), at(start + 2 * max_age + 0.001)
    assert len({before, current, after, later}) == 4
    assert at(start + max_age + max_age / 2) == after  # and the next one is stable in turn


def test_sessions_rotate_at_different_moments() -> None:
    """The window is shifted per session, so a provider's caches do not all go cold at once."""
    key = NonceKey(KEY, DEFAULT_MAX_AGE)
    sessions = [f"s-{i}" for i in range(32)]
    starts = {_window_start(s, DEFAULT_MAX_AGE, NOW) for s in sessions}
    assert len(starts) == len(sessions)
    # A moment where one session rotates and another does not.
    first, second = sorted(sessions, key=lambda s: _window_start(s, DEFAULT_MAX_AGE, NOW))[-2:]
    boundary = _window_start(second, DEFAULT_MAX_AGE, NOW)
    assert key.nonce(ORG, AGENT, second, 16, boundary - 0.002) != key.nonce(
        ORG, AGENT, second, 16, boundary + 0.001
    )
    assert key.nonce(ORG, AGENT, first, 16, boundary - 0.002) == key.nonce(
        ORG, AGENT, first, 16, boundary + 0.001
    )


def test_the_key_is_never_shown() -> None:
    key = NonceKey(KEY)
    assert KEY not in repr(key) and KEY not in str(key)
    with pytest.raises(ValueError, match="32"):
        NonceKey("short")
    with pytest.raises(ValueError, match="lifetime"):
        NonceKey(KEY, MIN_MAX_AGE / 2)


def test_settings_read_the_lifetime_with_a_unit_within_its_bounds() -> None:
    assert Settings().nonce_max_age == NONCE_MAX_AGE_DEFAULT == DEFAULT_MAX_AGE == 1800.0
    assert (NONCE_MAX_AGE_MIN, NONCE_MAX_AGE_MAX) == (MIN_MAX_AGE, MAX_MAX_AGE)
    assert load_settings({"IBEX_CONTEXT_NONCE_MAX_AGE": "10m"}).nonce_max_age == 600.0
    assert load_settings({"IBEX_CONTEXT_NONCE_MAX_AGE": "720h"}).nonce_max_age == MAX_MAX_AGE
    for raw in ("600", "59s", "721h", "-5s", "soon"):
        with pytest.raises(ConfigError) as info:
            load_settings({"IBEX_CONTEXT_NONCE_MAX_AGE": raw})
        assert "IBEX_CONTEXT_NONCE_MAX_AGE" in str(info.value)


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
        a.wall_clock = b.wall_clock = lambda: NOW
        # Two replicas with the same key: the same nonce for the session.
        assert a.nonce(_request("s-1")) == b.nonce(_request("s-1"))
        assert a.nonce(_request("s-1")) == NonceKey(KEY).nonce(ORG, AGENT, "s-1", 16, NOW)
        # No session: random per assembly.
        assert a.nonce(_request("")) != a.nonce(_request(""))
        result = await a.assemble(_request("s-1"))
        assert f'nonce="{a.nonce(_request("s-1"))}"' in result.assembled_context
    async with open_assembler(Settings(), catalog=catalog, tokenizers=tokenizers) as plain:
        assert plain.nonce(_request("s-1")) != plain.nonce(_request("s-1"))
    assert KEY not in caplog.text


async def test_the_assembler_rotates_a_session_nonce_after_its_lifetime(
    static: tuple[Catalog, Tokenizers],
) -> None:
    """IBEX_CONTEXT_NONCE_MAX_AGE reaches the assembler; its clock (injected) picks the window."""
    catalog, tokenizers = static
    settings = load_settings({"IBEX_CONTEXT_NONCE_KEY": KEY, "IBEX_CONTEXT_NONCE_MAX_AGE": "2m"})
    start = _window_start("s-1", 120.0, NOW)
    now = [start + 0.001]
    async with open_assembler(settings, catalog=catalog, tokenizers=tokenizers) as a:
        a.wall_clock = lambda: now[0]
        first = a.nonce(_request("s-1"))
        turns = []
        for t in (start + 1, start + 60, start + 119.99):
            now[0] = t
            turns.append(a.nonce(_request("s-1")))
        assert turns == [first] * 3
        now[0] = start + 120.001
        rotated = a.nonce(_request("s-1"))
        assert rotated != first
        result = await a.assemble(_request("s-1"))
    assert f'nonce="{rotated}"' in result.assembled_context
    assert first not in result.assembled_context


@pytest.mark.parametrize("nbytes", [64, 96])
def test_nonces_past_one_digest_continue_with_counter_blocks_1_2(nbytes: int) -> None:
    """More than 32 bytes: the digests of blocks 0, 1, 2... concatenated (HKDF-Expand-like)."""
    epoch = (int(NOW * 1000) + _phase_ms("s", DEFAULT_MAX_AGE)) // 1_800_000
    message = f"{epoch}|{ORG}|{AGENT}|s".encode()
    out = b"".join(
        hmac.new(
            KEY.encode(), b"ibex-context-nonce-v2\x00" + bytes([b]) + message, hashlib.sha256
        ).digest()
        for b in range(-(-nbytes // 32))
    )
    width = len(str(2 ** (8 * nbytes) - 1))
    assert (
        NonceKey(KEY).nonce(ORG, AGENT, "s", nbytes, NOW)
        == f"{int.from_bytes(out[:nbytes]):0{width}d}"
    )


def test_a_key_or_session_that_is_not_valid_unicode_still_derives_a_nonce() -> None:
    """An environment value that is not UTF-8 reaches Python as lone surrogates."""
    key = NonceKey("k" * 31 + "\udcff")
    assert repr(key) == "NonceKey(<redacted>, max_age=1800)"
    assert key.nonce(ORG, AGENT, "s\ud800", 16, NOW) != key.nonce(ORG, AGENT, "s", 16, NOW)
