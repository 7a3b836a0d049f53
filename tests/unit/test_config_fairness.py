"""The fairness settings: parsed, validated and derived into admission's config."""

from __future__ import annotations

import pytest

from ibex.config import ConfigError, load_settings
from ibex.service.root import admission_config


def test_the_per_org_cap_defaults_to_half_the_slots_and_can_be_set() -> None:
    assert admission_config(load_settings({})).max_org_concurrent == 8
    env = {"IBEX_CONTEXT_MAX_CONCURRENT_ASSEMBLIES": "5"}
    assert admission_config(load_settings(env)).max_org_concurrent == 2
    env = {"IBEX_CONTEXT_MAX_CONCURRENT_ASSEMBLIES": "1"}
    assert admission_config(load_settings(env)).max_org_concurrent == 1
    env = {"IBEX_CONTEXT_MAX_ORG_ASSEMBLIES": "3"}
    assert admission_config(load_settings(env)).max_org_concurrent == 3
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_MAX_ORG_ASSEMBLIES"):
        load_settings({"IBEX_CONTEXT_MAX_ORG_ASSEMBLIES": "0"})


def test_the_no_deadline_wait_is_a_duration_with_a_unit() -> None:
    assert admission_config(load_settings({})).max_queue_wait == 1.0
    env = {"IBEX_CONTEXT_MAX_QUEUE_WAIT": "2s"}
    assert admission_config(load_settings(env)).max_queue_wait == 2.0
    env = {"IBEX_CONTEXT_MAX_QUEUE_WAIT": "250ms"}
    assert admission_config(load_settings(env)).max_queue_wait == 0.25
    with pytest.raises(ConfigError, match="IBEX_CONTEXT_MAX_QUEUE_WAIT"):
        load_settings({"IBEX_CONTEXT_MAX_QUEUE_WAIT": "-1s"})


def test_the_thread_queue_bound_follows_the_in_flight_cap() -> None:
    assert admission_config(load_settings({})).max_thread_queue == 64
    env = {"IBEX_CONTEXT_MAX_IN_FLIGHT": "2"}
    assert admission_config(load_settings(env)).max_thread_queue == 1
